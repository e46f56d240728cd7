"""Votes: one rank's part of a commit, and how votes travel to rank 0.

- :class:`GatheredVotes` (``schedule="static"``, and every closing commit): the ranks commit at the same
  step. Their votes go to rank 0 with one ``gather`` on the library's gloo group, and what every rank needs
  back (did a rank fail or ask to stop, which records are durable, how far the job is) travels in one small
  MAX ``all_reduce`` of :class:`CommitFlags` started with it; both start at the commit's step boundary and
  complete at the next one, so that their latency overlaps with a step of work. Only rank 0 receives and
  unpickles the W votes (O(W) for rank 0, O(1) for every other rank; an ``all_gather`` of the votes made it
  O(W) on every rank: at 32 ranks, 4.6 ms of CPU per rank and commit). Closing commits exchange the votes
  with a synchronous ``all_gather``.
- :class:`QueuedVotes` (``schedule="dynamic"``): each rank commits on its own; its vote goes into a queue in
  the job's rendezvous store and rank 0 takes it from there on a thread of its own. When a record covering a
  rank's votes is durable, rank 0 raises that rank's acknowledgement counter in the store; the rank reads it
  (one request) at its next commit and publishes its stages.

What a rank learned about the device's memory (``on_oom="split"``, DESIGN §15) travels in its votes too: with
gathered votes every rank reads every other rank's; with queued votes rank 0 merges them and shares the result
in the store (a version counter, read with one request at each commit, and the limits, read when it moved).
"""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.engine.agreement import FailureInfo
from torch_batch_process.engine.distributed import Collectives, PendingGather, PendingMax
from torch_batch_process.engine.rendezvous import RendezvousStore

__all__ = ["CommitFlags", "GatheredVotes", "PendingVotes", "QueuedVotes", "Vote"]

logger = logging.getLogger(__name__)


@dataclass
class Vote:
    """One rank's contribution to a commit."""

    rank: int
    stage: int
    """The stage its files and state went into (see :mod:`torch_batch_process.storage.layout`)."""
    has_files: bool
    """Its stage holds files (outputs or failure records): it is published."""
    batches: list[list[int]]
    """Global batches completed since its previous commit (ranges)."""
    examples: int
    state_file: str | None
    lines: list[dict[str, Any]]
    """``report_metrics()`` records and provenance entries."""
    timings: dict[str, float]
    failure: FailureInfo | None = None
    preempt: bool = False
    slots: list[Any] | None = None
    """Closing votes: the reducers' summaries (rank 0 reduces without reading state files)."""
    durable: int = -1
    """Static schedule, rank 0: every record up to this number is durable (stages up to it may be published)."""
    queued: int = 0
    """Dynamic schedule, closing vote: how many votes this rank queued before it (rank 0 takes them all first)."""
    extra: dict[str, Any] = field(default_factory=dict)
    outputs: bool = False
    """Its stage holds output files (``outputs/commit_<stage>/`` once published; see ``CommitRecord.output_stages``)."""
    limits: dict[str, Any] | None = None
    """What the rank learned about the device's memory since its previous vote (the JSON form of
    :class:`~torch_batch_process.engine.memory_limits.MemoryLimits`, ``on_oom="split"``), or ``None``."""
    schema: Any = None
    """The rank's record schema (:class:`~torch_batch_process.outputs.schema.RecordSchema`) when it changed since
    the rank's previous vote (``None``: unchanged, or no rows yet): rank 0 commits no stage whose rows do not
    unify with the job's."""


@dataclass
class CommitFlags:
    """What every rank learns of a static commit (the MAX over the ranks' contributions)."""

    preempt: bool
    """Some rank asked to stop."""
    failed: bool
    """Some rank's vote carries a failure (the failures themselves are then gathered by every rank)."""
    overflow: bool
    """Some rank's vote did not fit the gather's buffer (the votes are then gathered again)."""
    durable: int
    """Rank 0's newest durable record (stages up to it may be published)."""
    batches_committed: int
    """Batches committed as rank 0 knew when it voted (the commit before this one), for progress."""
    examples_committed: int
    limits: int = 0
    """Rank 0 holds memory limits (``on_oom="split"``) that the other ranks have not been sent: every rank then
    takes them in one ``broadcast`` at this step boundary (changes are rare: a handful per job)."""


