"""Background work of one rank: publishing its stages off the critical path.

One thread runs the tasks in submission order (stages are published in order; a publication is queued only
once the record that covers it is durable, see :mod:`torch_batch_process.engine.commit.committer`; rank 0's records
are written by :mod:`torch_batch_process.engine.commit.group_commit`).
Errors are not lost: :meth:`BackgroundWork.check` (called before every vote, without waiting)
raises the first error of a finished task, so it fails the job cooperatively like any other error
of that rank; :meth:`BackgroundWork.settle` waits for everything.

Where tasks are cheap (a publication on local storage is one rename per stage), ``inline=True`` runs them on
the caller's thread at submission, with the same error handling: a Python thread that makes syscalls takes
the GIL back after each one, and with sub-millisecond batches those hand-overs (several thread switches per
syscall) cost the main thread more than the renames themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundWork:
    """A FIFO of tasks on one thread, created on first use (or run at submission with ``inline``)."""

    def __init__(self, name: str = "tbp-commit", *, inline: bool = False) -> None:
        self._name = name
        self._inline = inline
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[str, Future[Any]]] = []

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queues ``fn(*args)``; ``what`` names it in errors. Inline: runs it now; its error is raised later,
        by :meth:`check` or :meth:`settle`, as a queued task's would be."""
        if self._inline:
            future: Future[Any] = Future()
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - raised by check() or settle()
                future.set_exception(exc)
            self._pending.append((what, future))
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        future = self._pool.submit(fn, *args)
        self._pending.append((what, future))
        return future

    def check(self) -> None:
        """Raises the first error of the tasks finished so far; forgets the ones that succeeded. Never waits.

        Tasks finish in submission order (one thread), so only the finished head of the queue is looked at: this
        runs after every batch."""
        done = 0
        for _, future in self._pending:
            if not future.done():
                break
            error = future.exception()
            if error is not None:
                del self._pending[: done + 1]
                raise error
            done += 1
        del self._pending[:done]

    def settle(self) -> None:
        """Waits for every queued task; raises the first error."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for what, future in pending:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - keep waiting for the rest, raise the first
                if error is None:
                    error = exc
                    logger.debug("background task failed: %s: %s", what, exc)
        if error is not None:
            raise error

    def close(self, timeout: float = 120.0) -> None:
        """Lets queued tasks finish (up to ``timeout`` seconds each), logging errors, then stops the thread."""
        pending, self._pending = self._pending, []
        for what, future in pending:
            try:
                future.result(timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - the caller is already leaving; the next start repairs
                logger.warning("%s did not complete: %s", what, exc)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
