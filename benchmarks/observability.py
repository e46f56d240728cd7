"""Overhead of the observability features on a fast job with tiny batches (one process).

Runs the same job with everything off (``progress=False``, ``tensorboard=False``, no interim
metrics) and with everything on at its defaults (tqdm bar, TensorBoard event files, straggler
checks, throughput records, reduced metrics so far every 60 s within their 1% budget), in
interleaved rounds (the order alternates), and prints the median wall time of each and the overhead.
The bar is drawn into /dev/null so the terminal stays readable; the profiler is a debugging option
that is off by default and is not part of this comparison.

Job shapes: batch size 1 (every step is a full trip through the DataLoader, ``process_batch`` and
the observer), a commit every 100 steps (per-step costs dominate) and every 5 steps (per-commit
costs dominate). ``process_batch`` updates a reducer and reports metrics every 100 batches.
It also measures the observer alone (its per-step hook, the only per-step cost, and its work per commit),
which gives the overhead without the noise of a shared machine.

    python benchmarks/observability.py [--examples 5000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_batch_process import MetricReducer, TorchBatchProcessor, torch_batch_process  # noqa: E402

SHAPES = [(1, 100), (1, 5)]  # (batch_size, checkpoint_interval)


class Total(MetricReducer):
    """A constant-size reducer (a function reducer keeps every value, and its state grows with the job)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.value = 0

    def update(self, value):
        self.value += value

    def per_slot_reduce(self):
        return self.value

    def cross_slot_reduce(self, per_slot_metrics):
        return sum(per_slot_metrics)


