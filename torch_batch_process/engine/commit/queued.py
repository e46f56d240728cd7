"""Queued votes (``schedule="dynamic"`` on several ranks): each rank commits on its own, no rank waits for another.

A rank commits after each ``checkpoint_interval`` of *its* batches: its vote goes into a queue in the call's
rendezvous store and it goes on with its batches. Rank 0's collector thread (:class:`VoteCollector`) takes every
vote waiting in the queue, merges them into one record, writes it (the commit point), then raises each rank's
acknowledgement counter in the store by the number of its votes the record covers; a rank reads its counter (one
request) at its next commit and publishes the stages acknowledged. Stage numbers come from a counter in the store
shared by all ranks. An error stops the collector: it is kept for rank 0's main thread (:meth:`QueuedVotes.check`)
and the other ranks are told to stop at their next batch (``on_error``).

Like the static schedule's group commits (:mod:`~torch_batch_process.engine.commit.group_commit`), two record writes
of the collector start at least :data:`~torch_batch_process.engine.commit.group_commit.RECORD_SPACING_S` apart, and
the votes that arrive meanwhile share the next record: with sub-millisecond batches every rank votes hundreds of
times a second, and a record (JSON, a write and an ``fsync``, or a PUT) for each would be most of rank 0's work.

What rank 0's participants share (memory limits, ``on_oom="split"``): when the votes the collector merged taught
them something every rank must learn, the collector puts it in the store (a version counter, read with one request at
each commit, and the shared payloads, read when it moved: :meth:`QueuedVotes.shared`).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch_batch_process.engine.commit.group_commit import RECORD_SPACING_S
from torch_batch_process.engine.commit.keeper import RecordKeeper
from torch_batch_process.engine.commit.payloads import Payloads
from torch_batch_process.engine.commit.transport import VoteTransport
from torch_batch_process.engine.commit.votes import Arrival, CommitFlags, Vote
from torch_batch_process.engine.distributed import RendezvousStore

if TYPE_CHECKING:
    from torch_batch_process.engine.commit.publisher import Publisher

__all__ = ["QueuedVotes", "VoteCollector"]

logger = logging.getLogger(__name__)

QUEUE = "votes"
"""The queue of votes in the call's rendezvous store."""
_STOP = b"stop"
SHARED = "shared"
"""What rank 0's participants share with every rank (pickled payloads), and its version counter
(``shared/version``)."""

STOP_TIMEOUT_S = 600.0
"""The most a closing commit waits for the collector to take the votes every rank queued."""


class QueuedVotes(VoteTransport):
    """Votes queued in the rendezvous store, taken by rank 0 (see the module docstring).

    Args:
        store: the call's keys in the job's rendezvous store.
        rank: this rank.
        stage_counter: draws the next stage number (shared by all ranks).
        keeper: rank 0's record keeper (``None`` elsewhere): rank 0 starts the collector.
        on_error: called from the collector thread when it fails (the dynamic schedule then stops every rank).
        committed: the batches and examples committed before this attempt (this rank adds its own votes to them).
    """

    every_rank_votes = False

    def __init__(
        self,
        store: RendezvousStore,
        rank: int,
        stage_counter: Callable[[], int],
        keeper: RecordKeeper | None,
        on_error: Callable[[], None],
        committed: tuple[int, int],
    ) -> None:
        self.store = store
        self._rank = rank
        self._stage_counter = stage_counter
        self.first_stage = stage_counter()
        self.keeper = keeper
        self.queued = 0
        """Votes this rank pushed so far."""
        self._sent: Vote | None = None
        self._shared_seen = 0
        self._committed = committed
        self._collector = VoteCollector(self, keeper, on_error) if keeper is not None else None  # rank 0

    def next_stage(self, stage: int) -> int:
        return self._stage_counter()

    def stamp(self, vote: Vote) -> None:
        vote.queued = self.queued

    def send(self, vote: Vote, *, news: bool = False) -> bool:
        if vote.failure is not None:
            return False  # saving it failed: the closing exchange makes every rank raise
        self.store.queue_push(QUEUE, pickle.dumps(vote, protocol=pickle.HIGHEST_PROTOCOL))
        self.queued += 1
        self._sent = vote
        return True  # no rank waits for another: the commit is this rank's own

    @property
    def pending(self) -> bool:
        return False  # send() completes each commit

    def arrived(self) -> Arrival | None:
        sent, self._sent = self._sent, None
        if sent is None:
            return None
        flags = CommitFlags(preempt=sent.preempt, failed=False, overflow=False, durable=-1, batches_committed=0,
                            examples_committed=0)  # a failed vote is never sent (see send)
        return Arrival([sent], flags)

    def shared(self) -> Payloads | None:
        version = self.store.add(f"{SHARED}/version", 0)
        if version <= self._shared_seen:
            return None
        self._shared_seen = version
        shared: Payloads = pickle.loads(self.store.get(SHARED))
        return shared

    def committed_counts(self, arrival: Arrival) -> tuple[int, int]:
        if self.keeper is not None:
            return self.keeper.committed_counts()
        batches, examples = self._committed
        for vote in arrival.votes:
            batches += sum(b - a for a, b in vote.batches)
            examples += vote.examples
        self._committed = (batches, examples)
        return self._committed

    def durable_votes(self, newest_durable: int, published: Publisher) -> int:
        return self.acknowledged()

    def acknowledged(self) -> int:
        """How many of this rank's votes rank 0 has made durable."""
        return int(self.store.add(f"ack/{self._rank}", 0))

    def drain(self, votes: list[Vote]) -> None:
        if self._collector is not None:
            self._collector.stop(expected=sum(v.queued for v in votes))  # every vote queued before the closing exchange
            self._collector = None

    def stop_for_failure(self, failed_here: bool) -> None:
        if self._collector is not None:  # its own error, if any, is among the failures being raised
            collector, self._collector = self._collector, None
            collector.stop(expected=None, check=False)

    def check(self) -> None:
        if self._collector is not None:
            self._collector.check()

    def close(self) -> None:
        if self._collector is not None:
            collector, self._collector = self._collector, None
            try:
                collector.stop(expected=None)
            except Exception as exc:  # noqa: BLE001 - leaving anyway; the next start repairs
                logger.warning("rank 0: stopping the vote collector failed: %s", exc)

    # ------------------------------------------------------------ the queue, as rank 0's collector reads it

    @staticmethod
    def acknowledge(reader: RendezvousStore, rank: int, count: int) -> None:
        """Rank 0's collector thread: ``count`` more votes of ``rank`` are durable."""
        reader.add(f"ack/{rank}", count)

    @staticmethod
    def share(writer: RendezvousStore, shared: Payloads) -> None:
        """Rank 0's collector thread: what its participants share changed (see :meth:`shared`)."""
        writer.set(SHARED, pickle.dumps(shared, protocol=pickle.HIGHEST_PROTOCOL))
        writer.add(f"{SHARED}/version", 1)

    def wake(self) -> None:
        """Rank 0: unblocks its collector, waiting for a vote (:meth:`take` then returns ``None``)."""
        self.store.queue_push(QUEUE, _STOP)

    @staticmethod
    def take(reader: RendezvousStore) -> Vote | None:
        """Rank 0's collector thread: the next vote (blocking, on its own store connection ``reader``),
        ``None`` when woken by :meth:`wake`."""
        raw = None
        while raw is None:
            raw = reader.queue_pop(QUEUE)  # None: the store's wait timed out, wait again
        return None if raw == _STOP else pickle.loads(raw)


