"""A Parquet source against a map-style dataset of the same rows in memory (DESIGN §12).

    python -m benchmarks.streams                       # 1e6 rows in 8 files, 3 interleaved rounds
    python -m benchmarks.streams --rows 200000 --rounds 1 --workers 2

Data: ``--rows`` small rows (``id`` int64, ``x`` float32, ``tag`` a short string) in 8 Parquet files
(row groups of ``--row-group`` rows). Each measurement is a fresh process (so its peak RSS is its own):

- ``stream``: ``torch_batch_process(P, sources.parquet(folder), batch_size=B)`` (batches collated from
  the Arrow columns);
- ``stream_rows``: the same with ``collate_fn=default_collate`` given, so batches are collated from per-row
  dicts like the map-style dataset's (the like-for-like loader path);
- ``map``: the same rows read into a list of dicts first (not timed), then ``torch_batch_process(P, rows, ...)``;
- ``resume``: a stream job preempted (SIGTERM to itself) after 90% of its batches, then resumed; the rows
  the resume reads (decoded, counted by ``RowsReadLog``) are reported as a fraction of all rows;
- ``small``: the stream job over ``--rows / 5`` rows (also 8 files), for its peak memory against the
  full one's (memory flat).

Each child first runs two tiny warm-up jobs (one of each kind: lazy imports, first reads), untimed.
``P`` adds each batch's ids to a reducer (almost no work: the comparison is of loading and engine cost,
the harshest case for a stream). Rounds interleave the contenders; the table shows medians [min-max].
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FILES = 8


def write_data(folder: Path, rows: int, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    per = -(-rows // FILES)
    for k in range(FILES):
        lo, hi = k * per, min(rows, (k + 1) * per)
        ids = pa.array(range(lo, hi), pa.int64())
        table = pa.table({
            "id": ids,
            "x": pa.array([float(i % 1000) for i in range(lo, hi)], pa.float32()),
            "tag": pa.array([f"t{i % 97}" for i in range(lo, hi)]),
        })
        pq.write_table(table, folder / f"part-{k:02d}.parquet", row_group_size=row_group)


# ------------------------------------------------------------------ child processes


def child(args: argparse.Namespace) -> None:
    from torch_batch_process import TorchBatchProcessor, sources, torch_batch_process

    stop_at = args.stop_at

    class Sum(TorchBatchProcessor):
        def __init__(self, context: Any) -> None:
            self.total = context.wrap_reducer(lambda values: sum(values), name="id_sum")

        def process_batch(self, batch: Any, batch_idx: int) -> None:
            self.total.update(int(batch["id"].sum()))
            if batch_idx == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)  # preempted: commit and stop

    source = sources.parquet(args.data)
    log = sources.RowsReadLog(args.reads)
    source.on_rows_read = log
    dataset: Any = source
    loader: dict[str, Any] = {"num_workers": args.workers}
    if args.mode == "stream_rows":
        from torch.utils.data import default_collate

        loader["collate_fn"] = default_collate
    if args.mode == "map":
        dataset = [row for shard in range(source.num_shards) for row in source.read(shard)]
        log.reset()
    # warm-up on both kinds of dataset (lazy imports, first reads), so that neither pays them when timed
    first = sources.parquet(sorted(Path(args.data).glob("*.parquet"))[0])
    warm = {"batch_size": args.batch_size, "max_batches": 2, "dataloader_kwargs": {"num_workers": args.workers}}
    torch_batch_process(Sum, first, storage_path=f"{args.storage}-warm-stream", **warm)
    rows = list(first.read(0, 0, 2 * args.batch_size))
    torch_batch_process(Sum, rows, storage_path=f"{args.storage}-warm-map", **warm)
    log.reset()
    t0 = time.perf_counter()
    result = torch_batch_process(
        Sum, dataset, batch_size=args.batch_size, checkpoint_interval=args.checkpoint_interval,
        dataloader_kwargs=loader, storage_path=args.storage,
    )
    seconds = time.perf_counter() - t0
    report = {
        "seconds": seconds,
        "examples": result.examples_processed,
        "preempted": result.preempted,
        "rows_read": log.total(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    Path(args.report).write_text(json.dumps(report))


def run_child(mode: str, data: Path, storage: Path, report: Path, reads: Path, opts: argparse.Namespace,
              stop_at: int = -1) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "benchmarks.streams", "--child", mode, "--data", str(data), "--storage", str(storage),
        "--report", str(report), "--reads", str(reads), "--batch-size", str(opts.batch_size),
        "--workers", str(opts.workers), "--checkpoint-interval", str(opts.checkpoint_interval),
        "--stop-at", str(stop_at),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-4000:]}")
    return json.loads(report.read_text())


def fmt(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--row-group", type=int, default=16_384)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--checkpoint-interval", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=("stream", "stream_rows", "map"), default=None, help=argparse.SUPPRESS)
    for name in ("--data", "--storage", "--report", "--reads"):
        parser.add_argument(name, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stop-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.mode = args.child
        child(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="tbp-streams-") as scratch_name:
        scratch = Path(scratch_name)
        write_data(scratch / "data", args.rows, args.row_group)
        write_data(scratch / "small", args.rows // 5, args.row_group)
        times: dict[str, list[float]] = {"stream": [], "stream_rows": [], "map": []}
        peaks: dict[str, list[float]] = {"stream": [], "stream_rows": [], "map": [], "small": []}
        reread: list[float] = []
        reads: dict[str, list[float]] = {"stream": [], "stream_rows": []}
        num_batches = math.ceil(math.ceil(args.rows / FILES) / args.batch_size) * FILES
        for r in range(args.rounds):
            order = ("stream", "map", "stream_rows") if r % 2 == 0 else ("stream_rows", "map", "stream")
            for mode in order:
                tag = f"{mode}{r}"
                rep = run_child(
                    mode, scratch / "data", scratch / tag, scratch / f"{tag}.json", scratch / f"{tag}.reads", args
                )
                times[mode].append(rep["seconds"])
                peaks[mode].append(rep["peak_rss_mib"])
                if mode in reads:
                    reads[mode].append(rep["rows_read"] / args.rows)
                print(f"round {r} {mode}: {rep['seconds']:.2f} s, peak RSS {rep['peak_rss_mib']:.0f} MiB, "
                      f"rows read {rep['rows_read']}", file=sys.stderr)
            rep = run_child("stream", scratch / "small", scratch / f"small{r}", scratch / f"small{r}.json",
                            scratch / f"small{r}.reads", args)
            peaks["small"].append(rep["peak_rss_mib"])
            tag = f"resume{r}"
            first = run_child("stream", scratch / "data", scratch / tag, scratch / f"{tag}a.json",
                              scratch / f"{tag}a.reads", args, stop_at=int(0.9 * num_batches))
            assert first["preempted"], first
            again = run_child("stream", scratch / "data", scratch / tag, scratch / f"{tag}b.json",
                              scratch / f"{tag}b.reads", args)
            assert not again["preempted"], again
            reread.append(again["rows_read"] / args.rows)
            print(f"round {r} resume at 90%: read {again['rows_read']} rows again", file=sys.stderr)
    # throughput stream / map = time map / time stream, per round
    ratios = [m / s for s, m in zip(times["stream"], times["map"], strict=True)]
    ratios_rows = [m / s for s, m in zip(times["stream_rows"], times["map"], strict=True)]
    print(f"\n{args.rows:,} rows in {FILES} Parquet files (row groups of {args.row_group:,}), batches of "
          f"{args.batch_size}, {args.workers} DataLoader worker(s), 1 process, {args.rounds} interleaved round(s)\n")
    print("| Dataset | Call, s | Rows/s | Peak RSS, MiB | Rows read / rows |")
    print("|---|---:|---:|---:|---:|")
    labels = (
        ("stream", "sources.parquet, default collate (from Arrow columns)"),
        ("stream_rows", "sources.parquet, collate_fn=default_collate (per-row dicts)"),
        ("map", "list of dicts in memory"),
    )
    for mode, label in labels:
        rate = [args.rows / t for t in times[mode]]
        read = fmt(reads[mode]) if mode in reads else "–"
        print(f"| {label} | {fmt(times[mode])} | {fmt(rate, 0)} | {fmt(peaks[mode], 0)} | {read} |")
    verdict = "met" if statistics.median(ratios) >= 0.95 else "NOT met"
    print(f"\nThroughput stream / map: {fmt(ratios, 3)} (goal >= 0.95: {verdict})")
    print(f"Throughput stream (per-row dicts) / map: {fmt(ratios_rows, 3)}")
    print(f"Resume at 90%: rows read again / rows: {fmt(reread, 3)} (goal <= 0.15: "
          f"{'met' if max(reread) <= 0.15 else 'NOT met'})")
    growth = statistics.median(peaks["stream"]) / statistics.median(peaks["small"]) - 1
    print(f"Peak RSS of the stream job, {args.rows // 5:,} vs {args.rows:,} rows: {fmt(peaks['small'], 0)} vs "
          f"{fmt(peaks['stream'], 0)} MiB ({growth:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
