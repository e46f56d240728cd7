"""Gathered votes (``schedule="static"``; one process too): every rank votes at the same step.

The ranks exchange their votes with one asynchronous ``all_gather`` on the library's gloo group, started at the
commit's step boundary and completed at the next one, so that its latency overlaps with a step of work (one
process: at once). Rank 0 then merges the votes into the next record and queues it for its record writer thread,
which writes the records that wait as one group commit (:mod:`~torch_batch_process.engine.commit.group_commit`);
its next vote tells every rank the newest durable record, and each rank publishes the stages that record covers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch_batch_process.engine.commit.group_commit import GroupCommit
from torch_batch_process.engine.commit.keeper import RecordKeeper
from torch_batch_process.engine.commit.votes import Vote, VoteTransport
from torch_batch_process.engine.distributed import Collectives, PendingGather

if TYPE_CHECKING:
    from torch_batch_process.engine.commit.publisher import Publisher

__all__ = ["GatheredVotes"]

logger = logging.getLogger(__name__)


class GatheredVotes(VoteTransport):
    """Votes exchanged with an asynchronous ``all_gather`` (see the module docstring).

    Args:
        collectives: the library's collectives.
        keeper: rank 0's record keeper (``None`` elsewhere): its records are written by a thread of their own.
    """

    every_rank_votes = True

    def __init__(self, collectives: Collectives, keeper: RecordKeeper | None) -> None:
        self._collectives = collectives
        self._keeper = keeper
        self._writes = GroupCommit(keeper) if keeper is not None else None  # rank 0
        self._pending: PendingGather | None = None

    def next_stage(self, stage: int) -> int:
        return stage + 1  # every rank commits at the same step: stage numbers are commit numbers

    def stamp(self, vote: Vote) -> None:
        if self._writes is not None:
            vote.durable = self._writes.durable

    def send(self, vote: Vote) -> bool:
        self._pending = self._collectives.start_all_gather(vote)
        return self._collectives.world_size == 1  # nothing to wait for: the record goes to the writer now

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def arrived(self) -> list[Vote] | None:
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        votes: list[Vote] = pending.wait()
        return votes

    def durable_votes(self, newest_durable: int, published: Publisher) -> int:
        return published.covered(newest_durable)

    def record(self, votes: list[Vote]) -> dict[str, Any] | None:
        if self._keeper is None or self._writes is None:
            return None
        prepared = self._keeper.prepare(self._keeper.merge(votes))
        self._writes.put(prepared)
        return prepared.metrics

    def drain(self, votes: list[Vote]) -> None:
        if self._writes is not None:
            self._writes.settle()  # the record writes queued so far

    def written(self, number: int) -> None:
        if self._writes is not None:
            self._writes.durable = number

    def stop_for_failure(self, failed_here: bool) -> None:
        if self._writes is None:
            return
        self._writes.settle(check=False)  # a failed write has ended too: its records are simply not durable
        if self._writes.error is not None and not failed_here:  # else it is what rank 0 raises
            logger.warning("rank 0: writing a commit record failed: %s", self._writes.error)

    def newest_durable(self) -> int:
        return self._writes.newest_durable() if self._writes is not None else -1

    def check(self) -> None:
        if self._writes is not None:
            self._writes.advance()

    def close(self) -> None:
        if self._writes is not None:
            self._writes.close()
