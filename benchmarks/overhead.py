"""Overhead of torch_batch_process against the hand-written loop (issue 2): throughput ratio, goal >= 0.99.

    python -m benchmarks.overhead                      # 1 process, CNN workload, 7 rounds
    python -m benchmarks.overhead --nproc 2            # 2 processes under torchrun
    python -m benchmarks.overhead --workload minilm --rounds 3

Same model, data, DataLoader settings and output files for both; torch_batch_process runs with its
defaults (``checkpoint_interval=5``, local storage). With 1 process both run in this very process,
alternately (which one goes first alternates too), so imports and interpreter start-up are out of
the picture; with more processes each run is a torchrun command. Each round yields a ratio
(torch_batch_process / hand loop, same round); the median ratio is the result. This is a
measurement, not a test: nothing fails when the goal is missed.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import Options
from benchmarks.launch import run_contender, steady_throughput, worker_env
from benchmarks.report import fmt_spread, machine, machine_line, new_results_dir, save_json
from benchmarks.workloads import SIZES, Workload, configure_process

GOAL = 0.99


def _in_process(contender: str, workload: Workload, workers: int, scratch: Path) -> dict[str, Any]:
    from benchmarks.contenders import hand_loop, tbp

    shutil.rmtree(scratch, ignore_errors=True)
    opts = Options(workload, scratch / "out", scratch / "report", nproc=1, workers=workers, threads=1)
    cpu0 = _cpu_seconds()
    report = (hand_loop if contender == "hand_loop" else tbp).run(opts)
    cpu = _cpu_seconds() - cpu0
    shutil.rmtree(scratch, ignore_errors=True)
    job_s = report["end"] - report["start"]
    return {
        "job_s": job_s,
        "job_throughput": workload.num_examples / job_s,
        "steady_throughput": steady_throughput([report]),
        "cpu_s": cpu,
    }


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the DataLoader workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("cnn", "minilm"), default="cnn")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--num-examples", type=int, default=None)
    parser.add_argument("--workers", type=int, default=None, help="DataLoader workers per process")
    args = parser.parse_args(argv)
    num_examples, batch_size = SIZES[args.workload]["full"]
    num_examples = args.num_examples or num_examples
    cores = os.cpu_count() or 1
    workers = args.workers or (max(1, cores // args.nproc) if args.workload == "cnn" else 1)
    out_dir = new_results_dir(f"overhead-{args.workload}-p{args.nproc}")
    cache = out_dir.parent / "cache"
    workload = Workload(args.workload, num_examples, batch_size, cache)
    if args.nproc == 1:
        os.environ.update({k: v for k, v in worker_env().items() if k not in ("PYTHONPATH",)})
        configure_process(1)
        workload.warm_imports()
        workload.dataset()  # builds the text cache once

    rounds: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="tbp-overhead-"))
    try:
        for index in range(args.rounds):
            order = ["hand_loop", "tbp"] if index % 2 == 0 else ["tbp", "hand_loop"]
            entry: dict[str, Any] = {"round": index}
            for contender in order:
                if args.nproc == 1:
                    entry[contender] = _in_process(contender, workload, workers, scratch / contender)
                else:
                    result = run_contender(
                        contender, args.workload, args.nproc, num_examples, batch_size, workers,
                        work_dir=scratch / contender, log_path=out_dir / "logs" / f"r{index}-{contender}.log",
                        round_index=index, cache_dir=cache,
                    )
                    if not result.ok:
                        print(f"round {index}: {contender} failed: {result.error}", file=sys.stderr)
                        return 1
                    entry[contender] = {"job_s": result.job_s, "job_throughput": result.job_throughput,
                                        "steady_throughput": result.steady_throughput, "wall_s": result.wall_s}
            entry["ratio"] = entry["tbp"]["job_throughput"] / entry["hand_loop"]["job_throughput"]
            hs, ts = entry["hand_loop"]["steady_throughput"], entry["tbp"]["steady_throughput"]
            entry["steady_ratio"] = ts / hs if hs and ts else None
            hc, tc = entry["hand_loop"].get("cpu_s"), entry["tbp"].get("cpu_s")
            entry["cpu_ratio"] = tc / hc if hc and tc else None
            rounds.append(entry)
            print(
                f"round {index}: hand loop {entry['hand_loop']['job_throughput']:,.0f} ex/s, torch_batch_process "
                f"{entry['tbp']['job_throughput']:,.0f} ex/s, ratio {entry['ratio']:.3f} (steady {entry['steady_ratio'] or 0:.3f}, "
                f"CPU time {entry['cpu_ratio'] or 0:.3f})",
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    ratio = statistics.median(r["ratio"] for r in rounds)
    info = machine()
    summary = {
        "workload": args.workload,
        "num_examples": num_examples,
        "batch_size": batch_size,
        "nproc": args.nproc,
        "workers": workers,
        "ratio_median": ratio,
        "goal": GOAL,
        "met": ratio >= GOAL,
    }
    save_json(out_dir / "results.json", {"machine": info, "summary": summary, "rounds": rounds})
    print("| Workload | Procs | Hand loop, ex/s | torch_batch_process, ex/s | Ratio (job) | Ratio (steady) | Goal |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.workload}, {num_examples:,} ex, batch {batch_size} | {args.nproc} "
        f"| {fmt_spread(r['hand_loop']['job_throughput'] for r in rounds)} "
        f"| {fmt_spread(r['tbp']['job_throughput'] for r in rounds)} "
        f"| {fmt_spread((r['ratio'] for r in rounds), 3)} | {fmt_spread((r['steady_ratio'] for r in rounds), 3)} "
        f"| >= {GOAL} {'met' if ratio >= GOAL else 'MISSED'} |"
    )
    print(f"\nMedian [min–max] of {args.rounds} alternating rounds. Machine: {machine_line(info)}.")
    print(f"results: {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
