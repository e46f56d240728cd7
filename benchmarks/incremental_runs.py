"""Incremental runs end to end through the call (DESIGN §21, issue 46): a rerun over a dataset with 10% of its
examples changed and 10% appended, ``incremental=True`` against the full rerun, and what shadowing adds to reads.

    python -m benchmarks.incremental_runs                    # 20,000 examples, 3 rounds
    python -m benchmarks.incremental_runs --n 100000 --work-ms 0.5 --rounds 3

Each round, in rotated order, in this process (one rank; the library's import is not timed), from a copy of the
same stored first run (``N`` keyed examples ``{"id", "text"}`` of 200 characters, ``batch_size`` 256):

- ``incremental``: ``incremental=True`` over the changed dataset (planning: a hash pass over every example and a
  read of the stored keys; then the 0.2 N selected examples);
- ``full rerun (keyed)``: ``resume=False`` over the changed dataset, keyed (every example, with its key and hash);
- ``full rerun``: the same without ``key=`` (the job users run today).

The processor costs ``--work-ms`` milliseconds per example (a sleep, standing for the device's time) plus writing
one row. Clock: the call's wall time (end to end, planning included), median [min-max] over rounds.

Then the reads: ``read_outputs`` and a full ``iter_outputs`` pass of the keyed job after the incremental run
(1.1 N rows read back of 1.2 N stored: shadowing on) against the same of the not-keyed full rerun (1.1 N rows,
no shadowing), wall time, median [min-max] over rounds, rotated.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from torch_batch_process import TorchBatchProcessor, iter_outputs, read_outputs, torch_batch_process

WORK_MS = 0.1


class Work(TorchBatchProcessor):
    """Writes one row per example after ``WORK_MS`` per example."""

    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        time.sleep(WORK_MS * len(batch["text"]) / 1000)
        self.context.write({"length": [len(text) for text in batch["text"]]})


def dataset(n: int, changed: bool) -> list[dict[str, Any]]:
    """``n`` examples; ``changed``: every 10th text edited and ``n/10`` examples appended."""
    rows = [{"id": i, "text": (f"{i:08d}" * 25)[:199] + ("!" if changed and i % 10 == 0 else ".")} for i in range(n)]
    if changed:
        rows += [{"id": i, "text": f"{i:08d}" * 25} for i in range(n, n + n // 10)]
    return rows


def call(path: Path, data: list[dict[str, Any]], **kwargs: Any) -> float:
    t0 = time.perf_counter()
    torch_batch_process(Work, data, batch_size=256, storage_path=str(path), progress=False, tensorboard=False,
                        **kwargs)
    return time.perf_counter() - t0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def main(argv: list[str] | None = None) -> int:
    global WORK_MS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=WORK_MS, help="processing milliseconds per example")
    args = parser.parse_args(argv)
    WORK_MS = args.work_ms
    logging.getLogger("torch_batch_process").setLevel(logging.WARNING)
    first, changed = dataset(args.n, False), dataset(args.n, True)
    contenders = {
        "incremental": lambda p: call(p, changed, key="id", incremental=True),
        "full rerun (keyed)": lambda p: call(p, changed, key="id", resume=False),
        "full rerun": lambda p: call(p, changed, resume=False),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    reads: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="tbp-incr-runs-") as tmp:
        base = Path(tmp) / "first"
        call(base, first, key="id")
        names = list(contenders)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                path = Path(tmp) / f"{r}-{name}"
                shutil.copytree(base, path)
                times[name].append(contenders[name](path))
            keyed, plain = Path(tmp) / f"{r}-incremental", Path(tmp) / f"{r}-full rerun"
            for label, path in [("keyed (shadowing)", keyed), ("not keyed", plain)][:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                rows = read_outputs(path).num_rows
                reads.setdefault(f"read_outputs, {label}", []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                streamed = sum(batch.num_rows for batch in iter_outputs(path))
                reads.setdefault(f"iter_outputs, {label}", []).append(time.perf_counter() - t0)
                assert rows == streamed == args.n + args.n // 10, (label, rows, streamed)
    full = statistics.median(times["full rerun"])
    print(f"rerun of {args.n:,} examples (10% changed, {args.n // 10:,} appended), {WORK_MS} ms/example, "
          f"{args.rounds} rounds; wall s of the call (end to end), median [min-max]")
    print("| contender | examples processed | wall s | vs full rerun |\n| --- | ---: | ---: | ---: |")
    for name, values in times.items():
        processed = args.n // 5 if name == "incremental" else args.n + args.n // 10
        print(f"| {name} | {processed:,} | {_spread(values)} | {statistics.median(values) / full:.2f} |")
    print(f"\nreading back {args.n + args.n // 10:,} rows; wall s, median [min-max]")
    print("| read | wall s |\n| --- | ---: |")
    for name, values in reads.items():
        print(f"| {name} | {_spread(values)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
