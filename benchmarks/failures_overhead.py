"""Cost of ``on_error="skip"`` when nothing fails: ``"skip"`` vs ``"raise"`` on the same job, one process.

    python -m benchmarks.failures_overhead                       # 5 rounds of 300 batches of 2 ms busy work
    python -m benchmarks.failures_overhead --rounds 9 --work-ms 5

Each batch does a fixed amount of CPU work (calibrated to about ``--work-ms``), updates a wrapped reducer and a
function reducer, and writes one small file through ``upload_path()`` (what ``"skip"`` holds back per batch,
with the reducers' snapshots). The two variants alternate within each round (order flipped every round); each
run uses a fresh local storage path. Throughput is batches per second of the process's CPU time
(``time.process_time``, all threads: the library's background work included), which other processes on a shared
machine barely disturb, and also per second of wall time. The median of the rounds' ratios skip / raise is the
figure. Goal: >= 0.98.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from torch_batch_process import MetricReducer, TorchBatchProcessor, torch_batch_process

GOAL = 0.98


class _Sum(MetricReducer):
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total, self.count = 0, 0

    def update(self, values: torch.Tensor) -> None:
        self.total += int(values.sum())
        self.count += len(values)

    def per_slot_reduce(self) -> Any:
        return self.total, self.count

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        return {"total": sum(t for t, _ in per_slot_metrics), "count": sum(c for _, c in per_slot_metrics)}


def _work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def _calibrate(work_ms: float) -> int:
    iterations = 10_000
    t0 = time.process_time()
    _work(iterations)
    return max(1, int(iterations * work_ms / 1000 / max(time.process_time() - t0, 1e-6)))


class _Processor(TorchBatchProcessor):
    iterations = 10_000

    def __init__(self, context: Any) -> None:
        self.context = context
        self.sum = context.wrap_reducer(_Sum(), name=None)
        self.sizes = context.wrap_reducer(lambda values: sum(values), name="examples")

    def process_batch(self, batch: torch.Tensor, batch_idx: int) -> None:
        _work(self.iterations)
        self.sum.update(batch)
        self.sizes.update(len(batch))
        with self.context.upload_path() as path:
            (path / f"out_{batch_idx}.txt").write_text(str(int(batch.sum())))


def _run(on_error: str, storage: Path, batches: int, batch_size: int) -> tuple[float, float]:
    """Batches per CPU second and per wall second."""
    dataset = list(range(batches * batch_size))
    t0, c0 = time.perf_counter(), time.process_time()
    result = torch_batch_process(
        _Processor, dataset, batch_size=batch_size, checkpoint_interval=10, storage_path=str(storage),
        on_error=on_error, progress=False, tensorboard=False,
    )
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert result.metrics["count"] == len(dataset) and result.failed_examples == 0
    return batches / cpu, batches / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--work-ms", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)  # the library then logs no INFO lines (it keeps a configured root)
    _Processor.iterations = _calibrate(args.work_ms)
    ratios, wall_ratios, best = [], [], {"raise": 0.0, "skip": 0.0}
    print(f"{args.batches} batches of {args.batch_size}, ~{args.work_ms:g} ms of CPU work each, 1 process")
    print(f"{'round':>5} {'raise b/cpu-s':>14} {'skip b/cpu-s':>13} {'skip/raise':>11} {'wall skip/raise':>16}")
    with tempfile.TemporaryDirectory(prefix="tbp-failures-overhead-") as scratch:
        _run("raise", Path(scratch, "warmup"), 20, args.batch_size)
        for index in range(args.rounds):
            order = ["raise", "skip"] if index % 2 == 0 else ["skip", "raise"]
            speed = {
                mode: _run(mode, Path(scratch, f"r{index}-{mode}"), args.batches, args.batch_size) for mode in order
            }
            ratios.append(speed["skip"][0] / speed["raise"][0])
            best = {mode: max(best[mode], speed[mode][0]) for mode in best}
            wall_ratios.append(speed["skip"][1] / speed["raise"][1])
            raise_s, skip_s = speed["raise"][0], speed["skip"][0]
            print(f"{index:>5} {raise_s:>14.1f} {skip_s:>13.1f} {ratios[-1]:>11.3f} {wall_ratios[-1]:>16.3f}")
    median = statistics.median(ratios)
    print(f"median skip/raise (CPU time): {median:.3f} (goal >= {GOAL}); min {min(ratios):.3f}, max {max(ratios):.3f}")
    print(f"best skip / best raise (CPU time): {best['skip'] / best['raise']:.3f}")
    print(f"median skip/raise (wall time): {statistics.median(wall_ratios):.3f}")
    from benchmarks.report import emit_figures, median_spread

    emit_figures({"failures_overhead.skip_over_raise.cpu": list(median_spread(ratios))})
    return 0 if median >= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
