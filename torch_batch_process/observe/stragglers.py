"""Straggler detection on rank 0, from what the ranks already send with each commit.

Every rank's commit vote carries the batches, examples and seconds (loading data, in
``process_batch``) of its interval, so rank 0 gets every rank's *busy* rate (examples per second of
its own work, waiting for the others excluded) for free. Since every rank runs the same number of
steps, the job goes at the pace of its slowest rank; a rank whose busy rate is markedly below the
median of the others (``ratio``, default 0.5) is named in a warning.

To be meaningful, intervals are accumulated into a window until every rank that worked has done
``min_batches`` batches and the busiest has worked ``min_busy_s`` seconds; then the window is judged
and started again. A rank is named at most once every ``repeat_s`` seconds.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class RankInterval:
    """What one rank did between two commits (taken from its vote)."""

    batches: int
    examples: int
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def busy_s(self) -> float:
        return self.timings.get("data", 0.0) + self.timings.get("process", 0.0)


@dataclass
class Straggler:
    """A rank found markedly slower than the others."""

    rank: int
    rate: float
    median_others: float
    batches: int
    data_s: float
    process_s: float

    def describe(self) -> str:
        return (
            f"rank {self.rank} is a straggler: {self.rate:.1f} examples/s over its last {self.batches} batches, "
            f"{self.rate / self.median_others:.2f}x the median of the other ranks ({self.median_others:.1f} "
            f"examples/s); it spent {self.data_s:.2f} s loading data and {self.process_s:.2f} s in process_batch. "
            "Every rank waits for it at each step."
        )


class StragglerDetector:
    """Accumulates the ranks' intervals and names a rank that is markedly slower than the others."""

    def __init__(
        self, ratio: float = 0.5, *, min_batches: int = 4, min_busy_s: float = 1.0, repeat_s: float = 300.0
    ) -> None:
        self.ratio = ratio
        self.min_batches = min_batches
        self.min_busy_s = min_busy_s
        self.repeat_s = repeat_s
        self._batches: list[int] = []
        self._examples: list[int] = []
        self._data: list[float] = []
        self._process: list[float] = []
        self._last_named: dict[int, float] = {}

    def add(self, intervals: list[RankInterval]) -> Straggler | None:
        """Adds one commit's intervals; returns a straggler when the window is judged and has one."""
        size = len(intervals)
        if size < 2:
            return None
        if len(self._batches) != size:
            self._reset(size)
        batches, examples, data, process = self._batches, self._examples, self._data, self._process
        for rank, new in enumerate(intervals):
            if new.batches:
                timings = new.timings
                batches[rank] += new.batches
                examples[rank] += new.examples
                data[rank] += timings.get("data", 0.0)
                process[rank] += timings.get("process", 0.0)
        working = [rank for rank in range(size) if batches[rank]]
        if len(working) < 2 or min(batches[rank] for rank in working) < self.min_batches:
            return None
        if max(data[rank] + process[rank] for rank in working) < self.min_busy_s:
            return None
        window = [
            (rank, RankInterval(batches[rank], examples[rank], {"data": data[rank], "process": process[rank]}))
            for rank in working
        ]
        self._reset(size)
        found = self.judge(window)
        if found is None:
            return None
        now = time.monotonic()
        last = self._last_named.get(found.rank)
        if last is not None and now - last < self.repeat_s:
            return None
        self._last_named[found.rank] = now
        return found

    def _reset(self, size: int) -> None:
        self._batches = [0] * size
        self._examples = [0] * size
        self._data = [0.0] * size
        self._process = [0.0] * size

    def judge(self, working: list[tuple[int, RankInterval]]) -> Straggler | None:
        """The slowest rank of ``working`` if its rate is below ``ratio`` times the median of the others."""
        rates = {rank: (acc.examples / acc.busy_s if acc.busy_s > 0 else float("inf")) for rank, acc in working}
        slowest = min(rates, key=rates.__getitem__)
        others = [rate for rank, rate in rates.items() if rank != slowest]
        median = statistics.median(others)
        if not (median > 0 and rates[slowest] < self.ratio * median) or median == float("inf"):
            return None
        acc = dict(working)[slowest]
        return Straggler(
            rank=slowest,
            rate=rates[slowest],
            median_others=median,
            batches=acc.batches,
            data_s=acc.timings.get("data", 0.0),
            process_s=acc.timings.get("process", 0.0),
        )
