"""Does the device copy ahead's order cost anything when the loader is late? A CPU simulation.

    python -m benchmarks.lookahead_order                       # loads of 10, 30, 36 and 45 ms, 2 workers
    python -m benchmarks.lookahead_order --load-ms 30 --workers 8

On CUDA, ``DevicePrefetcher`` (engine/feed/prefetch.py) pulls batch ``i+1`` from the loader *before* it hands out
batch ``i`` (its ``Lookahead`` fills its queue first), where a hand loop runs ``i`` and then asks for ``i+1``. When
``i+1`` is late, batch ``i`` waits for it. This runs the same ``Lookahead`` (with identity stages: no device) and a
plain loop over one ``DataLoader`` whose workers take a log-normal, seeded time per batch (``--load-ms`` median,
sigma 0.6), against a consumer that waits ``--gpu-ms`` per batch with the GIL released (the host waiting on a
synchronising ``.cpu()``), and prints the steady time of each (first batch to last) and their ratio per round, the
order alternating between rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from torch_batch_process.engine.feed.prefetch import Lookahead


class LateBatches(Dataset):
    """Batch ``i`` (``batch_size=None``: the dataset's items are batches) after a seeded, log-normal load time."""

    def __init__(self, n: int, load_ms: float) -> None:
        self.n, self.load_ms = n, load_ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(random.Random(i).lognormvariate(0, 0.6) * self.load_ms / 1000)
        return torch.full((4,), float(i))


def steady_seconds(order: str, batches: int, load_ms: float, gpu_ms: float, workers: int) -> float:
    """Seconds from the first batch handed out to the end of the last one's work."""
    loader = DataLoader(LateBatches(batches, load_ms), batch_size=None, num_workers=workers, prefetch_factor=2)
    items: Iterator[Any] = iter(enumerate(loader))
    if order == "lookahead":
        items = Lookahead(items, lambda item: item, lambda item: item, 1)
    first = None
    for _ in items:
        first = first or time.perf_counter()
        time.sleep(gpu_ms / 1000)
    assert first is not None
    return time.perf_counter() - first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-ms", type=float, nargs="+", default=[10.0, 30.0, 36.0, 45.0],
                        help="a worker's median load time per batch (several: one row each)")
    parser.add_argument("--gpu-ms", type=float, default=18.0, help="the consumer's wait per batch")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{args.batches} batches, {args.workers} worker(s), the consumer waits {args.gpu_ms} ms a batch; "
          f"{args.rounds} rounds, order alternating")
    print()
    print("| median load, ms | plain loop, s | lookahead (the copy ahead's order), s | plain / lookahead per round |")
    print("|---:|---:|---:|---|")
    for load_ms in args.load_ms:
        seconds: dict[str, list[float]] = {"plain": [], "lookahead": []}
        for index in range(args.rounds):
            for order in ("plain", "lookahead") if index % 2 == 0 else ("lookahead", "plain"):
                seconds[order].append(steady_seconds(order, args.batches, load_ms, args.gpu_ms, args.workers))
        ratios = ", ".join(f"{p / q:.3f}" for p, q in zip(seconds["plain"], seconds["lookahead"], strict=True))
        print(f"| {load_ms:g} | {statistics.median(seconds['plain']):.3f} | "
              f"{statistics.median(seconds['lookahead']):.3f} | {ratios} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
