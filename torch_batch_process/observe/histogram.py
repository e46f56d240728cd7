"""Log-binned histograms of durations: how per-batch and per-commit times are kept, in a few bytes.

A duration of ``s`` seconds falls in bin ``floor(log2(s) * BINS_PER_OCTAVE)``: bin ``b`` holds the durations in
``[2 ** (b / 4), 2 ** ((b + 1) / 4))`` seconds, so a bin is 19% wide whatever the scale (a microsecond or an
hour), and any quantile read back from a histogram is within 19% of the exact one. Durations under
:data:`FLOOR_S` (about a microsecond) share the lowest bin. A histogram is a dict ``{bin: count}`` holding only the
bins that were hit: the batches of a rank between two commits rarely spread over more than a few octaves, so
a histogram stays at about ten entries however many batches it counts. In JSON it is a list: its lowest bin,
then the counts of every bin from there to its highest (``[-22, 40, 0, 3]`` is ``{-22: 40, -20: 3}``), about
four bytes a bin.

Adding one duration is one binary search in :data:`EDGES` (a C call, about 8 comparisons) and a dict update:
cheap enough to run once per batch (see :class:`~torch_batch_process.engine.commit.votes.Part`). Durations of
:data:`TOP_S` (11.6 days) or more share the highest bin.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "BINS_PER_OCTAVE",
    "EDGES",
    "FLOOR_BIN",
    "FLOOR_S",
    "TOP_S",
    "add_seconds",
    "bin_bounds",
    "bin_of",
    "from_json",
    "merged",
    "merge_into",
    "quantile",
    "to_json",
    "total",
    "TOP_BIN",
]

BINS_PER_OCTAVE = 4
"""Bins per doubling of the duration (each bin is ``2 ** (1/4)``, about 1.19, times wider than the last)."""

FLOOR_BIN = -20 * BINS_PER_OCTAVE
"""The lowest bin: every duration under :data:`FLOOR_S`."""

FLOOR_S = 2.0 ** ((FLOOR_BIN + 1) / BINS_PER_OCTAVE)
"""Durations below this (about a microsecond) count in :data:`FLOOR_BIN`."""

TOP_BIN = 20 * BINS_PER_OCTAVE
TOP_S = 2.0 ** (TOP_BIN / BINS_PER_OCTAVE)

EDGES = [2.0 ** (key / BINS_PER_OCTAVE) for key in range(FLOOR_BIN + 1, TOP_BIN + 1)]
"""The bins' lower bounds from bin ``FLOOR_BIN + 1`` up: a duration's bin is ``FLOOR_BIN`` plus the number of
edges at or below it (:func:`bisect.bisect_right`)."""

_bisect = bisect.bisect_right


def bin_of(seconds: float) -> int:
    """The bin of a duration."""
    return _bisect(EDGES, seconds) + FLOOR_BIN


def add_seconds(histogram: dict[int, int], seconds: float) -> None:
    """Counts one duration in ``histogram`` (in place)."""
    key = _bisect(EDGES, seconds) + FLOOR_BIN
    histogram[key] = histogram.get(key, 0) + 1


def bin_bounds(key: int) -> tuple[float, float]:
    """The seconds ``[low, high)`` of bin ``key``."""
    return 2.0 ** (key / BINS_PER_OCTAVE), 2.0 ** ((key + 1) / BINS_PER_OCTAVE)


def merge_into(target: dict[int, int], other: Mapping[int, int]) -> None:
    """Adds ``other``'s counts to ``target`` (in place)."""
    for key, count in other.items():
        target[key] = target.get(key, 0) + count


def total(histogram: Mapping[int, int]) -> int:
    """The number of durations counted."""
    return sum(histogram.values())


def quantile(histogram: Mapping[int, int], q: float) -> float | None:
    """The ``q`` quantile (``0 <= q <= 1``) of the counted durations, within a bin's width: the geometric middle of
    the bin that holds it; ``None`` for an empty histogram."""
    count = total(histogram)
    if count == 0:
        return None
    rank = q * (count - 1)
    seen = 0
    for key in sorted(histogram):
        seen += histogram[key]
        if seen > rank:
            low, high = bin_bounds(key)
            return math.sqrt(low * high)
    low, high = bin_bounds(max(histogram))  # pragma: no cover - q == 1 ends in the loop
    return math.sqrt(low * high)


def to_json(histogram: Mapping[int, int]) -> list[int]:
    """The histogram as a JSON list: its lowest bin, then the counts from there to its highest bin (``[]``: empty)."""
    hit = [key for key, count in histogram.items() if count]
    if not hit:
        return []
    low, high = min(hit), max(hit)
    return [low, *(histogram.get(key, 0) for key in range(low, high + 1))]


def from_json(value: Any) -> dict[int, int]:
    """A histogram read back from JSON (the list of :func:`to_json`, or an object of bin -> count); an unreadable
    value gives an empty one."""
    result: dict[int, int] = {}
    try:
        if isinstance(value, list) and value:
            low = int(value[0])
            for offset, count in enumerate(value[1:]):
                if count:
                    result[low + offset] = int(count)
        elif isinstance(value, Mapping):
            for key, count in value.items():
                result[int(key)] = result.get(int(key), 0) + int(count)
    except (TypeError, ValueError):
        return {}
    return result


def merged(histograms: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """The sum of several histograms."""
    result: dict[int, int] = {}
    for histogram in histograms:
        merge_into(result, histogram)
    return result
