"""A rank's work since its previous commit: the :class:`Part` its next vote carries, kept by :class:`RankWork`.

The loop, the runner and the context add to the current part (a batch done, the seconds of a phase, a metrics
line); the committer takes it for the rank's vote (:meth:`RankWork.take`) and a new part starts. Everyone holds the
:class:`RankWork`, never a part: no one reaches into the committer for it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import TypedDict

from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.metrics_lines import MetricsLine
from torch_batch_process.observe.histogram import EDGES, FLOOR_BIN

__all__ = ["Part", "PhaseSeconds", "RankWork"]

_bisect = bisect.bisect_right


class PhaseSeconds(TypedDict):
    """Seconds a rank spent per phase since its previous commit."""

    data: float
    """Waiting for batches (loading, or the loader's workers)."""
    process: float
    """In ``process_batch``."""
    commit: float
    """Committing (votes, state files, publication)."""
    hooks: float
    """In the processor's other hooks (``__init__``, ``on_checkpoint_start``, ``on_finish``)."""


class Part:
    """What this rank did since its previous commit: batches, examples, metrics lines, seconds per phase, and the
    histogram of its batches' ``process_batch`` seconds (see :mod:`torch_batch_process.observe.histogram`)."""

    __slots__ = ("batch_times", "batches", "counts", "examples", "lines", "timings")

    def __init__(self, counts: bool = True) -> None:
        self.counts = counts
        """Whether its batches count (``mesh=``: a replica's writer; the other members vote only control)."""
        self.batches = RangeSet()
        self.examples = 0
        self.lines: list[MetricsLine] = []
        self.timings: PhaseSeconds = {"data": 0.0, "process": 0.0, "commit": 0.0, "hooks": 0.0}
        self.batch_times: defaultdict[int, int] = defaultdict(int)

    def add_batch(self, batch: int, examples: int, seconds: float | None = None) -> None:
        """A batch done; ``seconds``: its ``process_batch`` time, when it ran whole (counted in ``batch_times``)."""
        if not self.counts:
            return
        self.batches.add(batch)
        self.examples += examples
        if seconds is not None:  # histogram.add_seconds inlined (this runs once per batch): one C call
            self.batch_times[_bisect(EDGES, seconds) + FLOOR_BIN] += 1

    @property
    def num_batches(self) -> int:
        return len(self.batches)


class RankWork:
    """This rank's current :class:`Part`, replaced by a new one each time the committer takes it for a vote."""

    __slots__ = ("counts", "part")

    def __init__(self, counts: bool = True) -> None:
        self.counts = counts
        """Whether this rank's batches count (``mesh=``: only a replica's writer's do, so each counts once)."""
        self.part = Part(counts)

    def take(self) -> Part:
        """The part done so far (for this rank's vote); a new one starts."""
        part, self.part = self.part, Part(self.counts)
        return part

    def add_line(self, line: MetricsLine) -> None:
        """A ``metrics.jsonl`` line of this rank (``report_metrics()``, provenance), committed with its next vote."""
        self.part.lines.append(line)

    def add_hook_seconds(self, seconds: float) -> None:
        """Seconds spent in one of the processor's hooks other than ``process_batch``."""
        self.part.timings["hooks"] += seconds
