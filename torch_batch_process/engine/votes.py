"""Votes: one rank's part of a commit, and how votes travel to rank 0.

- :class:`GatheredVotes` (``schedule="static"``, and every closing commit): the ranks commit at the same
  step and exchange their votes with one ``all_gather`` on the library's gloo group, started at the commit's
  step boundary and completed at the next one, so that its latency overlaps with a step of work.
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
import pickle
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.engine.agreement import FailureInfo
from torch_batch_process.engine.distributed import Collectives, PendingGather
from torch_batch_process.engine.rendezvous import RendezvousStore

__all__ = ["GatheredVotes", "QueuedVotes", "Vote"]


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


class GatheredVotes:
    """Votes exchanged with an asynchronous ``all_gather`` (every rank votes at the same step)."""

    def __init__(self, collectives: Collectives) -> None:
        self._collectives = collectives

    def start(self, vote: Vote) -> PendingGather:
        return self._collectives.start_all_gather(vote)

    def gather(self, vote: Any) -> list[Any]:
        """A synchronous exchange (closing commits)."""
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
