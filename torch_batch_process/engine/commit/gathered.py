"""Gathered votes (``schedule="static"``; one process too): every rank votes at the same step.

The votes go to rank 0, and what every rank needs back (did a rank fail or ask to stop, which records are durable,
how far the job is: :class:`~torch_batch_process.engine.commit.votes.CommitFlags`, each the MAX of the ranks'
contributions) goes to every rank, with one asynchronous collective on the library's gloo group
(:class:`~torch_batch_process.engine.distributed.PendingExchange`: each rank's flags and pickled vote in one
fixed-size buffer, all-gathered; a gather and a MAX ``all_reduce`` took two, each a gloo op's fixed ~0.3 ms of CPU
per rank). It starts at the commit's step boundary and completes at the next one, so that its latency overlaps with
a step of work (one process: at once). Only rank 0 unpickles the W votes (O(W) for rank 0; every other rank reads
the flags alone: an ``all_gather_object`` of the votes made it O(W) on every rank, at 32 ranks 4.6 ms of CPU per rank
and commit). Rank 0 then merges the votes into the next record and queues it for its record writer thread, which writes
the records that wait as one group commit (:mod:`~torch_batch_process.engine.commit.group_commit`; one process: the
writer also prepares them, off the batch's path); its next commit's flags tell every rank the newest durable record,
and each rank publishes the stages that record covers.

What rank 0's participants share (memory limits, ``on_oom="split"``): when the votes rank 0 merged taught them
something every rank must learn (:meth:`GatheredVotes.news`), rank 0 says so in its next commit's flags and every
rank takes it from rank 0 in one ``broadcast`` at that step boundary (the committer's).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch_batch_process.engine.commit.group_commit import GroupCommit
from torch_batch_process.engine.commit.keeper import RecordKeeper
from torch_batch_process.engine.commit.payloads import Payloads
from torch_batch_process.engine.commit.transport import VoteTransport
from torch_batch_process.engine.commit.votes import Arrival, CommitFlags, Vote
from torch_batch_process.engine.distributed import Collectives, PendingExchange

if TYPE_CHECKING:
    from torch_batch_process.engine.commit.publisher import Publisher

__all__ = ["GatheredVotes", "PendingVotes"]

logger = logging.getLogger(__name__)


class PendingVotes:
    """A commit's exchange in flight: one collective carries every rank's flags to every rank and its vote to rank 0
    (:class:`~torch_batch_process.engine.distributed.PendingExchange`)."""

    def __init__(self, collectives: Collectives, vote: Vote, counts: tuple[int, int], shared: bool = False) -> None:
        self._collectives = collectives
        self._vote = vote
        # each rank's contribution to the flags (CommitFlags' fields but overflow, which the exchange tells)
        header = [int(vote.preempt), int(vote.failure is not None), vote.durable, *counts, int(shared)]
        self._exchange: PendingExchange = collectives.start_exchange(header, vote)

    def wait(self) -> tuple[list[Vote], CommitFlags]:
        """Rank 0: every rank's vote; the others: their own. And the commit's flags, the same on every rank."""
        got = self._exchange.wait()  # a lost rank fails it on every rank
        preempt, failed, durable, batches, examples, shared = (max(column) for column in zip(*got.headers, strict=True))
        flags = CommitFlags(bool(preempt), bool(failed), got.overflow, durable, batches, examples, shared)
        votes = got.objects
        if flags.overflow:  # every rank knows: all gather again, without the buffer's limit
            logger.debug("a vote did not fit the exchange's buffer: the votes are gathered again")
            votes = self._collectives.gather(self._vote)
        if self._collectives.rank != 0:
            return [self._vote], flags
        assert votes is not None and all(vote is not None for vote in votes)
        return votes, flags


class GatheredVotes(VoteTransport):
    """Votes gathered on rank 0 with the commit's flags, asynchronously (see the module docstring).

    Args:
        collectives: the library's collectives.
        keeper: rank 0's record keeper (``None`` elsewhere): its records are written by a thread of their own.
        first_stage: the stage of this attempt's first commit (the same on every rank).
    """

    every_rank_votes = True

    def __init__(self, collectives: Collectives, keeper: RecordKeeper | None, first_stage: int) -> None:
        self._collectives = collectives
        self.keeper = self._keeper = keeper
        self.first_stage = first_stage
        self._writes = GroupCommit(keeper) if keeper is not None else None  # rank 0
        self._sole = collectives.world_size == 1  # the writer prepares the records too (see group_commit)
        self._pending: PendingVotes | None = None

    def next_stage(self, stage: int) -> int:
        return stage + 1  # every rank commits at the same step: stage numbers are commit numbers

    def stamp(self, vote: Vote) -> None:
        if self._writes is not None:
            vote.durable = self._writes.durable

    def send(self, vote: Vote, *, news: bool = False) -> bool:
        # rank 0's, for the other ranks' progress (one process: none to tell)
        counts = self._keeper.committed_counts() if self._keeper is not None and not self._sole else (0, 0)
        self._pending = PendingVotes(self._collectives, vote, counts, news)
        return self._collectives.world_size == 1  # nothing to wait for: the record goes to the writer now

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def arrived(self) -> Arrival | None:
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        votes, flags = pending.wait()  # rank 0: every rank's vote; the others: their own
        return Arrival(votes, flags)

    def committed_counts(self, arrival: Arrival) -> tuple[int, int]:
        if self._keeper is not None:
            return self._keeper.committed_counts()
        return arrival.flags.batches_committed, arrival.flags.examples_committed

    def durable_votes(self, newest_durable: int, published: Publisher) -> int:
        return published.covered(newest_durable)

    def record(self, votes: list[Vote]) -> dict[str, Any] | None:
        if self._keeper is None or self._writes is None:
            return None
        lines = self._keeper.merge(votes)  # refuses the votes here (SchemaConflictError), as with several processes
        if self._sole:  # one process: the record is prepared off the batch's path, by the writer
            self._writes.put_merged(lines)
            return self._writes.take_metrics()  # metrics so far, of a record prepared since the last commit
        prepared = self._keeper.prepare(lines)
        self._writes.put(prepared)
        return prepared.metrics

    def news(self) -> Payloads | None:
        if self._keeper is None:
            return None
        shared = self._keeper.share()
        return shared if len(shared) else None

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
