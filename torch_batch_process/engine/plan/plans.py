"""The plan: which global batches a job has and which dataset examples each one holds.

A plan is deterministic from the job's fingerprint, so every rank and every resume (with any world size)
computes the same one, and a global batch index ``g`` names the same examples forever: it is what progress,
outputs and ``batch_idx`` are about. Two kinds exist:

- :class:`ContiguousPlan` (DESIGN §3): global batch ``g`` holds examples ``[g*B, min((g+1)*B, N))``;
- :class:`BucketedPlan` (DESIGN §9): examples of similar length batched together (see
  :mod:`torch_batch_process.engine.plan.bucketing`).

``max_batches`` caps the batches of each rank, as in Determined: with round-robin dealing the first
``max_batches`` batches of every rank of a fresh run are exactly global batches ``[0, max_batches * W)``,
so a plan only ever holds a prefix of its batches (:func:`planned_batches`), fixed at the job's first start.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from torch_batch_process.engine.plan.bucketing import (
    BucketLayout,
    bucket_layout,
    contiguous_padded_tokens,
    layout_fingerprint,
    token_stats,
)
from torch_batch_process.jobstore.ranges import RangeSet

__all__ = ["BucketedPlan", "ContiguousPlan", "Plan", "dataset_plan", "planned_batches"]


class Plan(abc.ABC):
    """The global batches of a job (see the module docstring)."""

    num_batches: int
    """Global batches of the job (after ``max_batches``)."""
    first_batch: int = 0
    """The number of the first batch: the plan's batches are ``[first_batch, first_batch + num_batches)`` (a retry's
    batches are numbered after those of the job it retries, see :mod:`torch_batch_process.engine.plan.retry`)."""

    @abc.abstractmethod
    def batch_indices(self, batch: int) -> Sequence[int]:
        """Dataset indices of the examples of global batch ``batch``, in the batch's order."""

    @abc.abstractmethod
    def count_examples(self, batches: RangeSet) -> int:
        """Number of examples in a set of global batches."""

    @abc.abstractmethod
    def cut(self, num_batches: int) -> Plan:
        """The same plan with only its first ``num_batches`` batches (``max_batches``)."""

    @property
    def num_examples(self) -> int:
        """Examples in the job's batches."""
        return self.count_examples(self.remaining(RangeSet()))

    def remaining(self, committed: RangeSet) -> RangeSet:
        """The plan's batches that ``committed`` does not hold."""
        return committed.complement(self.first_batch + self.num_batches, self.first_batch)

    def fingerprint(self) -> dict[str, Any] | None:
        """What a resume must match beyond the dataset length and batch size (``None``: nothing more)."""
        return None

    def describe(self) -> str:
        """A few words for the start-up log line."""
        return f"{self.num_examples} examples in {self.num_batches} batches"

    def token_stats(self) -> dict[str, Any] | None:
        """Real and padded tokens of the plan and of dataset order (``bucket_by`` plans; ``None`` otherwise)."""
        return None


class ContiguousPlan(Plan):
    """Global batch ``g`` holds examples ``[g * batch_size, min((g + 1) * batch_size, dataset_length))``."""

    def __init__(self, dataset_length: int, batch_size: int, num_batches: int | None = None) -> None:
        self.dataset_length = dataset_length
        self.batch_size = batch_size
        self.num_batches = math.ceil(dataset_length / batch_size) if num_batches is None else num_batches

    def cut(self, num_batches: int) -> ContiguousPlan:
        return ContiguousPlan(self.dataset_length, self.batch_size, num_batches)

    def batch_indices(self, batch: int) -> range:
        start = batch * self.batch_size
        return range(start, min(start + self.batch_size, self.dataset_length))

    def count_examples(self, batches: RangeSet) -> int:
        total = 0
        for start, stop in batches.ranges():
            total += max(0, min(stop * self.batch_size, self.dataset_length) - start * self.batch_size)
        return total

    def describe(self) -> str:
        return f"{self.num_examples} examples in {self.num_batches} batches of {self.batch_size}"


class BucketedPlan(Plan):
    """Batches of examples of similar length (see :mod:`torch_batch_process.engine.plan.bucketing`).

    Args:
        lengths: the length of every example (``bucket_by``, resolved: an integer numpy array).
        batch_size: the most examples of a batch.
        window: ``bucket_window``.
        max_tokens: cap of ``len(batch) * max length``, or ``None``.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, window: int, max_tokens: int | None) -> None:
        self.lengths = lengths
        self.batch_size = batch_size
        self.window = window
        self.max_tokens = max_tokens
        self.layout: BucketLayout = bucket_layout(lengths, batch_size, window, max_tokens)
        self.num_batches = self.layout.num_batches()
        self._fingerprint = layout_fingerprint(lengths, batch_size, window, max_tokens)
        self._tokens: dict[str, Any] | None = None

    def cut(self, num_batches: int) -> BucketedPlan:
        plan = object.__new__(BucketedPlan)
        plan.__dict__.update(self.__dict__)
        plan.num_batches = min(num_batches, self.layout.num_batches())
        plan._tokens = None
        return plan

    def batch_indices(self, batch: int) -> list[int]:
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"batch {batch} is not in the plan (0..{self.num_batches - 1})")
        return self.layout.batch_indices(batch).tolist()

    def count_examples(self, batches: RangeSet) -> int:
        offsets = self.layout.offsets
        total = 0
        for start, stop in batches.ranges():
            stop = min(stop, self.num_batches)
            if start < stop:
                total += int(offsets[stop] - offsets[start])
        return total

    def fingerprint(self) -> dict[str, Any]:
        return self._fingerprint

    def token_stats(self) -> dict[str, Any]:
        """See :func:`~torch_batch_process.engine.plan.bucketing.token_stats` (over the planned batches; computed once)."""
        if self._tokens is None:
            self._tokens = token_stats(self.layout, self.lengths, self.batch_size, self.num_batches)
        return self._tokens

    def padded_tokens(self) -> tuple[int, int]:
        """Padded tokens (``len(batch) * max length`` summed over batches) of this plan and of the same
        examples in dataset order, to show what bucketing saves."""
        return self.layout.planned_padded_tokens, contiguous_padded_tokens(self.lengths, self.batch_size)

    def describe(self) -> str:
        tokens = self.token_stats()
        bucketed, ordered = tokens["padded"], tokens["padded_in_order"]
        oversized = self.layout.num_oversized
        oversized = f"; {oversized} example(s) longer than max_tokens, alone" if oversized else ""
        return (
            f"{self.num_examples} examples in {self.num_batches} length-bucketed batches (at most {self.batch_size}, "
            f"windows of {self.window} batches{f', max_tokens {self.max_tokens}' if self.max_tokens else ''}): "
            f"{bucketed} padded tokens instead of {ordered} in dataset order{oversized}"
        )


def planned_batches(num_batches: int, max_batches: int | None, world_size: int) -> int:
    """Number of global batches a fresh job processes: all, or the first ``max_batches`` of every rank."""
    if max_batches is None:
        return num_batches
    return min(num_batches, max_batches * world_size)


def dataset_plan(
    dataset_length: int, batch_size: int, lengths: np.ndarray | None, window: int, max_tokens: int | None
) -> Plan:
    """The plan of a map-style dataset: contiguous batches, or length-bucketed ones when ``lengths`` are given."""
    if lengths is None:
        return ContiguousPlan(dataset_length, batch_size)
    return BucketedPlan(lengths, batch_size, window, max_tokens)
