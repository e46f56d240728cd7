"""The publisher: moves a rank's committed stages into ``outputs/`` once a durable record covers them.

A stage may be published only once the commit record that covers it is durable (the rule of
:mod:`torch_batch_process.engine.commit.committer`); the committer says how many of this rank's votes are covered, the
publisher moves their stages, in vote order: on a background thread on object stores (a move is a copy per
object), on the caller's thread on local storage (one rename per stage, cheaper than handing it to a thread,
see :mod:`torch_batch_process.engine.commit.background`). A failed publication is raised by :meth:`Publisher.check`
or :meth:`Publisher.settle`, so it travels in the rank's next vote like any other error.

Only the stages not yet published are kept (:class:`VotedStages`): a long job commits hundreds of thousands of
times, and looking up the stages a record covers must cost the same at its last commit as at its first.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable

from torch_batch_process.engine.commit.background import BackgroundWork
from torch_batch_process.jobstore.store import JobStore

__all__ = ["Publisher", "VotedStages"]

logger = logging.getLogger(__name__)


class Publisher:
    """This rank's voted stages and their publication.

    Args:
        store: the job's stored state (its ``publish`` moves one stage).
        rank: this rank.
        sole: this rank is the job's only one (a stage's folder then moves whole, with one rename).
        on_published: told each stage once it is published (record segments its shard holds are then deleted).
    """

    def __init__(
        self, store: JobStore, rank: int, *, sole: bool, on_published: Callable[[int], None] | None = None
    ) -> None:
        self._on_published = on_published
        self._store = store
        self._rank = rank
        self._sole = sole
        self._background = BackgroundWork(inline=store.storage.moves_are_renames)  # publications, in order
        self._voted = VotedStages()  # this rank's committed votes whose stages are not published yet
        self._with_failures: set[int] = set()  # stages with failure records (on_error="skip")

    def mark_failures(self, stage: int) -> None:
        """Notes that ``stage`` holds failure records (else its publication does not look for any)."""
        self._with_failures.add(stage)

    def voted(self, stage: int, has_files: bool) -> None:
        """Adds the stage of a vote whose commit is complete (its record may not be durable yet)."""
        self._voted.append(stage, has_files)

    def __len__(self) -> int:
        """Every vote added so far, published or not."""
        return len(self._voted)

    def covered(self, durable: int) -> int:
        """How many of this rank's votes the record of stage ``durable`` covers."""
        return self._voted.covered(durable)

    def publish(self, count: int, *, wait: bool = False) -> None:
        """Publishes the stages of this rank's first ``count`` votes (those not published yet); waits for every
        publication only with ``wait``."""
        stages = self._voted.take(count)
        if stages:
            what = f"publishing the outputs of stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
            failures = [stage in self._with_failures for stage in stages]
            self._with_failures.difference_update(stages)
            self._background.submit(what, self._publish_stages, stages, failures)
        if wait:
            self._background.settle()

    def publish_committed(self, count: int) -> None:
        """When the job fails: publishes the first ``count`` votes' stages and waits; a failure is logged and
        left to the next start's repair."""
        try:
            self.publish(count, wait=True)
        except Exception as exc:  # noqa: BLE001
            logger.warning("rank %d: publishing committed outputs failed (the next start will): %s", self._rank, exc)

    def check(self) -> None:
        """Raises the error of a publication that has failed (never waits)."""
        self._background.check()

    def settle(self) -> None:
        """Waits for every publication; raises the first error."""
        self._background.settle()

    def close(self) -> None:
        """Lets queued publications finish (when the call ends)."""
        self._background.close()

    def _publish_stages(self, stages: list[int], failures: list[bool]) -> None:
        for stage, with_failures in zip(stages, failures, strict=True):
            self._store.publish(stage, self._rank, sole=self._sole, failures=with_failures)
            if self._on_published is not None:
                self._on_published(stage)


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
