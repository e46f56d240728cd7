"""A rank's committed stages waiting for publication, in vote order.

A stage may be published once a durable record covers it (see :mod:`torch_batch_process.engine.commit.committer`).
Only the stages not yet published are kept: a long job commits hundreds of thousands of times, and looking up
the stages a record covers must cost the same at its last commit as at its first.
"""

from __future__ import annotations

import bisect
from collections import deque

__all__ = ["VotedStages"]


class VotedStages:
    """This rank's voted stages (``stage``, whether it has files), in order; stage numbers increase."""

    def __init__(self) -> None:
        self._waiting: deque[tuple[int, bool]] = deque()  # voted, not published yet
        self._taken = 0  # votes published (or being published): they are no longer kept

    def append(self, stage: int, has_files: bool) -> None:
        """Adds the stage of a vote this rank sent (its commit is complete)."""
        self._waiting.append((stage, has_files))

    def __len__(self) -> int:
        """Every vote added so far, published or not."""
        return self._taken + len(self._waiting)

    def covered(self, durable: int) -> int:
        """How many votes have a stage up to ``durable`` (the stage number of the newest durable record)."""
        return self._taken + bisect.bisect_right(self._waiting, durable, key=lambda voted: voted[0])

    def take(self, count: int) -> list[int]:
        """Marks the first ``count`` votes published; returns the stages with files among those not taken before."""
        stages = []
        while self._taken < count and self._waiting:
            stage, has_files = self._waiting.popleft()
            self._taken += 1
            if has_files:
                stages.append(stage)
        return stages
