"""Cutting batches to what the device's memory holds (DESIGN §15), from what the job learned.

A rank's :class:`BatchFitter` holds the job's :class:`~torch_batch_process.jobstore.memory_limits.MemoryLimits`
(stored with the job, merged from the other ranks' votes, updated by this rank's own batches) and decides, for a
batch or what is left of one, how many of its leading examples the next part takes:

- **Nothing known** (no out-of-memory error in the batch's length range or one it borrows from): the batch runs
  as it is. A job that never runs out of memory pays nothing else (:attr:`BatchFitter.active` is false).
- **A part that fits** (its size at most ``lo``, the largest that fitted): it runs as it is.
- **Else** the batch is cut into parts of at most a *target* size: half of the out-of-memory size while nothing
  that fits is known (the halves of DESIGN §11); the middle of ``lo`` and ``hi`` while they are more than
  :data:`TOLERANCE` apart (each such part is a probe: it fits, and ``lo`` rises, or it runs out of memory, and
  ``hi`` drops; each probe halves the gap, so from halves that fit, two probes at most find the limit to within
  ``TOLERANCE``); ``lo`` once they are close.

With ``bucket_by`` (unit ``"tokens"``) parts are cut greedily in the batch's order, as ``max_tokens`` cuts a
window: a part takes as many examples as keep ``len(part) * max(length in part)`` within the target (a bucketed
batch is sorted longest first, so its first example sets the part's length). Without (unit ``"examples"``) a
batch is cut into the fewest parts of at most the target, of equal sizes (give or take one), so a batch of 64
that fits 40 runs as 32 + 32, not 40 + 24.

A part always holds at least one example; one example that runs out of memory alone does not fit at all (it is
a failing example, see :mod:`~torch_batch_process.engine.feed.oom`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from torch_batch_process.jobstore.memory_limits import MemoryLimits, length_range

__all__ = ["BatchFitter", "TOLERANCE"]

TOLERANCE = 1 / 4
"""Probing stops once the smallest size that ran out of memory is within this fraction above the largest that
fitted: the job then runs parts of the largest size known to fit, at least 80% of the device's limit (inference
throughput barely grows over the last fifth of a device's memory, and each failed probe costs an attempt)."""


