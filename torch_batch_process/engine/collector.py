"""Rank 0's vote collector (dynamic schedule): a thread that turns queued commit votes into durable records.

Each rank of a dynamic job pushes its commit votes into a queue in the rendezvous store and goes on with its
batches (see :mod:`torch_batch_process.engine.committer`). The collector takes every vote waiting in the queue,
merges them into one record, writes it (the commit point), then acknowledges the votes to their ranks, which
publish their stages once acknowledged; when the votes changed what the job knows of the device's memory, it
shares the merged limits with every rank through the store. Like the static schedule's group commits
(:mod:`torch_batch_process.engine.group_commit`), two record writes start at least
:data:`~torch_batch_process.engine.group_commit.RECORD_SPACING_S` apart, and the votes that arrive meanwhile share
the next record: with sub-millisecond batches every rank votes hundreds of times a second, and a record (JSON, a
write and an ``fsync``, or a PUT) for each would be most of rank 0's work. An error stops it: it is kept for rank
0's main thread (:meth:`VoteCollector.check`, :meth:`VoteCollector.stop`) and the other ranks are told to stop at their next
batch (``on_error``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch_batch_process.engine.group_commit import RECORD_SPACING_S
from torch_batch_process.engine.keeper import RecordKeeper
from torch_batch_process.engine.votes import QueuedVotes

__all__ = ["VoteCollector"]

STOP_TIMEOUT_S = 600.0
"""The most a closing commit waits for the collector to take the votes every rank queued."""


class VoteCollector:
    """Starts the collector thread of rank 0.

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
        on_error: Callable[[], None] | None = None,
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
                waiting = 0 if stop else reader.queue_len(QueuedVotes.QUEUE)
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
                limits = self._keeper.take_changed_limits()
                if limits is not None:  # the ranks read it at their next commit
                    QueuedVotes.share_limits(reader, limits)
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
            if self._on_error is not None:
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
