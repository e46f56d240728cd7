"""A text model with a simulated device memory, for the out-of-memory tests (DESIGN §15; tests/test_oom.py).

Example ``i`` is a sequence of ``lengths[i]`` token ids; the loader pads a batch to its longest example. The model
holds a *simulated device memory* of ``budget`` padded tokens (or examples, with ``unit="examples"``): a batch of
more raises a real ``torch.OutOfMemoryError``, as the CUDA allocator does, after the model has done part of its
work (its reducers updated, a file written, rows written: all of which the library must undo). Each example's
output depends only on the example (``sum(ids) + 1000 * index``), never on the batch it was in, so a job's outputs
are the same whether its batches ran whole or in parts.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from torch_batch_process import MetricReducer, TorchBatchProcessor

__all__ = ["Embedder", "SimulatedMemory", "Texts", "expected_value", "lengths_for", "pad_collate"]


def lengths_for(n: int, seed: int = 0, low: int = 20, high: int = 128) -> list[int]:
    """Example lengths, uniform in ``[low, high]``."""
    return np.random.default_rng(seed).integers(low, high + 1, size=n).tolist()


class Texts(torch.utils.data.Dataset):
    """Example ``i``: ``lengths[i]`` token ids ``(i + j) % 97 + 1``."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "ids": (torch.arange(self.lengths[i]) + i) % 97 + 1}


def pad_collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pads the batch to its longest example (as a tokenizer's ``padding=True``)."""
    longest = max(len(item["ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["ids"])] = item["ids"]
    return {"ids": ids, "index": torch.tensor([item["index"] for item in items])}


def expected_value(lengths: list[int], i: int) -> int:
    return int(sum((j + i) % 97 + 1 for j in range(lengths[i]))) + 1000 * i


class SimulatedMemory:
    """A device memory of ``budget`` padded tokens (``len(batch) * longest``), or of ``budget`` examples."""

    def __init__(self, budget: int | None, unit: str = "tokens") -> None:
        self.budget = budget
        self.unit = unit
        self.ooms = 0
        self.calls: list[int] = []
        """The size of every batch (or part) the model was given."""

    def allocate(self, ids: torch.Tensor) -> None:
        size = ids.numel() if self.unit == "tokens" else int(ids.shape[0])
        self.calls.append(size)
        if self.budget is not None and size > self.budget:
            self.ooms += 1
            raise torch.OutOfMemoryError(
                f"simulated device: tried to allocate {size} {self.unit} with {self.budget} {self.unit} free"
            )


class SumReducer(MetricReducer):
    """A custom reducer (its state is copied before each attempt, restored after a failed one)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total, self.count = 0, 0

    def per_slot_reduce(self) -> tuple[int, int]:
        return self.total, self.count

    def cross_slot_reduce(self, per_slot_metrics: list[tuple[int, int]]) -> dict[str, int]:
        totals, counts = zip(*per_slot_metrics, strict=True)
        return {"index_sum": sum(totals), "count": sum(counts)}


class Embedder(TorchBatchProcessor):
    """Writes one row per example (``value``, ``length``) and a file ``vals_<batch_idx>.json`` of its indices,
    updates two reducers, then runs its model on the simulated device (set ``memory`` on the class): a batch that
    does not fit fails after all that, which the library must undo."""

    memory = SimulatedMemory(None)
    too_long: frozenset[int] = frozenset()
    """Examples the model can never hold (a simulated out-of-memory error whenever one is in the batch)."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.sums = context.wrap_reducer(SumReducer(), name=None)
        self.seen = context.wrap_reducer(lambda values: sorted(v for batch in values for v in batch), name="seen")

    def process_batch(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        index = batch["index"].tolist()
        assert index == list(self.context.batch_indices), (index, list(self.context.batch_indices))
        self.sums.total += sum(index)  # before the model runs: a failed attempt must not count
        self.sums.count += len(index)
        self.seen.update(index)
        with self.context.upload_path() as path:
            (path / f"vals_{batch_idx}.json").write_text(json.dumps(index))
        ids = batch["ids"]
        values = ids.sum(dim=1) + 1000 * batch["index"]
        self.context.write({"value": values, "length": (ids > 0).sum(dim=1)})  # before the model runs too
        if self.too_long & set(index):
            self.memory.ooms += 1
            raise torch.OutOfMemoryError(f"simulated device: example(s) {sorted(self.too_long & set(index))} too long")
        self.memory.allocate(ids)
