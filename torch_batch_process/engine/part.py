"""What one rank did since its previous commit: the part of the job its next vote carries."""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

from torch_batch_process.engine.ranges import RangeSet
from torch_batch_process.observe.histogram import EDGES, FLOOR_BIN

__all__ = ["Part"]

_bisect = bisect.bisect_right


class Part:
    """What this rank did since its previous commit: batches, examples, metrics lines, seconds per phase, and the
    histogram of its batches' ``process_batch`` seconds (see :mod:`torch_batch_process.observe.histogram`)."""

    def __init__(self) -> None:
        self.batches = RangeSet()
        self.examples = 0
        self.failed = 0  # examples skipped as failed (on_error="skip"), recorded in the stage
        self.lines: list[dict[str, Any]] = []
        self.timings = {"data": 0.0, "process": 0.0, "commit": 0.0, "hooks": 0.0}
        self.batch_times: defaultdict[int, int] = defaultdict(int)

    def add_batch(self, batch: int, examples: int, seconds: float | None = None) -> None:
        """A batch done; ``seconds``: its ``process_batch`` time, when it ran whole (counted in ``batch_times``)."""
        self.batches.add(batch)
        self.examples += examples
        if seconds is not None:  # histogram.add_seconds inlined (this runs once per batch): one C call
            self.batch_times[_bisect(EDGES, seconds) + FLOOR_BIN] += 1

    @property
    def num_batches(self) -> int:
        return len(self.batches)
