"""What a job has learned about its device's memory (DESIGN §15), as its ranks share it and its records store it.

A batch's *size* is what its memory grows with:

- with ``bucket_by`` (unit ``"tokens"``): ``len(batch) * max(length in batch)``, the padded tokens, as
  ``max_tokens`` counts them;
- without (unit ``"examples"``): the number of examples.

For each *length range* the limits keep the largest size that fitted (``fits``; 0: none known) and the smallest
size that ran out of memory (``oom``; ``None``: none known). Range ``k`` holds the batches whose longest example
has a length in ``(2**(k-1), 2**k]`` (range 0: lengths 0 and 1); without ``bucket_by`` there is one range, 0.
Ranges matter because memory per token grows with the length (attention), so a long batch fits fewer tokens.

:meth:`MemoryLimits.bounds` reads a range's limits with what its neighbours say, assuming that memory per token
does not shrink as examples get longer: a size that fitted with longer examples fits with shorter ones, and a
size that ran out of memory with shorter examples runs out with longer ones. A range with no out-of-memory of its
own or of a shorter range borrows the nearest longer range's as a guess. An out-of-memory always wins over a fit
it contradicts (the fit is forgotten): limits only get more careful, never less.

The limits hold for one kind of device (``device``: e.g. ``"cuda NVIDIA H100 80GB HBM3 85045870592"``, its name and
memory): limits of another kind are not merged, and a job resumed on another kind of device learns anew.

The JSON form (``{"unit": ..., "device": ..., "ranges": [[k, fits, oom], ...]}``) is stored in every commit record
(``memory_limits``), so a resumed job (with any world size) starts from what earlier attempts learned; the ranks
send what changed in their commit votes, and :meth:`MemoryLimits.merge` joins them (largest fit, smallest
out-of-memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryLimits", "RangeLimit", "length_range", "range_lengths"]

UNITS = ("tokens", "examples")


def length_range(length: int) -> int:
    """The range of a batch whose longest example has ``length``: ``k`` with ``2**(k-1) < length <= 2**k``."""
    return (max(int(length), 1) - 1).bit_length()


def range_lengths(key: int) -> tuple[int, int]:
    """The lengths range ``key`` holds, both ends included."""
    return (0, 1) if key == 0 else (2 ** (key - 1) + 1, 2**key)


@dataclass
class RangeLimit:
    """What is known of one length range."""

    fits: int = 0
    """The largest size that fitted (0: none known)."""
    oom: int | None = None
    """The smallest size that ran out of memory (``None``: none known)."""


class MemoryLimits:
    """The learned limits of a job (see the module docstring).

    Args:
        unit: ``"tokens"`` (with ``bucket_by``) or ``"examples"``.
        ranges: what is known, by length range.
        device: the kind of device they hold for.
    """

    def __init__(self, unit: str, ranges: dict[int, RangeLimit] | None = None, device: str = "") -> None:
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        self.unit = unit
        self.device = device
        self.ranges: dict[int, RangeLimit] = dict(ranges or {})

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryLimits):
            return NotImplemented
        return self.unit == other.unit and self.device == other.device and self.ranges == other.ranges

    def same_kind(self, other: MemoryLimits | dict[str, Any]) -> bool:
        """Whether ``other`` (or its JSON form) holds for the same unit and kind of device."""
        if isinstance(other, dict):
            return other.get("unit") == self.unit and other.get("device", "") == self.device
        return other.unit == self.unit and other.device == self.device

    # ------------------------------------------------------------------ learning

    def fitted(self, key: int, size: int) -> bool:
        """A batch of ``size`` in range ``key`` fitted; returns whether that is news. A size at or above an
        out-of-memory of the range is no news: the out-of-memory wins."""
        limit = self.ranges.get(key)
        if limit is not None and (size <= limit.fits or (limit.oom is not None and size >= limit.oom)):
            return False
        if limit is None:
            self.ranges[key] = limit = RangeLimit()
        limit.fits = size
        return True

    def ran_out(self, key: int, size: int) -> bool:
        """A batch of ``size`` in range ``key`` ran out of memory; returns whether that is news. A fit it
        contradicts is forgotten."""
        limit = self.ranges.setdefault(key, RangeLimit())
        if limit.oom is not None and size >= limit.oom:
            return False
        limit.oom = size
        if limit.fits >= size:
            limit.fits = 0
        return True

    def merge(self, other: MemoryLimits | dict[str, Any]) -> set[int]:
        """Adds what ``other`` (another rank's news, or a stored record's) knows; returns the ranges that changed."""
        if isinstance(other, dict):
            other = MemoryLimits.from_json(other)
        if not self.same_kind(other):
            raise ValueError(
                f"cannot merge limits in {other.unit} for {other.device!r} into limits in {self.unit} for "
                f"{self.device!r}"
            )
        changed = set()
        for key, theirs in other.ranges.items():
            mine = self.ranges.get(key)
            before = (mine.fits, mine.oom) if mine is not None else None
            if theirs.oom is not None:
                self.ran_out(key, theirs.oom)
            if theirs.fits:
                self.fitted(key, theirs.fits)
            mine = self.ranges.get(key)
            if mine is not None and (mine.fits, mine.oom) != before:
                changed.add(key)
        return changed

    # ------------------------------------------------------------------ reading

    def bounds(self, key: int) -> tuple[int, int | None]:
        """``(lo, hi)`` for range ``key``: sizes up to ``lo`` fit; sizes from ``hi`` on run out of memory (``None``:
        no limit known), from the range's own limits and its neighbours' (see the module docstring)."""
        hi: int | None = None
        for k, limit in self.ranges.items():  # certain: an out-of-memory with examples no longer than these
            if k <= key and limit.oom is not None and (hi is None or limit.oom < hi):
                hi = limit.oom
        if hi is None:  # a guess: the nearest longer range's
            longer = [k for k, limit in self.ranges.items() if k > key and limit.oom is not None]
            if longer:
                hi = self.ranges[min(longer)].oom
        lo = 0
        for k, limit in self.ranges.items():  # certain: a fit with examples at least as long
            if k >= key and limit.fits > lo and (hi is None or limit.fits < hi):
                lo = limit.fits
        return lo, hi

    def budget(self) -> int | None:
        """The largest size known to fit in the range of the longest examples that met a limit (``None``: no
        out-of-memory seen): with ``bucket_by``, the ``max_tokens`` the job learned for its longest batches."""
        limited = [k for k, limit in self.ranges.items() if limit.oom is not None]
        if not limited:
            return None
        return self.bounds(max(limited))[0] or None

    def describe(self) -> str:
        """One line: what fits and what ran out of memory, per length range."""
        if not self.ranges:
            return "nothing learned (no out-of-memory error)"
        if self.unit == "examples":
            limit = self.ranges.get(0, RangeLimit())
            return f"examples per batch: {_facts(limit)}"
        parts = []
        for key in sorted(self.ranges, reverse=True):
            low, high = range_lengths(key)
            parts.append(f"lengths {low}-{high}: {_facts(self.ranges[key])}")
        return "tokens per batch (len(batch) * longest): " + "; ".join(parts)

    def summary(self) -> dict[str, Any]:
        """For the result and ``tbp status``: the unit, the ranges with their lengths, the learned budget and the
        one-line description."""
        ranges = []
        for key in sorted(self.ranges, reverse=True):
            limit = self.ranges[key]
            entry: dict[str, Any] = {"fits": limit.fits or None, "oom": limit.oom}
            if self.unit == "tokens":
                entry["lengths"] = list(range_lengths(key))
            ranges.append(entry)
        return {
            "unit": self.unit,
            "device": self.device,
            "budget": self.budget(),
            "ranges": ranges,
            "text": self.describe(),
        }

    # ------------------------------------------------------------------ stored form

    def to_json(self, keys: set[int] | None = None) -> dict[str, Any]:
        """The JSON form; only ranges ``keys`` when given (a rank's news)."""
        chosen = sorted(self.ranges if keys is None else keys & set(self.ranges))
        return {
            "unit": self.unit,
            "device": self.device,
            "ranges": [[k, self.ranges[k].fits, self.ranges[k].oom] for k in chosen],
        }

    @classmethod
    def from_json(cls, value: Any) -> MemoryLimits:
        """Reads the JSON form; ``ValueError`` when it is not one."""
        if not isinstance(value, dict) or value.get("unit") not in UNITS or not isinstance(value.get("ranges"), list):
            raise ValueError(f"not memory limits: {value!r:.200}")
        ranges = {}
        for entry in value["ranges"]:
            key, fits, oom = entry
            ranges[int(key)] = RangeLimit(int(fits), None if oom is None else int(oom))
        return cls(value["unit"], ranges, str(value.get("device", "")))


def _facts(limit: RangeLimit) -> str:
    facts = []
    if limit.fits:
        facts.append(f"{limit.fits:,} fit")
    if limit.oom is not None:
        facts.append(f"{limit.oom:,} ran out of memory")
    return ", ".join(facts) or "nothing known"
