"""Resuming a 90%-done job vs running the whole job: wall time (goal: resume <= 0.15 of a full run).

    python -m benchmarks.resume                 # 1 process, 200 batches of 50 ms, checkpoint_interval=5
    python -m benchmarks.resume --nproc 2

A job is preempted (SIGTERM, as a cluster would send) after 90% of its batches: it commits and stops.
Re-running the same command resumes it; that resume is timed against a full run of the same job on
a fresh storage path. Both the ``torch_batch_process`` call and the whole command (interpreter start,
imports, torchrun) are timed: the call is the library's part, the command what a user waits for.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.launch import run_synthetic
from benchmarks.report import emit_figures, fmt_spread, machine, machine_line, median_spread, new_results_dir, save_json

GOAL = 0.15


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--work-ms", type=float, default=50.0)
    parser.add_argument("--done", type=float, default=0.9, help="fraction done before the resume")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    out_dir = new_results_dir(f"resume-p{args.nproc}")
    base = ["--examples", str(args.batches), "--batch-size", "1", "--work-ms", str(args.work_ms)]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tbp-resume-") as scratch:
        for index in range(args.rounds):
            root = Path(scratch) / f"r{index}"
            entry: dict[str, float] = {}
            order = ["full", "resume"] if index % 2 == 0 else ["resume", "full"]
            for kind in order:
                storage = root / kind
                if kind == "resume":
                    reports, _ = run_synthetic(
                        [*base, "--storage", str(storage), "--preempt-at", str(args.done)], args.nproc,
                        root / "report-prep", out_dir / "logs" / f"r{index}-prep.log",
                    )
                    if not all(r["preempted"] for r in reports):
                        raise RuntimeError("the preparation run was not preempted")
                    entry["committed_before"] = reports[0]["batches_committed"]
                reports, wall = run_synthetic(
                    [*base, "--storage", str(storage)], args.nproc, root / f"report-{kind}",
                    out_dir / "logs" / f"r{index}-{kind}.log",
                )
                if not all(r["finished"] for r in reports):
                    raise RuntimeError(f"the {kind} run did not finish")
                entry[f"{kind}_call_s"] = max(r["end"] for r in reports) - max(r["start"] for r in reports)
                entry[f"{kind}_wall_s"] = wall
                if kind == "resume":
                    entry["resume_batches"] = reports[0]["batches_processed"]
            entry["call_ratio"] = entry["resume_call_s"] / entry["full_call_s"]
            entry["wall_ratio"] = entry["resume_wall_s"] / entry["full_wall_s"]
            rounds.append(entry)
            print(f"round {index}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()), file=sys.stderr)
    ratio = statistics.median(r["call_ratio"] for r in rounds)
    info = machine()
    summary = {"nproc": args.nproc, "batches": args.batches, "work_ms": args.work_ms, "done": args.done,
               "call_ratio_median": ratio, "wall_ratio_median": statistics.median(r["wall_ratio"] for r in rounds),
               "goal": GOAL, "met": ratio <= GOAL}
    save_json(out_dir / "results.json", {"machine": info, "summary": summary, "rounds": rounds})
    print("| Procs | Job | Full run: call / command, s | Resume at 90%: call / command, s | Batches redone "
          "| Resume / full (call) | Resume / full (command) | Goal |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    redone = statistics.median(r["resume_batches"] - (args.batches - r["committed_before"]) for r in rounds)
    print(
        f"| {args.nproc} | {args.batches} batches x {args.work_ms:g} ms "
        f"| {fmt_spread((r['full_call_s'] for r in rounds), 2)} / {fmt_spread((r['full_wall_s'] for r in rounds), 2)} "
        f"| {fmt_spread((r['resume_call_s'] for r in rounds), 2)} / {fmt_spread((r['resume_wall_s'] for r in rounds), 2)} "
        f"| {redone:g} | {fmt_spread((r['call_ratio'] for r in rounds), 3)} | {fmt_spread((r['wall_ratio'] for r in rounds), 3)} "
        f"| <= {GOAL} {'met' if ratio <= GOAL else 'MISSED'} (call) |"
    )
    emit_figures({f"resume.p{args.nproc}.call_ratio": list(median_spread(r["call_ratio"] for r in rounds))})
    print(f"\nMedian [min–max] of {args.rounds} rounds. Machine: {machine_line(info)}.")
    print(f"results: {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
