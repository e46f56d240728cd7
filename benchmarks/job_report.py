"""The cost of ``tbp report``: build time and page size for a 10^5-batch job, and for a long job's timeline.

    python -m benchmarks.job_report                    # 10^5 batches on 2 ranks, then the report, 3 builds
    python -m benchmarks.job_report --batches 20000 --ranks 1
    python -m benchmarks.job_report --synthetic-days 7 --synthetic-ranks 8

The job is real: ``--ranks`` processes (gloo), ``--batches`` batches of 2 trivial examples, ``bucket_by`` lengths,
``on_error="skip"`` with one failing example every 1,000, one ``report_metrics()`` line per batch (so
``metrics.jsonl`` holds 10^5 lines the report must skip) and the default ``checkpoint_interval=5``. Then
``tbp report`` runs ``--builds`` times as a fresh command (interpreter start and imports included); the table
gives the median wall time, the page's size and what it was made from. With ``--synthetic-days``, the job's
timeline is replaced by the points a job of that many days on ``--synthetic-ranks`` ranks writes at most (the
schedule of :mod:`torch_batch_process.observe.timeline`: the size bound), and the report is built again.
Goals: under 10 s and under 5 MB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.launch import REPO, worker_env
from benchmarks.report import machine, machine_line, new_results_dir, save_json

GOAL_S = 10.0
GOAL_BYTES = 5_000_000


def _worker(storage: str, batches: int) -> None:
    """One rank of the benchmark job (started with RANK/WORLD_SIZE/MASTER_* set)."""
    import torch

    from torch_batch_process import TorchBatchProcessor, torch_batch_process

    class Examples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2 * batches

        def __getitem__(self, index: int) -> int:
            return index

    class Work(TorchBatchProcessor):
        def __init__(self, context: Any) -> None:
            self.context = context

        def process_batch(self, batch: Any, batch_idx: int) -> None:
            values = [int(v) for v in batch]
            if any(v % 2000 == 1999 for v in values):
                raise ValueError(f"example {values} fails (one in a thousand batches)")
            self.context.report_metrics("work", batch_idx + 1, {"sum": sum(values)})

    torch_batch_process(
        Work, Examples(), batch_size=2, storage_path=storage, on_error="skip", progress="off",
        bucket_by=[(i * 7919) % 200 + 1 for i in range(2 * batches)], tensorboard=False,
    )


def _run_job(storage: Path, batches: int, ranks: int, log: Path) -> float:
    env = worker_env()
    started = time.monotonic()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "benchmarks.job_report", "--worker", str(storage), "--batches", str(batches)]
    with log.open("w") as output:  # the failing examples' warnings
        subprocess.run(command, env=env, check=True, cwd=str(REPO), timeout=3600, stdout=output, stderr=output)
    return time.monotonic() - started


def _build(storage: Path, output: Path) -> float:
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "torch_batch_process.launch.cli", "report", str(storage), "-o", str(output)],
        env=worker_env(), check=True, cwd=str(REPO), timeout=600, stdout=subprocess.DEVNULL,
    )
    return time.monotonic() - started


def synthetic_timeline(metrics: Path, days: float, ranks: int) -> int:
    """Replaces the timeline points of ``metrics`` by those a job of ``days`` days on ``ranks`` ranks writes at
    most (one point at each due time of the schedule); returns their number."""
    from torch_batch_process.observe.histogram import add_seconds
    from torch_batch_process.observe.timeline import RankActivity, Timeline

    kept = [line for line in metrics.read_text().splitlines() if '"group": "timeline"' not in line]
    timeline = Timeline()
    start = time.time() - days * 86400
    now, examples, lines = 0.0, 0, []
    while now < days * 86400:
        activity = RankActivity(ranks)
        step = timeline.interval_s()
        for rank in range(ranks):
            batches = max(1, int(step * 50))
            histogram: dict[int, int] = {}
            for k in range(12):  # a spread of ~3 octaves, as real batches have
                add_seconds(histogram, 0.02 * 2 ** (k / 4))
            activity.add_vote(rank, batches, 32 * batches, {"data": step * 0.1, "process": step * 0.8,
                                                           "commit": step * 0.02}, {key: batches // 12 for key in histogram})
        activity.add_record_write(0.004, 0.03)
        examples += sum(activity.examples)
        now += step
        line = timeline.point(
            activity, attempt_started=start, elapsed_s=now, batches_committed=examples // 32,
            examples_committed=examples, failed_examples=0, preempted=False, finished=False, last=False,
        )
        line.update(time=start + now, commit=len(lines) + 1, attempt=1)
        lines.append(json.dumps(line, sort_keys=True))
    metrics.write_text("\n".join(kept + lines) + "\n")
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--builds", type=int, default=3)
    parser.add_argument("--synthetic-days", type=float, default=7.0)
    parser.add_argument("--synthetic-ranks", type=int, default=8)
    parser.add_argument("--worker", metavar="STORAGE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.batches)
        return 0
    rows = []
    out_dir = new_results_dir("job_report")
    scratch = Path(tempfile.mkdtemp(prefix="tbp-job-report-"))
    try:
        storage = scratch / "job"
        job_s = _run_job(storage, args.batches, args.ranks, out_dir / "job.log")
        metrics = storage / "metrics.jsonl"
        output = scratch / "report.html"

        def measure(name: str) -> None:
            times = [_build(storage, output) for _ in range(args.builds)]
            points = sum(1 for line in metrics.read_text().splitlines() if '"group": "timeline"' in line)
            failures = len(list((storage / "failures").glob("*.jsonl")))
            rows.append({
                "case": name, "build_s": statistics.median(times), "build_s_all": times,
                "page_bytes": output.stat().st_size, "metrics_bytes": metrics.stat().st_size, "points": points,
                "failure_files": failures,
            })

        measure(f"{args.batches:,} batches on {args.ranks} rank(s) (job ran {job_s:.0f} s)")
        if args.synthetic_days:
            synthetic_timeline(metrics, args.synthetic_days, args.synthetic_ranks)
            measure(f"same job, timeline of {args.synthetic_days:g} days on {args.synthetic_ranks} ranks (the bound)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    info = machine()
    save_json(out_dir / "results.json", {"machine": info, "rows": rows})
    print("| Case | timeline points | metrics.jsonl | report build (median) | page | goals |")
    print("|---|---:|---:|---:|---:|---|")
    for row in rows:
        ok = row["build_s"] < GOAL_S and row["page_bytes"] < GOAL_BYTES
        print(
            f"| {row['case']} | {row['points']:,} | {row['metrics_bytes'] / 1e6:.1f} MB | {row['build_s']:.1f} s "
            f"[{min(row['build_s_all']):.1f}-{max(row['build_s_all']):.1f}] | {row['page_bytes'] / 1e6:.2f} MB | "
            f"{'met' if ok else 'MISSED'} |"
        )
    print(f"\nBuilds: `tbp report` as a fresh command, {args.builds} each. Machine: {machine_line(info)}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
