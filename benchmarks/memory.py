"""Peak memory (RSS) of a job over 1e4 vs 1e6 tiny examples (goal: <= 5% growth).

    python -m benchmarks.memory                      # batch size 100: 100 vs 10,000 batches
    python -m benchmarks.memory --sizes 10000,1000000,3000000

The examples are integers made on the fly (the dataset holds nothing per example), every batch
writes one small output file through ``upload_path()``, ``checkpoint_interval`` is the default, one
process, no DataLoader workers: any growth is the library's. The hand-written loop over the same
batches is the reference. Peak RSS is the process's ``ru_maxrss``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.launch import run_synthetic
from benchmarks.report import machine, machine_line, new_results_dir, save_json

GOAL = 0.05


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000", help="comma-separated numbers of examples")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    out_dir = new_results_dir("memory")
    peaks: dict[tuple[str, int], list[float]] = {}
    seconds: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="tbp-memory-") as scratch:
        for index in range(args.rounds):
            for n in sizes:
                for mode in ("tbp", "hand"):
                    tag = f"r{index}-{mode}-{n}"
                    reports, _ = run_synthetic(
                        ["--mode", mode, "--examples", str(n), "--batch-size", str(args.batch_size),
                         "--storage", str(Path(scratch) / tag)],
                        1, Path(scratch) / f"report-{tag}", out_dir / "logs" / f"{tag}.log",
                    )
                    peaks.setdefault((mode, n), []).append(reports[0]["peak_rss_mib"])
                    seconds.setdefault((mode, n), []).append(reports[0]["call_s"])
                    print(f"{tag}: peak RSS {reports[0]['peak_rss_mib']:.1f} MiB, {reports[0]['call_s']:.1f} s",
                          file=sys.stderr)
    info = machine()
    rows = []
    for mode in ("tbp", "hand"):
        base = statistics.median(peaks[(mode, sizes[0])])
        for n in sizes:
            peak = statistics.median(peaks[(mode, n)])
            rows.append({"mode": mode, "examples": n, "peak_rss_mib": peak, "growth": peak / base - 1,
                         "call_s": statistics.median(seconds[(mode, n)])})
    growth = max(r["growth"] for r in rows if r["mode"] == "tbp")
    save_json(out_dir / "results.json", {"machine": info, "rows": rows, "goal": GOAL, "met": growth <= GOAL,
                                         "peaks": {f"{m}-{n}": v for (m, n), v in peaks.items()}})
    print("| Loop | Examples | Batches | Peak RSS, MiB | Growth vs smallest | Run time, s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        name = "torch_batch_process" if r["mode"] == "tbp" else "hand-written loop"
        print(f"| {name} | {r['examples']:,} | {-(-r['examples'] // args.batch_size):,} | {r['peak_rss_mib']:.1f} "
              f"| {r['growth'] * 100:+.1f}% | {r['call_s']:.1f} |")
    print(f"\nGoal: <= {GOAL * 100:.0f}% growth for torch_batch_process: {'met' if growth <= GOAL else 'MISSED'} "
          f"({growth * 100:+.1f}%). Median of {args.rounds} runs. Machine: {machine_line(info)}.")
    print(f"results: {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
