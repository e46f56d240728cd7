"""Schedulers: which batch a rank runs next, and when the ranks commit, stop or fail.

- :class:`StaticScheduler` (``schedule="static"``, the default; Determined's behaviour, DESIGN §3): the
  batches not committed yet are dealt round-robin over the ranks, the ``i``-th to rank ``i % W`` at step
  ``i // W`` (with ``mesh=``: over the replicas, every member of a replica gets its batches); every rank runs the
  same number of steps (a rank with no batch left idles), commits every
  ``checkpoint_interval`` steps with the others, and the ranks agree at step boundaries, every ~50 ms and at every
  commit, whether to go on, stop or fail (:class:`~torch_batch_process.engine.schedule.agreement.StepAgreement`).
- :class:`BlockScheduler` (``schedule="static"`` for a streaming source, DESIGN §12): the static schedule with each
  rank's batches one contiguous block, so that ranks do not decode each other's Parquet row groups.
- :class:`DynamicScheduler` (``schedule="dynamic"``, DESIGN §8): a rank that is free takes the next batch not
  yet taken, from a counter in the job's rendezvous store, so a slow batch or a slow rank never stalls the
  others and no collective runs per step. Each rank commits after each ``checkpoint_interval`` of *its*
  batches. A rank that must stop or that failed adds a large mark to the same counter: every rank sees it at
  its next claim (one request it makes anyway), stops within one batch, and all meet at the closing commit.
  A rank that dies outright is found by rank 0's watch of every rank's heartbeats, which posts the failure
  mark (:mod:`~torch_batch_process.engine.schedule.liveness`).

Batch ids reach the DataLoader through :meth:`Scheduler.batch_ids` (the batch sampler iterates it in the main
process, so claims happen as the loader asks for its next batches, a few ahead).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator
from typing import Any

from torch_batch_process.engine.distributed import Collectives, RendezvousStore
from torch_batch_process.engine.schedule.agreement import Decision, StepAgreement
from torch_batch_process.errors import WorkerLostError
from torch_batch_process.jobstore.ranges import IndexedRanges, RangeSet

__all__ = ["BlockScheduler", "DynamicScheduler", "Scheduler", "StaticScheduler", "make_scheduler", "stream_scheduler"]


class Scheduler(abc.ABC):
    """This rank's batches and the decision after each of its steps."""

    kind: str

    @abc.abstractmethod
    def batch_ids(self) -> Iterator[int]:
        """This rank's batches in order (iterated by the batch sampler, in the main process)."""

    @abc.abstractmethod
    def steps(self) -> Iterator[bool]:
        """One item per step: whether this rank runs a batch in it (``False``: it idles in lockstep)."""

    @abc.abstractmethod
    def decide(self, step: int, *, agreed_stop: bool, preempt: bool, failed: bool) -> Decision:
        """After step ``step``: ``agreed_stop`` (a completed commit's votes asked to stop: every rank knows),
        ``preempt`` (this rank received SIGTERM/SIGINT), ``failed`` (this rank recorded a failure)."""

    def after_last(self, *, failed: bool) -> Decision:
        """When this rank's batches ran out (the feed ended): why."""
        return Decision.FAIL if failed else Decision.DONE

    @property
    def claimed(self) -> int | None:
        """Batches taken so far by all ranks, when known (progress between commits)."""
        return None

    def post(self, decision: Decision) -> None:  # noqa: B027 - only schedules without per-step agreement
        """Tells every rank to stop or fail at its next batch, from any thread (dynamic schedule)."""

    def join_replica(self, source: bool) -> None:  # noqa: B027 - the static schedule deals to replicas already
        """``mesh=``: this rank is a member of a replica of several ranks, its first (``source``) or another."""

    def replica_mark(self) -> int:
        """What this rank adds to its replica's message before each batch (``mesh=``): 0, or the code of a
        decision the replica must take together (:data:`MARKS`)."""
        return 0

    def follow(self, members_ok: bool, mark: int) -> bool:
        """The replica's message before a step (``mesh=``): whether none of its members failed, and the
        largest mark its members added. Returns whether this rank runs a batch in this step."""
        return members_ok

    def close(self) -> None:  # noqa: B027 - optional
        """Releases what the scheduler holds."""


