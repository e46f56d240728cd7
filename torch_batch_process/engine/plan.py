"""Sharding: which rank processes which global batch, at which step.

The dataset is cut into contiguous global batches: batch ``g`` holds examples
``[g * batch_size, min((g + 1) * batch_size, num_examples))``. The batches not yet committed are
dealt round-robin over the ranks of the current world: the ``i``-th remaining batch goes to rank
``i % world_size`` at step ``i // world_size``. On a fresh run that is simply batch ``g`` on rank
``g % world_size``. Every rank runs the same number of steps; a rank with no batch left in a step
idles through it, so no example is padded or duplicated and no rank waits for a collective that
another rank never reaches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from torch.utils.data import Sampler

from torch_batch_process.engine.ranges import IndexedRanges, RangeSet


@dataclass(frozen=True)
class BatchGeometry:
    """How a dataset of ``num_examples`` is cut into global batches of ``batch_size``."""

    num_examples: int
    batch_size: int

    @property
    def num_batches(self) -> int:
        """Number of global batches (the last one may be short)."""
        return math.ceil(self.num_examples / self.batch_size)

    def examples(self, batch_idx: int) -> range:
        """Dataset indices of global batch ``batch_idx``."""
        start = batch_idx * self.batch_size
        return range(start, min(start + self.batch_size, self.num_examples))

    def count_examples(self, batches: RangeSet) -> int:
        """Number of examples in a set of global batches."""
        total = 0
        for start, stop in batches.ranges():
            total += max(0, min(stop * self.batch_size, self.num_examples) - start * self.batch_size)
        return total


def planned_batches(num_batches: int, max_batches: int | None, world_size: int) -> int:
    """Number of global batches a fresh job processes.

    ``max_batches`` caps the batches of each rank (as in Determined); with round-robin dealing the
    first ``max_batches`` batches of every rank are exactly global batches ``[0, max_batches * W)``.
    """
    if max_batches is None:
        return num_batches
    return min(num_batches, max_batches * world_size)


class ShardPlan:
    """Round-robin dealing of the remaining global batches over the ranks of this attempt."""

    def __init__(self, remaining: RangeSet, world_size: int) -> None:
        self._remaining = IndexedRanges(remaining)
        self.world_size = world_size

    @property
    def num_remaining(self) -> int:
        """Number of batches this attempt has to process, over all ranks."""
        return len(self._remaining)

    @property
    def num_steps(self) -> int:
        """Steps every rank runs: ``ceil(remaining / world_size)``."""
        return math.ceil(len(self._remaining) / self.world_size)

    def batch_at(self, step: int, rank: int) -> int | None:
        """Global batch of ``rank`` at ``step``, or ``None`` when the rank idles in that step."""
        index = step * self.world_size + rank
        return self._remaining[index] if index < len(self._remaining) else None

    def num_batches_of(self, rank: int) -> int:
        """Number of batches dealt to ``rank`` (its batches are steps ``0 .. n-1``)."""
        return max(0, math.ceil((len(self._remaining) - rank) / self.world_size))

    def batches_of(self, rank: int) -> Iterator[int]:
        """Global batches of ``rank`` in step order."""
        for step in range(self.num_batches_of(rank)):
            yield self._remaining[step * self.world_size + rank]


class RankBatchSampler(Sampler[list[int]]):
    """Yields the dataset indices of one rank's batches, in step order.

    Given to ``torch.utils.data.DataLoader`` as ``batch_sampler``, so the loader (with its workers,
    pinned memory and prefetching) only ever loads the examples of this rank's remaining batches.
    """

    def __init__(self, plan: ShardPlan, rank: int, geometry: BatchGeometry) -> None:
        self._plan = plan
        self._rank = rank
        self._geometry = geometry

    def __iter__(self) -> Iterator[list[int]]:
        for batch_idx in self._plan.batches_of(self._rank):
            yield list(self._geometry.examples(batch_idx))

    def __len__(self) -> int:
        return self._plan.num_batches_of(self._rank)
