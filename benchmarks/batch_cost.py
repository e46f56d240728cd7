"""The library's own CPU cost per batch: trivial batches and work, so that only the loop around them shows.

    python -m benchmarks.batch_cost                  # 20,000 batches, 5 rounds
    python -m benchmarks.batch_cost --batches 50000 --rounds 7

Every batch is the same prebuilt tensor (``__getitems__`` and an identity ``collate_fn``: the DataLoader does
almost nothing), ``process_batch`` does nothing or writes one empty file through ``upload_path()``; the hand loop
iterates the same DataLoader under ``torch.inference_mode()`` and writes the same files. The library runs with its
defaults (``on_oom="split"``: each batch a transaction), and once with ``on_oom="raise"`` (no transaction).
Each variant runs in this process, in turn, ``--rounds`` times; the figure is process CPU time (all threads) per
batch, the minimum over the rounds (CPU time drifts less than the wall clock on a shared machine; the minimum is the
run least disturbed). Storage is a temporary folder on ``/dev/shm`` when there is one (no disk noise).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.report import machine, machine_line, new_results_dir, save_json
from torch_batch_process import TorchBatchProcessor, torch_batch_process

BATCH = torch.zeros(10)


class SameBatch(Dataset):
    """``n`` batches of 10 examples, each the same tensor."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return self.batches * len(BATCH)

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return BATCH

    def __getitem__(self, index: int) -> torch.Tensor:
        return BATCH[0]


def identity(batch: Any) -> Any:
    return batch


class Nothing(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        pass


class OneFile(Nothing):
    def process_batch(self, batch: Any, batch_idx: int) -> None:
        with self.context.upload_path() as path:
            open(os.path.join(path, f"b{batch_idx}"), "w").close()  # noqa: SIM115 - an empty file


def _hand(dataset: SameBatch, folder: Path, files: bool) -> None:
    out = folder / "outputs"
    out.mkdir(parents=True)
    with torch.inference_mode():
        for i, _ in enumerate(DataLoader(dataset, batch_size=len(BATCH), collate_fn=identity)):
            if files:
                open(out / f"b{i}", "w").close()  # noqa: SIM115


def _library(dataset: SameBatch, folder: Path, processor: type, interval: int, on_oom: str = "split") -> None:
    torch_batch_process(
        processor, dataset, batch_size=len(BATCH), storage_path=str(folder), checkpoint_interval=interval,
        progress=False, dataloader_kwargs={"collate_fn": identity}, on_oom=on_oom,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dataset = SameBatch(args.batches)
    never = args.batches + 1
    variants: list[tuple[str, Callable[[Path], None]]] = [
        ("hand loop, no files", lambda f: _hand(dataset, f, False)),
        ("library, no files, no commit until the end", lambda f: _library(dataset, f, Nothing, never)),
        ("library, no files, a commit every 5 batches", lambda f: _library(dataset, f, Nothing, 5)),
        (
            "library, no files, no commit until the end, on_oom='raise'",
            lambda f: _library(dataset, f, Nothing, never, "raise"),
        ),
        ("hand loop, one file per batch", lambda f: _hand(dataset, f, True)),
        ("library, one file per batch, no commit until the end", lambda f: _library(dataset, f, OneFile, never)),
        (
            "library, one file per batch, no commit until the end, on_oom='raise'",
            lambda f: _library(dataset, f, OneFile, never, "raise"),
        ),
        ("library, one file per batch, a commit every 5 batches", lambda f: _library(dataset, f, OneFile, 5)),
    ]
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    costs: dict[str, list[float]] = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory(prefix="tbp-batch-cost-", dir=base) as scratch:
        for _ in range(args.rounds):
            for name, run in variants:
                folder = Path(scratch) / "job"
                shutil.rmtree(folder, ignore_errors=True)
                started = time.process_time()
                run(folder)
                costs[name].append((time.process_time() - started) / args.batches * 1e6)
    info = machine()
    out_dir = new_results_dir("batch_cost")
    save_json(out_dir / "results.json", {"machine": info, "batches": args.batches, "costs_us": costs})
    print("| Variant | CPU us per batch (min) | median |")
    print("|---|---:|---:|")
    for name, _ in variants:
        values = sorted(costs[name])
        print(f"| {name} | {values[0]:.1f} | {values[len(values) // 2]:.1f} |")
    print(f"\n{args.batches:,} batches, {args.rounds} rounds. Machine: {machine_line(info)}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
