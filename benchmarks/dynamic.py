"""Dynamic scheduling (DESIGN §8) on skewed batch times: hand loop vs ``schedule="static"`` vs ``"dynamic"``.

    python -m benchmarks.dynamic                       # 2 processes, 400 batches, log-normal times, last rank 1.5x
    python -m benchmarks.dynamic --skew 0 --slow 1     # even batches: what dynamic costs when nothing is skewed

Batch ``g`` sleeps ``--work-ms`` times a log-normal draw seeded by ``g`` (the same on every run), and the
last rank's batches take ``--slow`` times longer: a slow host or GPU next to uneven inputs. The hand loop
deals batch ``g`` to rank ``g % W`` as users write it (and as ``"static"`` does), so every rank waits for the
slowest at the end; ``"dynamic"`` lets the fast rank take more batches. Throughput is global batches per
second of the whole call (start-up and the final commit included); the ratios are per round (the variants
alternate in each round) and the table shows their median [min-max].
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.launch import run_synthetic
from benchmarks.report import emit_figures, fmt_spread, machine, machine_line, median_spread, new_results_dir, save_json

GOAL = 1.15
VARIANTS = {
    "hand loop": ["--mode", "hand"],
    "static": ["--schedule", "static"],
    "dynamic": ["--schedule", "dynamic"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batches", type=int, default=400, help="global batches per run")
    parser.add_argument("--work-ms", type=float, default=50.0, help="median batch time")
    parser.add_argument("--skew", type=float, default=0.5, help="sigma of the log-normal batch times")
    parser.add_argument("--slow", type=float, default=1.5, help="the last rank's slowdown")
    parser.add_argument("--busy", action="store_true", help="busy CPU work instead of sleeping (GPU wait)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    out_dir = new_results_dir(f"dynamic-p{args.nproc}")
    base = ["--examples", str(args.batches), "--batch-size", "1", "--work-ms", str(args.work_ms),
            "--skew", str(args.skew), "--slow-rank-factor", str(args.slow)]
    base += [] if args.busy else ["--sleep"]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="tbp-dynamic-") as scratch:
        for index in range(args.rounds):
            names = list(VARIANTS)
            names = names[index % len(names):] + names[: index % len(names)]
            entry: dict[str, float] = {}
            for name in names:
                tag = name.replace(" ", "_")
                reports, _ = run_synthetic(
                    [*base, *VARIANTS[name], "--storage", str(Path(scratch) / f"r{index}-{tag}")], args.nproc,
                    Path(scratch) / f"report-{index}-{tag}", out_dir / "logs" / f"r{index}-{tag}.log",
                )
                call_s = max(r["end"] for r in reports) - min(r["start"] for r in reports)
                entry[name] = args.batches / call_s
            entry["dynamic / hand"] = entry["dynamic"] / entry["hand loop"]
            entry["static / hand"] = entry["static"] / entry["hand loop"]
            rounds.append(entry)
            print(f"round {index}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()), file=sys.stderr)
    ratio = statistics.median(r["dynamic / hand"] for r in rounds)
    info = machine()
    summary = {**vars(args), "ratio_median": ratio, "goal": GOAL, "met": ratio >= GOAL}
    save_json(out_dir / "results.json", {"machine": info, "summary": summary, "rounds": rounds})
    kind = "busy" if args.busy else "sleep"
    print("| Procs | Batches | hand loop, batches/s | static, batches/s | dynamic, batches/s "
          "| static / hand | dynamic / hand | Goal |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    print(
        f"| {args.nproc} | {args.batches} x {args.work_ms:g} ms {kind}, log-normal sigma {args.skew:g}, last rank "
        f"x{args.slow:g} | {fmt_spread((r['hand loop'] for r in rounds), 2)} | {fmt_spread((r['static'] for r in rounds), 2)} "
        f"| {fmt_spread((r['dynamic'] for r in rounds), 2)} | {fmt_spread((r['static / hand'] for r in rounds), 3)} "
        f"| {fmt_spread((r['dynamic / hand'] for r in rounds), 3)} | >= {GOAL} {'met' if ratio >= GOAL else 'MISSED'} |"
    )
    emit_figures({
        "dynamic.dynamic_over_hand": list(median_spread(r["dynamic / hand"] for r in rounds)),
        "dynamic.static_over_hand": list(median_spread(r["static / hand"] for r in rounds)),
    })
    print(f"\nMedian [min-max] of {args.rounds} interleaved rounds. Machine: {machine_line(info)}.")
    print(f"results: {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
