"""What one rank did since its previous commit: the part of the job its next vote carries."""

from __future__ import annotations

from typing import Any

from torch_batch_process.jobstore.ranges import RangeSet

__all__ = ["Part"]


class Part:
    """What this rank did since its previous commit: batches, examples, metrics lines, seconds per phase."""

    def __init__(self) -> None:
        self.batches = RangeSet()
        self.examples = 0
        self.failed = 0  # examples skipped as failed (on_error="skip"), recorded in the stage
        self.lines: list[dict[str, Any]] = []
        self.timings = {"data": 0.0, "process": 0.0, "commit": 0.0, "hooks": 0.0}

    def add_batch(self, batch: int, examples: int) -> None:
        self.batches.add(batch)
        self.examples += examples

    @property
    def num_batches(self) -> int:
        return len(self.batches)
