"""Start-up time to the first batch: torch_batch_process vs the hand-written loop, 1 and 2 processes.

    python -m benchmarks.startup

Three figures per run: importing ``torch_batch_process`` (after ``torch``), the time from the call
(for the hand loop: from the start of its setup, process group included) to the first
``process_batch``, and the time from launching the command (``python`` or ``torchrun``) to the first
batch. A fresh storage path each time; 1 DataLoader worker, as a real job has.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.launch import run_synthetic
from benchmarks.report import emit_figures, fmt_spread, machine, machine_line, median_spread, new_results_dir, save_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    nprocs = [int(n) for n in args.nprocs.split(",")]
    out_dir = new_results_dir("startup")
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tbp-startup-") as scratch:
        for index in range(args.rounds):
            for nproc in nprocs:
                modes = ("tbp", "hand") if index % 2 == 0 else ("hand", "tbp")
                for mode in modes:
                    tag = f"r{index}-{mode}-p{nproc}"
                    reports, _ = run_synthetic(
                        ["--mode", mode, "--examples", "64", "--batch-size", "4", "--workers", str(args.workers),
                         "--storage", str(Path(scratch) / tag)],
                        nproc, Path(scratch) / f"report-{tag}", out_dir / "logs" / f"{tag}.log",
                    )
                    first = max(r["first_batch"] for r in reports)
                    sample = {
                        "call_to_first_s": first - max(r["start"] for r in reports),
                        "launch_to_first_s": first - reports[0]["launched"],
                        "import_tbp_s": statistics.median(r["import_tbp_s"] for r in reports),
                    }
                    samples.setdefault((mode, nproc), []).append(sample)
                    print(f"{tag}: " + ", ".join(f"{k} {v:.3f}" for k, v in sample.items()), file=sys.stderr)
    info = machine()
    save_json(out_dir / "results.json", {"machine": info, "samples": {f"{m}-p{n}": v for (m, n), v in samples.items()}})
    print("| Procs | Loop | import torch_batch_process, s | Call to first batch, s | Launch to first batch, s |")
    print("|---:|---|---:|---:|---:|")
    for nproc in nprocs:
        for mode in ("hand", "tbp"):
            rows = samples[(mode, nproc)]
            name = "torch_batch_process" if mode == "tbp" else "hand-written loop"
            imp = fmt_spread((r["import_tbp_s"] for r in rows), 2) if mode == "tbp" else "–"
            print(f"| {nproc} | {name} | {imp} | {fmt_spread((r['call_to_first_s'] for r in rows), 3)} "
                  f"| {fmt_spread((r['launch_to_first_s'] for r in rows), 2)} |")
    emit_figures({
        f"startup.p{nproc}.{mode}.call_to_first_s":
            list(median_spread(r["call_to_first_s"] for r in samples[(mode, nproc)]))
        for nproc in nprocs for mode in ("hand", "tbp")
    })
    print(f"\nMedian [min–max] of {args.rounds} rounds; 2 processes: the last rank's first batch. "
          f"Machine: {machine_line(info)}.")
    print(f"results: {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
