"""Cost of committing after every step: ``checkpoint_interval=1`` vs no intermediate commit, 50 ms batches.

    python -m benchmarks.commit_interval                 # 1 process, 100 batches of 50 ms busy work
    python -m benchmarks.commit_interval --nproc 2       # 2 processes under torchrun
    python -m benchmarks.commit_interval --sleep         # batches that sleep (a GPU-bound job's CPU side)

Each batch writes one small file through ``upload_path()``. "No intermediate commit" is
``checkpoint_interval`` larger than the job (only the final commit). The hand-written loop over the
same batches is the reference line. Goal: interval 1 reaches >= 0.97 of the throughput without
intermediate commits. Variants alternate within each round; the per-round ratios' median is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.launch import run_synthetic
from benchmarks.report import emit_figures, fmt_spread, machine, machine_line, median_spread, new_results_dir, save_json

GOAL = 0.97
NO_COMMITS = 10**9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--batches", type=int, default=100, help="global batches per run")
    parser.add_argument("--work-ms", type=float, default=50.0)
    parser.add_argument("--sleep", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    out_dir = new_results_dir(f"commit-interval-p{args.nproc}")
    variants = {"interval 1": ["--interval", "1"], "no intermediate commit": ["--interval", str(NO_COMMITS)],
                "hand loop": ["--mode", "hand"]}
    base = ["--examples", str(args.batches), "--batch-size", "1", "--work-ms", str(args.work_ms)]
    base += ["--sleep"] if args.sleep else []
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tbp-commit-interval-") as scratch:
        for index in range(args.rounds):
            names = list(variants)
            names = names[index % len(names):] + names[: index % len(names)]
            entry: dict[str, float] = {}
            for name in names:
                tag = name.replace(" ", "_")
                storage = Path(scratch) / f"r{index}-{tag}"
                reports, _ = run_synthetic(
                    [*base, *variants[name], "--storage", str(storage)], args.nproc,
                    Path(scratch) / f"report-{index}-{tag}", out_dir / "logs" / f"r{index}-{tag}.log",
                )
                call_s = max(r["end"] for r in reports) - max(r["start"] for r in reports)
                entry[name] = args.batches / call_s
                if name == "interval 1":
                    entry["commits"] = reports[0].get("commits", 0)
            entry["ratio"] = entry["interval 1"] / entry["no intermediate commit"]
            entry["ratio_vs_hand"] = entry["interval 1"] / entry["hand loop"]
            rounds.append(entry)
            print(f"round {index}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()), file=sys.stderr)
    ratio = statistics.median(r["ratio"] for r in rounds)
    info = machine()
    summary = {"nproc": args.nproc, "batches": args.batches, "work_ms": args.work_ms, "sleep": args.sleep,
               "ratio_median": ratio, "goal": GOAL, "met": ratio >= GOAL}
    save_json(out_dir / "results.json", {"machine": info, "summary": summary, "rounds": rounds})
    kind = "sleep" if args.sleep else "busy"
    print("| Procs | Batch | interval 1, batches/s | no intermediate commit, batches/s | hand loop, batches/s "
          "| interval 1 / none | interval 1 / hand loop | Goal |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    print(
        f"| {args.nproc} | {args.work_ms:g} ms {kind} | {fmt_spread((r['interval 1'] for r in rounds), 2)} "
        f"| {fmt_spread((r['no intermediate commit'] for r in rounds), 2)} | {fmt_spread((r['hand loop'] for r in rounds), 2)} "
        f"| {fmt_spread((r['ratio'] for r in rounds), 3)} | {fmt_spread((r['ratio_vs_hand'] for r in rounds), 3)} "
        f"| >= {GOAL} {'met' if ratio >= GOAL else 'MISSED'} |"
    )
    emit_figures({f"commit_interval.p{args.nproc}.ratio": list(median_spread(r["ratio"] for r in rounds))})
    print(f"\nThroughput counts global batches per second of the torch_batch_process call (hand loop: of its loop); "
          f"median [min–max] of {args.rounds} rounds. Machine: {machine_line(info)}.")
    print(f"results: {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