class BatchFitter:
    """One rank's view of the job's memory limits, and the cuts they ask for (see the module docstring).

    Args:
        limits: the limits learned so far (a resumed job's come from its latest commit record).
        lengths: every example's length (``bucket_by``), or ``None`` (sizes in examples).
    """

    def __init__(self, limits: MemoryLimits, lengths: np.ndarray | None) -> None:
        self.limits = limits
        self._lengths = lengths
        self._news: set[int] = set()
        self._targets: dict[int, float] = {}
        self._bounds: dict[int, tuple[int, int | None]] = {}
        self.ooms = 0
        """Out-of-memory errors this rank met since its previous vote."""
        self.split_batches = 0
        """Batches this rank ran in parts since its previous vote."""

    @classmethod
    def for_job(cls, stored: dict[str, Any] | None, lengths: np.ndarray | None, device: str) -> BatchFitter:
        """The fitter of a job whose latest record stored ``stored`` (``None``: nothing learned yet), on a
        ``device`` of that kind (limits learned on another kind of device are not used)."""
        limits = MemoryLimits("tokens" if lengths is not None else "examples", device=device)
        if stored is not None and limits.same_kind(stored):
            limits.merge(stored)
        return cls(limits, lengths)

    @property
    def active(self) -> bool:
        """Whether anything is known: until then every batch runs as it is, at no cost."""
        return bool(self.limits)

    # ------------------------------------------------------------------ sizes

    def measure(self, indices: Sequence[int]) -> tuple[int, int]:
        """``(length range, size)`` of a part holding the examples ``indices``."""
        if self._lengths is None:
            return 0, len(indices)
        if not len(indices):
            return 0, 0
        longest = int(self._lengths[np.asarray(indices, dtype=np.int64)].max())
        return length_range(longest), len(indices) * longest

    def bounds(self, key: int) -> tuple[int, int | None]:
        """:meth:`MemoryLimits.bounds` of range ``key`` (kept until something changes)."""
        cached = self._bounds.get(key)
        if cached is None:
            cached = self._bounds[key] = self.limits.bounds(key)
        return cached

    def target(self, key: int) -> float:
        """The largest size a part in length range ``key`` may have (``inf``: no limit known)."""
        cached = self._targets.get(key)
        if cached is not None:
            return cached
        lo, hi = self.bounds(key)
        if hi is None:
            target: float = float("inf")
        elif lo == 0:
            target = max(1, hi // 2)
        elif hi > lo * (1 + TOLERANCE):
            target = (lo + hi) // 2
        else:
            target = lo
        self._targets[key] = target
        return target

    def fits(self, indices: Sequence[int]) -> bool:
        """Whether the examples ``indices`` may run as one part."""
        key, size = self.measure(indices)
        return size <= self.target(key)

    # ------------------------------------------------------------------ cuts

    def cut(self, indices: Sequence[int]) -> list[list[int]] | None:
        """The parts to run the examples ``indices`` in, in their order; ``None`` when they run as they are."""
        if not self.active or self.fits(indices):
            return None
        items = list(indices)
        parts = []
        while items:
            take = self.next_part(items)
            parts.append(items[:take])
            items = items[take:]
        return parts

    def next_part(self, remaining: Sequence[int], below: int | None = None) -> int:
        """How many leading examples of ``remaining`` the next part takes (at least 1; fewer than ``below`` when
        given: a part of ``below`` examples just ran out of memory there)."""
        n = len(remaining)
        cap = n if below is None else max(1, min(n, below - 1))
        if self._lengths is None:
            target = self.target(0)
            if n <= target:
                return cap
            parts = -(-n // max(1, int(target)))
            return max(1, min(cap, -(-n // parts)))
        lengths = self._lengths[np.asarray(remaining[:cap], dtype=np.int64)]
        longest = np.maximum.accumulate(lengths)
        sizes = np.arange(1, cap + 1, dtype=np.int64) * longest
        targets = np.empty(cap, dtype=np.float64)
        for value in np.unique(longest).tolist():  # a few distinct values (one for a bucketed batch)
            targets[longest == value] = self.target(length_range(value))
        over = np.flatnonzero(sizes > targets)
        return max(1, int(over[0]) if len(over) else cap)

    # ------------------------------------------------------------------ learning

    def fitted(self, indices: Sequence[int]) -> None:
        """The examples ``indices`` ran as one part without running out of memory (news only when larger than
        what is known to fit in their range: no vote carries the many batches that fit as expected)."""
        key, size = self.measure(indices)
        if size > self.bounds(key)[0] and self.limits.fitted(key, size):
            self._changed(key)

    def ran_out(self, indices: Sequence[int]) -> tuple[int, int]:
        """The examples ``indices`` ran out of memory as one part; returns their ``(range, size)``."""
        self.ooms += 1
        key, size = self.measure(indices)
        if self.limits.ran_out(key, size):
            self._changed(key)
        return key, size

    def _changed(self, key: int) -> None:
        self._news.add(key)
        self._forget()

    def _forget(self) -> None:
        self._targets.clear()
        self._bounds.clear()

    # ------------------------------------------------------------------ sharing

    def take_news(self) -> dict[str, Any] | None:
        """What this rank learned since its previous vote (the JSON form of the ranges that changed), or ``None``."""
        if not self._news:
            return None
        news, self._news = self._news, set()
        return self.limits.to_json(news)

    def take_counts(self) -> tuple[int, int]:
        """Out-of-memory errors and batches run in parts since the previous vote."""
        counts = (self.ooms, self.split_batches)
        self.ooms = self.split_batches = 0
        return counts

    def merge(self, news: dict[str, Any]) -> None:
        """Adds another rank's (or rank 0's merged) news (not if learned on another kind of device)."""
        if not self.limits.same_kind(news):
            return
        if self.limits.merge(news):
            self._forget()
