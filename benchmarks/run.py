"""Runs every contender on every workload with 1 and 2 processes and prints the comparison table.

    python -m benchmarks.run            # the full table (about 20-25 min on 2 cores)
    python -m benchmarks.run --quick    # a smoke run: small sizes, one round, 1 process (< 3 min)

Rounds are interleaved: in each round every (workload, processes) configuration runs every
contender once, back to back, in an order that rotates from round to round. Each contender's
throughput is divided by the hand-written loop's throughput *of the same round* and the table shows
the median of those ratios with their min-max spread, so the machine's slow drift cancels out.

Two throughputs are reported: *job* (examples / time from the moment every process is ready, after
its imports, to the moment the last output file is written: the framework's own cost) and
*end-to-end* (examples / wall time of the whole command, interpreter start and imports included:
what a user waits for). Results go to ``bench_results/run-<time>/`` (``results.json``, ``table.md``,
one log per run); ``bench_results/`` is git-ignored.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.launch import CONTENDERS, LABELS, WORKLOADS_OF, RunResult, run_contender
from benchmarks.report import emit_figures, fmt_spread, machine, machine_line, new_results_dir, save_json
from benchmarks.workloads import SIZES, WORKLOADS, load_sentences


def workers_for(workload: str, nproc: int) -> int:
    """DataLoader workers per process, the same for every contender: the cores shared out for the
    data-loading-bound CNN, one per process (tokenization) for MiniLM."""
    cores = os.cpu_count() or 1
    return max(1, cores // nproc) if workload == "cnn" else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 round, 1 process")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, quick 1)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ",".join(CONTENDERS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of cnn,minilm")
    parser.add_argument("--nprocs", default=None, help="comma-separated process counts (default 1,2; quick 1)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the number of examples")
    parser.add_argument("--render", type=Path, default=None, help="only print the table of a results.json")
    args = parser.parse_args(argv)
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    if "hand_loop" not in args.contenders:
        parser.error("--contenders must include hand_loop: every ratio is taken against it")
    args.workloads = [w for w in args.workloads.split(",") if w]
    if set(args.workloads) - set(WORKLOADS):
        parser.error(f"--workloads: choose from {list(WORKLOADS)}")
    args.rounds = args.rounds or (1 if args.quick else 3)
    nprocs = args.nprocs or ("1" if args.quick else "1,2")
    args.nprocs = [int(n) for n in nprocs.split(",")]
    return args


def runs_in(contenders: list[str], workload: str) -> list[str]:
    """The contenders that run ``workload`` (sentence-transformers embeds text: not the CNN)."""
    return [c for c in contenders if workload in WORKLOADS_OF.get(c, (workload,))]


def sizes(workload: str, quick: bool, scale: float) -> tuple[int, int]:
    num_examples, batch_size = SIZES[workload]["quick" if quick else "full"]
    return max(batch_size, int(num_examples * scale)), batch_size


def render_saved(path: Path) -> str:
    """The table of a saved ``results.json`` (also of a run that was stopped midway)."""
    import json

    saved = json.loads(path.read_text())
    fields = set(RunResult.__dataclass_fields__)
    results = [RunResult(**{k: v for k, v in run.items() if k in fields}) for run in saved["runs"]]
    args = argparse.Namespace(**saved["args"])
    args.rounds = len({r.round for r in results})
    return render_table(results, args, saved["machine"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        print(render_saved(args.render))
        return 0
    out_dir = new_results_dir("quick" if args.quick else "run")
    cache = out_dir.parent / "cache"
    info = machine()
    configs = [(w, n) for w in args.workloads for n in args.nprocs]
    if "minilm" in args.workloads:
        load_sentences(sizes("minilm", args.quick, args.scale)[0], cache)  # once, before any timing
    print(f"results: {out_dir}", file=sys.stderr)
    results: list[RunResult] = []
    total = args.rounds * sum(len(runs_in(args.contenders, w)) for w, _ in configs)
    t0 = time.time()
    for round_index in range(args.rounds):
        for config_index, (workload, nproc) in enumerate(configs):
            contenders = runs_in(args.contenders, workload)
            shift = (round_index + config_index) % len(contenders)
            order = contenders[shift:] + contenders[:shift]
            num_examples, batch_size = sizes(workload, args.quick, args.scale)
            for contender in order:
                tag = f"r{round_index}-{workload}-p{nproc}-{contender}"
                result = run_contender(
                    contender, workload, nproc, num_examples, batch_size, workers_for(workload, nproc),
                    work_dir=out_dir / "work" / tag, log_path=out_dir / "logs" / f"{tag}.log",
                    round_index=round_index, cache_dir=cache,
                )
                results.append(result)
                status = f"{result.job_throughput:,.0f} ex/s (job), wall {result.wall_s:.1f} s" if result.ok else f"FAILED: {result.error}"
                print(f"[{len(results)}/{total} {time.time() - t0:.0f}s] {tag}: {status}", file=sys.stderr)
                save_json(out_dir / "results.json", {"machine": info, "args": vars(args), "runs": [r.to_json() for r in results]})
    table = render_table(results, args, info)
    (out_dir / "table.md").write_text(table)
    emit_figures({
        f"run.{row['workload']}.p{row['nproc']}.{row['contender']}.{clock}": list(row[f"{clock}_ratio"])
        for row in summarize(results) for clock in ("job", "steady", "wall")
    })
    save_json(out_dir / "results.json", {"machine": info, "args": vars(args), "runs": [r.to_json() for r in results],
                                         "summary": summarize(results)})
    print(table)
    print(f"results: {out_dir}", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


def _ratios(results: list[RunResult], workload: str, nproc: int, contender: str, attr: str) -> list[float]:
    """Per-round ratios of ``contender``'s throughput to the hand loop's in the same round."""
    by_round: dict[int, dict[str, float | None]] = {}
    for r in results:
        if r.workload == workload and r.nproc == nproc:
            by_round.setdefault(r.round, {})[r.contender] = getattr(r, attr)
    ratios = []
    for runs in by_round.values():
        mine, hand = runs.get(contender), runs.get("hand_loop")
        if mine and hand:
            ratios.append(mine / hand)
    return ratios


def summarize(results: list[RunResult]) -> list[dict[str, Any]]:
    from benchmarks.report import median_spread

    rows = []
    keys = sorted({(r.workload, r.nproc, r.contender) for r in results}, key=lambda k: (k[0], k[1], CONTENDERS.index(k[2])))
    for workload, nproc, contender in keys:
        runs = [r for r in results if (r.workload, r.nproc, r.contender) == (workload, nproc, contender)]
        rows.append({
            "workload": workload,
            "nproc": nproc,
            "contender": contender,
            "runs": len(runs),
            "failed": sum(not r.ok for r in runs),
            "job_throughput": median_spread(r.job_throughput for r in runs),
            "wall_throughput": median_spread(r.wall_throughput for r in runs),
            "job_ratio": median_spread(_ratios(results, workload, nproc, contender, "job_throughput")),
            "wall_ratio": median_spread(_ratios(results, workload, nproc, contender, "wall_throughput")),
            "steady_ratio": median_spread(_ratios(results, workload, nproc, contender, "steady_throughput")),
            "first_batch_s": median_spread(r.first_batch_s for r in runs),
        })
    return rows


def render_table(results: list[RunResult], args: argparse.Namespace, info: dict[str, Any]) -> str:
    lines = [
        "| Workload | Procs | Contender | Job, ex/s | × hand loop (job) | × hand loop (steady) | End-to-end, ex/s "
        "| × hand loop (end-to-end) | Failed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"cnn": "CNN 32x32 (data-bound)", "minilm": "MiniLM-L6 embeddings (compute-bound)"}
    for row in summarize(results):
        runs = [r for r in results if (r.workload, r.nproc, r.contender) == (row["workload"], row["nproc"], row["contender"])]
        n, _ = sizes(row["workload"], args.quick, args.scale)
        lines.append(
            f"| {names[row['workload']]}, {n:,} ex | {row['nproc']} | {LABELS[row['contender']]} "
            f"| {fmt_spread(r.job_throughput for r in runs)} "
            f"| {fmt_spread(_ratios(results, row['workload'], row['nproc'], row['contender'], 'job_throughput'), 3)} "
            f"| {fmt_spread(_ratios(results, row['workload'], row['nproc'], row['contender'], 'steady_throughput'), 3)} "
            f"| {fmt_spread(r.wall_throughput for r in runs)} "
            f"| {fmt_spread(_ratios(results, row['workload'], row['nproc'], row['contender'], 'wall_throughput'), 3)} "
            f"| {row['failed']}/{row['runs']} |"
        )
    lines.append("")
    lines.append(
        f"Median [min–max] over {args.rounds} interleaved round(s); ratios are taken within each round. *Job*: from "
        "every process ready (imports done) to the last output written; *steady*: between each process's first and "
        "last batch (per-batch cost only; n/a for Ray and sentence-transformers, whose batches run out of sight); "
        "*end-to-end*: the whole "
        f"command. Machine: {machine_line(info)}."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