class StaticScheduler(Scheduler):
    """Round-robin in lockstep (see the module docstring)."""

    kind = "static"

    def __init__(
        self, remaining: RangeSet, collectives: Collectives, interval: int, units: tuple[int, int] | None = None
    ) -> None:
        self._remaining = IndexedRanges(remaining)
        # the unit batches are dealt to: the rank, or with mesh= its replica (every member gets the same batches);
        # the agreement stays over every rank
        self._rank, self._world = units if units is not None else (collectives.rank, collectives.world_size)
        self._interval = interval
        self._agreement = StepAgreement(collectives)
        self.num_steps = math.ceil(len(self._remaining) / self._world)

    def batch_at(self, step: int, rank: int) -> int | None:
        """Global batch of ``rank`` at ``step``, or ``None`` when it idles in that step."""
        index = step * self._world + rank
        return self._remaining[index] if index < len(self._remaining) else None

    def num_batches_of(self, rank: int) -> int:
        return max(0, math.ceil((len(self._remaining) - rank) / self._world))

    def batch_ids(self) -> Iterator[int]:
        for step in range(self.num_batches_of(self._rank)):
            yield self._remaining[step * self._world + self._rank]

    def steps(self) -> Iterator[bool]:
        mine = self.num_batches_of(self._rank)
        for step in range(self.num_steps):
            yield step < mine

    def decide(self, step: int, *, agreed_stop: bool, preempt: bool, failed: bool) -> Decision:
        if step == self.num_steps - 1:
            return Decision.DONE  # the closing commit follows; its votes carry the flags
        if agreed_stop:
            return Decision.STOP
        if (step + 1) % self._interval == 0:
            return self._agreement.at_commit(step, preempt)  # flags in flight decide, else the commit's votes
        return self._agreement.boundary(step, preempt, failed)  # a rank's own flags reach the others here

    def after_last(self, *, failed: bool) -> Decision:
        raise AssertionError("static steps end with decide(), never with an exhausted feed")  # pragma: no cover

    @property
    def claimed(self) -> int | None:
        return None

    def close(self) -> None:
        self._agreement.drain()


MARKS = {1: Decision.STOP, 2: Decision.FAIL}
"""The codes of :meth:`Scheduler.replica_mark`."""


class DynamicScheduler(Scheduler):
    """Batches taken on demand from a shared counter (see the module docstring).

    With ``mesh=`` (:meth:`join_replica`), a replica claims as one: its first member (the source) claims, loads and
    sends each batch to the others (:mod:`~torch_batch_process.engine.feed.replica`), which claim nothing; a stop
    or failure mark the source saw at a claim reaches the members in the replica's status exchange before the next
    step (:meth:`replica_mark`, :meth:`follow`), and every member takes that decision at that same step: no member
    leaves the steps while another waits for it in a collective. A member's own stop or failure is posted to the
    counter (every replica sees it at its next claim) and taken at the next exchange with its replica.

    Args:
        remaining: the batches this attempt processes; the ``i``-th claim takes the ``i``-th of them.
        store: the job's prefixed rendezvous store.
        interval: commit after this many of this rank's batches.
    """

    kind = "dynamic"
    STOP_MARK = 1 << 36
    FAIL_MARK = 1 << 48
    COUNTER = "next"

    def __init__(self, remaining: RangeSet, store: RendezvousStore, interval: int) -> None:
        self._remaining = IndexedRanges(remaining)
        self._store = store
        self._interval = interval
        self._since_commit = 0
        self._posted: set[str] = set()
        self.seen: Decision | None = None
        """A stop or failure mark seen at a claim."""
        self._claimed = 0
        self._replica: bool | None = None
        """``mesh=``: whether this rank is its replica's source (``None``: no replica of several ranks)."""
        self._agreed: Decision | None = None
        """``mesh=``: the decision the replica's status exchange agreed on."""

    def join_replica(self, source: bool) -> None:
        self._replica = source

    def replica_mark(self) -> int:
        if not self._replica or self.seen is None:
            return 0
        return 2 if self.seen is Decision.FAIL else 1

    def follow(self, members_ok: bool, mark: int) -> bool:
        agreed = Decision.FAIL if not members_ok else MARKS.get(mark)
        if agreed is not None and self._agreed is not Decision.FAIL:
            self._agreed = agreed
        return self._agreed is None

    def _add(self, amount: int) -> int:
        return self._store.add(self.COUNTER, amount)

    def batch_ids(self) -> Iterator[int]:
        if self._replica is False:
            return  # a replica's other members run the batches its source claims
        while self.seen is None:
            value = self._add(1)
            if value >= self.FAIL_MARK:
                self.seen = Decision.FAIL
                return
            if value >= self.STOP_MARK:
                self.seen = Decision.STOP
                return
            self._claimed = value
            if value > len(self._remaining):
                return  # every batch is taken
            yield self._remaining[value - 1]

    def steps(self) -> Iterator[bool]:
        while True:
            yield True

    def decide(self, step: int, *, agreed_stop: bool, preempt: bool, failed: bool) -> Decision:
        if self._replica is not None:
            return self._decide_in_replica(agreed_stop=agreed_stop, preempt=preempt, failed=failed)
        if failed:
            self.post(Decision.FAIL)
            return Decision.FAIL
        if self.seen is not None:
            return self.seen
        if agreed_stop or preempt:
            self.post(Decision.STOP)
            return Decision.STOP
        self._since_commit += 1
        if self._since_commit >= self._interval:
            self._since_commit = 0
            return Decision.COMMIT
        return Decision.CONTINUE

    def _decide_in_replica(self, *, agreed_stop: bool, preempt: bool, failed: bool) -> Decision:
        """The decision of a member of a replica: only what its replica agreed on ends its steps (see the class
        docstring); its own failure or stop is posted and taken with the replica at the next exchange."""
        if failed:
            try:
                self.post(Decision.FAIL)
            except WorkerLostError:
                # the store is gone (with rank 0's process): every other replica finds that at its next claim, and
                # this rank's failure reaches its own members with the next message. Raised here, it would end this
                # rank's steps while they run the batch the last message brought, waiting for it in its collectives
                pass
        elif agreed_stop or preempt:
            self.post(Decision.STOP)
        if self._agreed is not None:
            return self._agreed
        if failed:
            return Decision.CONTINUE  # no commit of a failed rank: the replica fails together at the next step
        self._since_commit += 1
        if self._since_commit >= self._interval:
            self._since_commit = 0
            return Decision.COMMIT
        return Decision.CONTINUE

    def after_last(self, *, failed: bool) -> Decision:
        if failed:
            self.post(Decision.FAIL)
            return Decision.FAIL
        return self.seen or self._agreed or Decision.DONE

    def post(self, decision: Decision) -> None:
        """Tells every rank to stop (``STOP``) or that a rank failed (``FAIL``), once per kind. Thread-safe
        (rank 0's vote collector posts a failure from its own thread)."""
        if decision.value in self._posted:
            return
        self._posted.add(decision.value)
        self._add(self.FAIL_MARK if decision is Decision.FAIL else self.STOP_MARK)

    @property
    def claimed(self) -> int | None:
        return min(self._claimed, len(self._remaining))


