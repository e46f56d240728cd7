"""``batch_timeout``: a watchdog thread per rank, so that a stuck batch never hangs the job (DESIGN §11).

The runner marks each ``process_batch`` call (and each load and call of a split batch's parts, see
:mod:`torch_batch_process.engine.feed.failing_examples`) with :meth:`BatchWatchdog.span`, and the feed marks each
wait for the next batch from the ``DataLoader`` (the dataset's ``__getitem__`` and the ``collate_fn`` in the main
process, or the wait for the workers) with the same span, given a function that tells the batch waited for: a batch
whose loading hangs (a stuck network read, a dead lock) is a stuck batch too. When one runs longer than
``batch_timeout`` seconds, the rank's watchdog:

1. logs an error naming the batch and the rank, with the Python stack of every thread of the process;
2. tells the other ranks (a counter in the job's rendezvous store): each logs its own stacks too;
3. raises :class:`~torch_batch_process.errors.BatchTimeoutError` in the main thread (from a signal handler
   that the watchdog triggers with ``SIGUSR2``: it interrupts Python code and blocking calls such as
   ``time.sleep``, socket reads and lock waits). The error then fails the job like any exception: every rank
   stops promptly, the failing one raising ``BatchTimeoutError``, the others
   :class:`~torch_batch_process.errors.WorkerFailedError` with its traceback;
4. when the main thread is still stuck ``grace_s`` seconds later (inside native code that does not return),
   logs the stacks again and ends the process with exit code 1 (``os._exit``, after flushing the logs). A rank
   told about a timeout elsewhere does the same if its batches have not stopped ``2 * grace_s`` seconds later.

The last commit stays intact in every case (commits are atomic, as against ``kill -9``), so running the job
again resumes.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch_batch_process.engine.rank_failure import JOB_STOPS
from torch_batch_process.errors import BatchTimeoutError
from torch_batch_process.log import end_process, thread_stacks

__all__ = ["BatchWatchdog", "NoWatchdog", "watch_batches"]

logger = logging.getLogger(__name__)

TIMEOUT_KEY = "batch_timeout"
"""Counter in the call's rendezvous store: > 0 once some rank's batch timed out."""

SIGNAL = signal.SIGUSR2


class BatchWatchdog:
    """Watches this rank's batches (see the module docstring).

    Args:
        timeout_s: ``batch_timeout``.
        rank: this rank.
        store: factory of a rendezvous store connection for the watchdog thread (``None``: one rank).
        grace_s: how long the main thread gets to unwind before the process ends.
    """

    def __init__(
        self, timeout_s: float, rank: int, store: Callable[[], Any] | None = None, grace_s: float = 5.0
    ) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self._store_factory = store
        self._grace_s = grace_s
        self._poll_s = min(0.5, max(0.05, timeout_s / 10))
        self._remote_poll_s = min(5.0, max(1.0, timeout_s / 4))  # one store request per rank per this many seconds
        self._next_remote = 0.0
        self._batch: int | Callable[[], int | None] | None = None  # what runs: a batch, or a load (see span())
        self._since = 0.0
        self._pending: BatchTimeoutError | None = None
        self._fired_at: float | None = None
        self._remote_at: float | None = None
        self._stepping = True  # until steps_done(): a rank that stays busy after a timeout elsewhere is ended
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous_handler: Any = None
        self._main = threading.main_thread().ident

    def start(self) -> None:
        """Installs the signal handler (main thread only) and starts the thread."""
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(SIGNAL, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="tbp-watchdog", daemon=True)
        self._thread.start()

    def steps_done(self) -> None:
        """The rank's batches are over: from now on a timeout on another rank is only dumped (the closing commit,
        which learns of it from the votes, may take its time to publish what was committed)."""
        self._stepping = False

    def close(self) -> None:
        """Stops the thread and restores the signal handler."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._previous_handler is not None:
            signal.signal(SIGNAL, self._previous_handler)
            self._previous_handler = None

    @property
    def watch(self) -> Callable[[Any], contextlib.AbstractContextManager[Any]]:
        """What times a batch (:meth:`span`), for the feed and the runner."""
        return self.span

    @contextlib.contextmanager
    def span(self, batch: int | Callable[[], int | None]) -> Iterator[None]:
        """Times one call of batch ``batch``, or, given a function, one wait for the next batch from the loader:
        the function tells which batch that is when the timeout fires (``None``: not known yet, not claimed)."""
        self._since = time.monotonic()
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None

    # ------------------------------------------------------------------ the thread

    def _on_signal(self, signum: int, frame: Any) -> None:
        del signum, frame
        error, self._pending = self._pending, None
        if error is not None and self._batch is not None:
            raise error

    def _watch(self) -> None:
        store = None
        if self._store_factory is not None:
            try:
                store = self._store_factory()
            except Exception as exc:  # noqa: BLE001 - the local watchdog still works
                logger.warning("rank %d: batch_timeout watchdog has no store connection: %s", self.rank, exc)
        while not self._stop.wait(self._poll_s):
            now = time.monotonic()
            batch = self._batch
            if self._fired_at is None and batch is not None and now - self._since > self.timeout_s:
                self._fire(batch, now, store)
            elif self._fired_at is None and self._remote_at is None and store is not None and now >= self._next_remote:
                self._next_remote = now + self._remote_poll_s
                store = self._check_remote(store, now)
            if self._fired_at is not None and self._batch is not None and now - self._fired_at > self._grace_s:
                self._exit(f"batch {self._batch} is still running {self._grace_s:g}s after its BatchTimeoutError")
            if self._remote_at is not None and self._stepping and now - self._remote_at > 2 * self._grace_s:
                self._exit("a batch on another rank timed out and this rank has not stopped")
        if self._fired_at is None and self._remote_at is None and store is not None:
            self._check_remote(store, time.monotonic())  # the job stopped faster than a poll: dump now

    def _check_remote(self, store: Any, now: float) -> Any:
        """Dumps this rank's stacks when another rank's batch timed out; returns the store (``None``: gone)."""
        try:
            if int(store.add(TIMEOUT_KEY, 0)) > 0:
                self._remote_at = now
                logger.error(
                    "rank %d: a batch on another rank ran longer than batch_timeout=%gs; stacks of rank %d:\n%s",
                    self.rank, self.timeout_s, self.rank, thread_stacks(),
                )
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
            return None
        return store

    def _fire(self, batch: int | Callable[[], int | None], now: float, store: Any) -> None:
        self._fired_at = now
        if callable(batch):
            loaded = batch()
            what = f"loading batch {loaded} on rank {self.rank}" if loaded is not None else (
                f"loading the next batch of rank {self.rank}"
            )
            what += " (the dataset's __getitem__, the collate_fn or the DataLoader's workers)"
        else:
            what = f"batch {batch} on rank {self.rank}"
        message = (
            f"{what} ran longer than batch_timeout={self.timeout_s:g}s; {JOB_STOPS} "
            "(the last commit is intact: run it again to resume)"
        )
        logger.error("rank %d: %s. Stacks of rank %d:\n%s", self.rank, message, self.rank, thread_stacks())
        if store is not None:
            with contextlib.suppress(Exception):
                store.add(TIMEOUT_KEY, 1)
        self._pending = BatchTimeoutError(message)
        if self._previous_handler is not None and self._main is not None:
            signal.pthread_kill(self._main, SIGNAL)

    def _exit(self, why: str) -> None:
        stacks = thread_stacks()
        logger.error("rank %d: %s; ending the process. Stacks of rank %d:\n%s", self.rank, why, self.rank, stacks)
        end_process()


class NoWatchdog:
    """No ``batch_timeout``: nothing times the batches (``watch`` is ``None``: the feed and the runner skip it)."""

    watch = None

    def steps_done(self) -> None:
        """Nothing to stop watching."""

    def close(self) -> None:
        """Nothing to stop."""


def watch_batches(
    timeout_s: float | None, rank: int, store: Callable[[], Any] | None
) -> BatchWatchdog | NoWatchdog:
    """The rank's started watchdog with ``batch_timeout`` (``timeout_s``), else a :class:`NoWatchdog`; the caller
    closes it when its call ends, so that a rank whose batches are done still dumps its stacks when another rank's
    batch times out. ``store``: several ranks: a factory of rendezvous store connections (a timeout is told to the
    others); ``None``: one rank."""
    if timeout_s is None:
        return NoWatchdog()
    watchdog = BatchWatchdog(timeout_s, rank, store)
    watchdog.start()
    return watchdog