class Tiny(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.total = context.wrap_reducer(Total(), name="total")

    def process_batch(self, batch, batch_idx):
        value = int(batch.sum())
        self.total.update(value)
        if batch_idx % 100 == 0:
            self.context.report_metrics("inference", batch_idx + 1, {"value": value})


CONFIGS = {
    "off": dict(progress=False, tensorboard=False),
    "on": dict(progress="bar", tensorboard=None),
}


def run_once(config: str, n: int, batch_size: int, interval: int, root: Path) -> tuple[float, float]:
    """Wall and CPU seconds (all threads of this process) of one call."""
    storage = root / f"{config}-{time.monotonic_ns()}"
    os.environ["TBP_METRICS_INTERVAL"] = "0" if config == "off" else "60"
    t0, c0 = time.perf_counter(), time.process_time()
    result = torch_batch_process(
        Tiny,
        list(range(n)),
        batch_size=batch_size,
        checkpoint_interval=interval,
        storage_path=str(storage),
        **CONFIGS[config],
    )
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert result.finished and result.metrics["total"] == n * (n - 1) // 2
    shutil.rmtree(storage, ignore_errors=True)
    return elapsed, cpu


def observer_costs(calls: int = 20_000) -> tuple[float, float, float]:
    """Seconds per step (rank 0, bar on: the loop's check and the observer's clock reads), per commit (records, TensorBoard on,
    straggler check of 2 ranks) and per call (opening and closing the bar and the event file), measured on
    the observer alone."""
    import torch

    from torch_batch_process.observe.observer import JobObserver
    from torch_batch_process.observe.options import ObserveOptions, tensorboard_installed
    from torch_batch_process.observe.stragglers import RankInterval
    from torch_batch_process.storage.registry import open_storage as Storage

    with tempfile.TemporaryDirectory() as tmp:
        observer = JobObserver(
            ObserveOptions(progress="bar", tensorboard=tensorboard_installed()),
            rank=0,
            world_size=2,
            job_name="bench",
            batch_size=1,
            tensorboard=Storage(tmp).mirrored_folder("tb", "tb"),
            device=torch.device("cpu"),
        )
        big = 10**9
        observer.start(
            total_batches=big, total_examples=big, committed_batches=0, committed_examples=0, remaining_batches=big
        )
        t0 = time.perf_counter()
        for step in range(calls * 10):  # what the loop does at every step
            if step >= observer.next_step:
                observer.on_step(step)
        per_step = (time.perf_counter() - t0) / (calls * 10)
        t0 = time.perf_counter()
        for step in range(calls * 10):  # the empty loop, subtracted
            pass
        per_step -= (time.perf_counter() - t0) / (calls * 10)
        intervals = [RankInterval(5, 5, {"data": 0.001, "process": 0.01, "commit": 0.001, "hooks": 0.0})] * 2
        t0 = time.perf_counter()
        for i in range(calls):
            observer.on_record(
                batches_committed=i,
                examples_committed=i,
                batches_processed=i,
                examples_processed=i,
                preempted=False,
                last=False,
                metrics=None,
            )
            observer.on_commit(intervals=intervals, own_records=[], batches_committed=i, examples_committed=i, metrics=None)
        per_commit = (time.perf_counter() - t0) / calls
        observer.close()
        opens = 20
        t0 = time.perf_counter()
        for i in range(opens):
            observer = JobObserver(
                ObserveOptions(progress="bar", tensorboard=tensorboard_installed()),
                rank=0,
                world_size=2,
                job_name="bench",
                batch_size=1,
                tensorboard=Storage(tmp).mirrored_folder(f"tb{i}", "tb"),
                device=torch.device("cpu"),
            )
            observer.start(total_batches=10, total_examples=10, committed_batches=0, committed_examples=0, remaining_batches=10)
            observer.close()
        per_call = (time.perf_counter() - t0) / opens
    return per_step, per_commit, per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="tbp-bench-observe-") as tmp, open(os.devnull, "w") as devnull:
        root = Path(tmp)
        for batch_size, interval in SHAPES:
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in CONFIGS}
            with contextlib.redirect_stderr(devnull):
                for config in CONFIGS:  # warm-up: imports (tensorboard), caches
                    run_once(config, min(args.examples, 2000), batch_size, interval, root)
                for round_ in range(args.rounds):
                    order = list(CONFIGS) if round_ % 2 == 0 else list(reversed(CONFIGS))
                    for config in order:
                        times[config].append(run_once(config, args.examples, batch_size, interval, root))
            rows.append((batch_size, interval, times))
            print(f"  done: batch_size={batch_size}, checkpoint_interval={interval}", file=sys.stderr, flush=True)
        with contextlib.redirect_stderr(devnull):
            per_step, per_commit, per_call = observer_costs()
    print(f"\nobservability overhead, {args.examples} examples per run, {args.rounds} interleaved rounds (medians)")
    print(
        f"{'batch':>5} {'commit every':>12} {'steps/s':>8} {'wall off':>9} {'wall on':>9} {'wall +':>8} "
        f"{'cpu off':>9} {'cpu on':>9} {'cpu +':>8} {'observer':>9}"
    )
    for batch_size, interval, times in rows:
        wall_off, cpu_off = zip(*times["off"])
        wall_on, cpu_on = zip(*times["on"])
        wall_paired = statistics.median(b / a for a, b in zip(wall_off, wall_on)) - 1
        cpu_paired = statistics.median(b / a for a, b in zip(cpu_off, cpu_on)) - 1
        steps = args.examples // batch_size
        analytic = (steps * per_step + (steps // interval + 1) * per_commit) / min(wall_off)
        print(
            f"{batch_size:>5} {interval:>12} {steps / min(wall_off):>8.0f} {statistics.median(wall_off):>9.3f} "
            f"{statistics.median(wall_on):>9.3f} {wall_paired:>+8.2%} {statistics.median(cpu_off):>9.3f} "
            f"{statistics.median(cpu_on):>9.3f} {cpu_paired:>+8.2%} {analytic:>+9.3%}"
        )
    print(
        f"\nobserver alone: {per_step * 1e9:.0f} ns per step (rank 0), {per_commit * 1e6:.1f} us per commit, "
        f"{per_call * 1e3:.1f} ms per call (opening and closing the bar and the event file).\n"
        "'wall +', 'cpu +': median over rounds of on/off - 1 (CPU time counts every thread of the process, e.g. "
        "the event file writer, and is less disturbed by other processes);\n"
        "'observer': the observer's per-step and per-commit cost over the fastest 'off' wall time (the overhead "
        "without machine noise; the per-call cost comes on top, once per job)"
    )


if __name__ == "__main__":
    main()