class VoteCollector:
    """Starts the collector thread of rank 0: it turns queued votes into durable records.

    Args:
        queue: rank 0's view of the vote queue.
        keeper: rank 0's record keeper (merges votes, writes records).
        on_error: called from the thread when it fails (the dynamic schedule then stops every rank).
        spacing_s: the least time between the starts of two record writes.
    """

    def __init__(
        self,
        queue: QueuedVotes,
        keeper: RecordKeeper,
        on_error: Callable[[], None],
        spacing_s: float = RECORD_SPACING_S,
    ) -> None:
        self._queue = queue
        self._keeper = keeper
        self._on_error = on_error
        self._spacing_s = spacing_s
        self._hurry = threading.Event()  # stopping: no more spacing
        self._error: BaseException | None = None
        self.taken = 0
        """Queued votes made durable so far."""
        self._progress = threading.Condition()  # notified when ``taken`` grows or the thread ends
        self._ended = False
        self._thread = threading.Thread(target=self._collect, name="tbp-collector", daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        """Takes the queued votes (those waiting when it looks: one record for them), writes their record,
        acknowledges them to their ranks; until woken by :meth:`QueuedVotes.wake`.

        A record covers the votes that were waiting, not those that arrive while it takes them: with many ranks
        votes arrive as fast as it takes them, and draining the queue "until empty" wrote no record for as long
        as they kept coming (at 32 ranks, none before the closing commit)."""
        reader = self._queue.store.clone()  # a connection of its own: the main thread claims batches meanwhile
        try:
            stop = False
            last_start = float("-inf")
            while not stop:
                pause = last_start + self._spacing_s - time.monotonic()
                if pause > 0:
                    self._hurry.wait(pause)  # the votes that arrive meanwhile share the next record
                vote = QueuedVotes.take(reader)
                votes = [] if vote is None else [vote]
                stop = vote is None
                waiting = 0 if stop else reader.queue_len(QUEUE)
                for _ in range(waiting):
                    vote = QueuedVotes.take(reader)
                    if vote is None:
                        stop = True
                        break
                    votes.append(vote)
                if not votes:
                    continue
                last_start = time.monotonic()
                self._keeper.persist(self._keeper.prepare(self._keeper.merge(votes)))
                shared = self._keeper.share()
                if len(shared):  # the ranks read it at their next commit
                    QueuedVotes.share(reader, shared)
                with self._progress:
                    self.taken += len(votes)
                    self._progress.notify_all()
                counts: dict[int, int] = {}
                for v in votes:
                    counts[v.rank] = counts.get(v.rank, 0) + 1
                for rank, count in counts.items():
                    QueuedVotes.acknowledge(reader, rank, count)
        except BaseException as exc:  # noqa: BLE001 - raised on rank 0's main thread, travels in its vote
            self._error = exc
            self._on_error()
        finally:
            with self._progress:
                self._ended = True
                self._progress.notify_all()

    def check(self) -> None:
        """Raises the error that stopped the thread, if any. Never waits."""
        if self._error is not None:
            raise self._error

    def stop(self, expected: int | None, *, check: bool = True) -> None:
        """Lets the thread take the ``expected`` queued votes (all of them: every rank queued them before the
        closing exchange; ``None``: do not wait for votes), stops it, and raises its error if it failed (unless
        not ``check``: the error is already being reported). Raises ``TimeoutError`` if it does not end."""
        self._hurry.set()  # the votes left are written without spacing
        if expected is not None:
            with self._progress:  # waits without polling: the thread notifies each record and its end
                if not self._progress.wait_for(lambda: self.taken >= expected or self._ended, STOP_TIMEOUT_S):
                    raise TimeoutError(
                        f"rank 0 took {self.taken} of the {expected} queued votes in {STOP_TIMEOUT_S:.0f} s"
                    )
        self._queue.wake()
        self._thread.join(timeout=STOP_TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"rank 0's vote collector did not stop in {STOP_TIMEOUT_S:.0f} s")
        if check:
            self.check()