class PendingVotes:
    """A static commit's exchange in flight: the votes' gather to rank 0 and the flags' ``all_reduce``."""

    def __init__(self, collectives: Collectives, vote: Vote, counts: tuple[int, int], limits: bool = False) -> None:
        self._collectives = collectives
        self._vote = vote
        self._gather: PendingGather = collectives.start_gather(vote)
        flags = [
            int(vote.preempt), int(vote.failure is not None), int(self._gather.overflowed), vote.durable, *counts,
            int(limits),
        ]
        self._flags: PendingMax = collectives.start_max(flags)

    def wait(self) -> tuple[list[Vote], CommitFlags]:
        """Rank 0: every rank's vote; the others: their own. And the commit's flags, the same on every rank."""
        votes = self._gather.wait()
        values = self._flags.wait()
        flags = CommitFlags(*(bool(v) for v in values[:3]), *values[3:])
        if flags.overflow:  # every rank knows: all gather again, without the buffer's limit
            logger.debug("a vote did not fit the gather buffer: the votes are gathered again")
            votes = self._collectives.gather(self._vote)
        if self._collectives.rank != 0:
            return [self._vote], flags
        assert votes is not None and all(vote is not None for vote in votes)
        return votes, flags


class GatheredVotes:
    """Votes exchanged by collectives (every rank votes at the same step; see the module docstring)."""

    def __init__(self, collectives: Collectives) -> None:
        self._collectives = collectives

    def start(self, vote: Vote, counts: tuple[int, int] = (0, 0), limits: bool = False) -> PendingVotes:
        """Starts a commit's exchange (``counts``: rank 0's committed batches and examples, for progress;
        ``limits``: rank 0 has memory limits to send, see :attr:`CommitFlags.limits`)."""
        return PendingVotes(self._collectives, vote, counts, limits)

    def gather(self, vote: Any) -> list[Any]:
        """A synchronous exchange in which every rank gets every vote (closing commits)."""
        return self._collectives.all_gather(vote)


class QueuedVotes:
    """Votes queued in the rendezvous store, taken by rank 0 (see the module docstring).

    Args:
        store: the job's prefixed store (a ``torch.distributed.Store``).
        rank: this rank.
    """

    QUEUE = "votes"
    STOP = b"stop"

    LIMITS = "limits"

    def __init__(self, store: RendezvousStore, rank: int) -> None:
        self.store = store
        self._rank = rank
        self.queued = 0
        self._limits_seen = 0

    def push(self, vote: Vote) -> None:
        self.store.queue_push(self.QUEUE, pickle.dumps(vote, protocol=pickle.HIGHEST_PROTOCOL))
        self.queued += 1

    def acknowledged(self) -> int:
        """How many of this rank's votes rank 0 has made durable."""
        return int(self.store.add(f"ack/{self._rank}", 0))

    @staticmethod
    def acknowledge(reader: RendezvousStore, rank: int, count: int) -> None:
        """Rank 0's collector thread: ``count`` more votes of ``rank`` are durable."""
        reader.add(f"ack/{rank}", count)

    def shared_limits(self) -> dict[str, Any] | None:
        """The job's memory limits as rank 0 merged them, when they changed since this rank last read them."""
        version = self.store.add(f"{self.LIMITS}/version", 0)
        if version <= self._limits_seen:
            return None
        self._limits_seen = version
        return json.loads(self.store.get(self.LIMITS))

    @staticmethod
    def share_limits(writer: RendezvousStore, limits: dict[str, Any]) -> None:
        """Rank 0's collector thread: the job's merged memory limits changed (see :meth:`shared_limits`)."""
        writer.set(QueuedVotes.LIMITS, json.dumps(limits).encode())
        writer.add(f"{QueuedVotes.LIMITS}/version", 1)

    def wake(self) -> None:
        """Rank 0: unblocks its collector, waiting for a vote (:meth:`take` then returns ``None``)."""
        self.store.queue_push(self.QUEUE, self.STOP)

    @staticmethod
    def take(reader: RendezvousStore) -> Vote | None:
        """Rank 0's collector thread: the next vote (blocking, on its own store connection ``reader``),
        ``None`` when woken by :meth:`wake`."""
        raw = None
        while raw is None:
            raw = reader.queue_pop(QueuedVotes.QUEUE)  # None: the store's wait timed out, wait again
        return None if raw == QueuedVotes.STOP else pickle.loads(raw)
