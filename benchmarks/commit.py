"""Commit latency on local and S3 (moto) storage, with 0, 10 and 100 output files per commit.

Runs real single-process jobs with ``checkpoint_interval=1``. A commit's latency is measured from
the processor's side as the time from the call of ``on_checkpoint_start()`` to the call of the
next ``process_batch()``: the whole commit (the hook, waiting for the uploads of the step's
``upload_path()`` files, the state file, the commit record, publishing the outputs, metrics) plus
loading the next (tiny) batch. Each ``process_batch`` writes its files right before returning, so the
commit waits for their uploads. The processor wraps one reducer, so each commit also writes a state
file (set ``--no-reducer`` to leave it out).

The S3 figures come from a moto server on 127.0.0.1 started by this script: every request is a real
HTTP round trip to a Python server, typically slower than S3 itself from inside its region.

Usage::

    python benchmarks/commit.py [--commits 60] [--files 0 10 100] [--backends local s3] [--file-kb 4]

Prints a markdown table of p50 / p95 / mean commit latency in milliseconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from torch_batch_process import TorchBatchProcessor, torch_batch_process  # noqa: E402

SETTINGS = {"files": 0, "payload": b"", "reducer": True}
MARKS: list[tuple[str, float]] = []


class Writer(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        if SETTINGS["reducer"]:
            self.total = context.wrap_reducer(lambda values: sum(values), name="total")

    def process_batch(self, batch, batch_idx):
        MARKS.append(("batch", time.perf_counter()))
        if SETTINGS["reducer"]:
            self.total.update(len(batch))
        if SETTINGS["files"]:
            with self.context.upload_path() as path:
                for i in range(SETTINGS["files"]):
                    (path / f"out_{batch_idx}_{i}.bin").write_bytes(SETTINGS["payload"])

    def on_checkpoint_start(self):
        MARKS.append(("commit", time.perf_counter()))


def commit_latencies() -> list[float]:
    """Seconds from each on_checkpoint_start() to the next process_batch()."""
    out = []
    for (kind, t), (next_kind, t_next) in zip(MARKS, MARKS[1:], strict=False):
        if kind == "commit" and next_kind == "batch":
            out.append(t_next - t)
    return out


def run(url: str, commits: int, files: int) -> list[float]:
    SETTINGS["files"] = files
    MARKS.clear()
    torch_batch_process(Writer, list(range(commits + 1)), batch_size=1, checkpoint_interval=1, storage_path=url)
    return commit_latencies()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--commits", type=int, default=60, help="commits measured per configuration")
    parser.add_argument("--files", type=int, nargs="+", default=[0, 10, 100], help="output files per commit")
    parser.add_argument("--backends", nargs="+", default=["local", "s3"], choices=["local", "s3", "memory"])
    parser.add_argument("--file-kb", type=int, default=4, help="size of each output file (KiB)")
    parser.add_argument("--no-reducer", action="store_true", help="no reducer, hence no state file per commit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    SETTINGS["payload"] = os.urandom(args.file_kb * 1024)
    SETTINGS["reducer"] = not args.no_reducer

    server = None
    rows = []
    with tempfile.TemporaryDirectory(prefix="tbp-bench-") as tmp:
        try:
            for backend in args.backends:
                if backend == "s3":
                    from s3 import MotoServer

                    server = MotoServer()
                    os.environ.update(server.env())
                for files in args.files:
                    if backend == "local":
                        url = str(Path(tmp) / f"local-{files}")
                    elif backend == "memory":
                        url = f"memory://bench-{uuid.uuid4().hex[:8]}"
                    else:
                        assert server is not None
                        url = f"s3://{server.new_bucket()}/bench"
                    run(url + "-warmup", 3, files) if backend != "s3" else run(
                        f"s3://{server.new_bucket()}/warmup", 3, files
                    )
                    latencies = run(url, args.commits, files)
                    rows.append((backend, files, latencies))
        finally:
            if server is not None:
                server.stop()

    print(
        f"\nCommit latency, {args.commits} commits per row, {args.file_kb} KiB files, "
        f"reducer state file: {'yes' if SETTINGS['reducer'] else 'no'}\n"
    )
    print("| storage | files / commit | p50 (ms) | p95 (ms) | mean (ms) |")
    print("|---|---:|---:|---:|---:|")
    for backend, files, latencies in rows:
        name = "S3 (moto, 127.0.0.1)" if backend == "s3" else backend
        print(
            f"| {name} | {files} | {percentile(latencies, 0.5) * 1000:.1f} | "
            f"{percentile(latencies, 0.95) * 1000:.1f} | {statistics.fmean(latencies) * 1000:.1f} |"
        )


if __name__ == "__main__":
    main()