def make_scheduler(
    kind: str,
    remaining: RangeSet,
    collectives: Collectives,
    interval: int,
    store: Any = None,
    units: tuple[int, int] | None = None,
) -> Scheduler:
    """The scheduler of ``schedule=kind`` (one process: static, the two are the same then); ``units``: this rank's
    replica and the number of replicas with ``mesh=`` (static only), else ``None`` (the rank and the world)."""
    if kind == "dynamic" and collectives.world_size > 1:
        return DynamicScheduler(remaining, store, interval)
    return StaticScheduler(remaining, collectives, interval, units)


class BlockScheduler(StaticScheduler):
    """``schedule="static"`` for a stream: each rank takes one contiguous block of the batches left.

    The ``i``-th of the ``R`` batches left goes to rank ``i // ceil(R / W)`` (not ``i % W``), so a rank reads
    its rows front to back and ranks do not decode each other's Parquet row groups. Everything else is the
    static schedule's: every rank runs ``ceil(R / W)`` steps in lockstep (a rank with fewer batches idles
    through the last ones), commits every ``checkpoint_interval`` steps with the others, and a resume deals the
    batches left, whatever the world size, in blocks again.
    """

    def __init__(
        self, remaining: RangeSet, collectives: Collectives, interval: int, units: tuple[int, int] | None = None
    ) -> None:
        super().__init__(remaining, collectives, interval, units)
        self._block = self.num_steps

    def batch_at(self, step: int, rank: int) -> int | None:
        if step >= self.num_batches_of(rank):
            return None
        return self._remaining[rank * self._block + step]

    def num_batches_of(self, rank: int) -> int:
        return max(0, min(self._block, len(self._remaining) - rank * self._block))

    def batch_ids(self) -> Iterator[int]:
        first = self._rank * self._block
        for step in range(self.num_batches_of(self._rank)):
            yield self._remaining[first + step]


def stream_scheduler(
    kind: str,
    remaining: RangeSet,
    collectives: Collectives,
    interval: int,
    store: Any = None,
    units: tuple[int, int] | None = None,
) -> Scheduler:
    """The scheduler of a stream job: :class:`BlockScheduler` for ``"static"`` (and one process), else as
    :func:`make_scheduler`."""
    if kind == "dynamic" and collectives.world_size > 1:
        return make_scheduler(kind, remaining, collectives, interval, store)
    return BlockScheduler(remaining, collectives, interval, units)
