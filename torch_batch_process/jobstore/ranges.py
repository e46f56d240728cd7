"""Compact sets of global batch indices.

The progress of a job is the set of global batches whose outputs are committed. Jobs resumed with
another world size commit batches out of order, so the set is kept as sorted, disjoint, half-open
ranges: a job of a million batches that was interrupted a few times is a handful of ranges, and its
record stays a few hundred bytes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator


class RangeSet:
    """A set of non-negative integers stored as sorted, disjoint, half-open ``[start, stop)`` ranges."""

    __slots__ = ("_starts", "_stops")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []
        for start, stop in ranges:
            self.add_range(start, stop)

    @classmethod
    def from_json(cls, value: object) -> RangeSet:
        """Builds a set from its JSON form (a list of ``[start, stop]`` pairs), validating it."""
        if not isinstance(value, list):
            raise ValueError(f"expected a list of [start, stop] pairs, got {type(value).__name__}")
        result = cls()
        for pair in value:
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
                or not 0 <= pair[0] < pair[1]
            ):
                raise ValueError(f"invalid range {pair!r}: expected [start, stop] with 0 <= start < stop")
            result.add_range(pair[0], pair[1])
        return result

    def to_json(self) -> list[list[int]]:
        """Returns the JSON form: a list of ``[start, stop]`` pairs."""
        return [[a, b] for a, b in zip(self._starts, self._stops)]

    def add(self, value: int) -> None:
        """Adds one integer."""
        self.add_range(value, value + 1)

    def add_range(self, start: int, stop: int) -> None:
        """Adds every integer of ``[start, stop)``, merging touching or overlapping ranges."""
        if start < 0 or stop < start:
            raise ValueError(f"invalid range [{start}, {stop})")
        if start == stop:
            return
        # First range whose stop >= start (it touches or overlaps), last whose start <= stop.
        lo = bisect.bisect_left(self._stops, start)
        hi = bisect.bisect_right(self._starts, stop)
        if lo < hi:
            start = min(start, self._starts[lo])
            stop = max(stop, self._stops[hi - 1])
        self._starts[lo:hi] = [start]
        self._stops[lo:hi] = [stop]

    def update(self, other: RangeSet) -> None:
        """Adds every integer of ``other``."""
        for start, stop in other.ranges():
            self.add_range(start, stop)

    def ranges(self) -> Iterator[tuple[int, int]]:
        """Yields the ``(start, stop)`` ranges in increasing order."""
        return zip(list(self._starts), list(self._stops))

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        i = bisect.bisect_right(self._starts, value) - 1
        return i >= 0 and value < self._stops[i]

    def __len__(self) -> int:
        return sum(b - a for a, b in zip(self._starts, self._stops))

    def __iter__(self) -> Iterator[int]:
        for start, stop in self.ranges():
            yield from range(start, stop)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RangeSet) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return f"RangeSet({self.to_json()})"

    def complement(self, universe_stop: int, universe_start: int = 0) -> RangeSet:
        """Returns ``[universe_start, universe_stop)`` minus this set."""
        result = RangeSet()
        cursor = universe_start
        for start, stop in self.ranges():
            if start >= universe_stop:
                break
            if start > cursor:
                result.add_range(cursor, start)
            cursor = max(cursor, stop)
        if cursor < universe_stop:
            result.add_range(cursor, universe_stop)
        return result


class IndexedRanges:
    """Random access to the sorted members of a :class:`RangeSet` without materializing them.

    ``IndexedRanges(s)[i]`` is the i-th smallest member of ``s`` in O(log ranges), so dealing the
    remaining batches of a huge job round-robin over ranks costs no memory per batch.
    """

    def __init__(self, ranges: RangeSet) -> None:
        self._starts: list[int] = []
        self._offsets: list[int] = []  # number of members before each range
        total = 0
        for start, stop in ranges.ranges():
            self._starts.append(start)
            self._offsets.append(total)
            total += stop - start
        self._len = total

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self._len:
            raise IndexError(index)
        i = bisect.bisect_right(self._offsets, index) - 1
        return self._starts[i] + (index - self._offsets[i])
