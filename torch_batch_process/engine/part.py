"""What one rank did since its previous commit: the part of the job its next vote carries."""

from __future__ import annotations

import math
from typing import Any

from torch_batch_process.engine.ranges import RangeSet
from torch_batch_process.observe.histogram import BINS_PER_OCTAVE, FLOOR_BIN, FLOOR_S

__all__ = ["Part"]

_log2 = math.log2
_floor = math.floor
assert (BINS_PER_OCTAVE, FLOOR_S, FLOOR_BIN) == (4, 9.5367431640625e-07, -80), "Part.add_batch inlines these"


class Part:
    """What this rank did since its previous commit: batches, examples, metrics lines, seconds per phase, and the
    histogram of its batches' ``process_batch`` seconds (see :mod:`torch_batch_process.observe.histogram`)."""

    def __init__(self) -> None:
        self.batches = RangeSet()
        self.examples = 0
        self.failed = 0  # examples skipped as failed (on_error="skip"), recorded in the stage
        self.lines: list[dict[str, Any]] = []
        self.timings = {"data": 0.0, "process": 0.0, "commit": 0.0, "hooks": 0.0}
        self.batch_times: dict[int, int] = {}

    def add_batch(self, batch: int, examples: int, seconds: float | None = None) -> None:
        """A batch done; ``seconds``: its ``process_batch`` time, when it ran whole (counted in ``batch_times``)."""
        self.batches.add(batch)
        self.examples += examples
        if seconds is not None:  # histogram.add_seconds inlined, with its constants: this runs once per batch
            key = _floor(_log2(seconds) * 4) if seconds >= 9.5367431640625e-07 else -80
            times = self.batch_times
            times[key] = times.get(key, 0) + 1

    @property
    def num_batches(self) -> int:
        return len(self.batches)
