"""The ``DataLoader``'s worker processes over a job's life: how they start, what reports their death, how they end.

- **Start** (:meth:`LoaderWorkers.start` and :class:`WorkerInit`, the loader's ``worker_init_fn``): a worker ignores
  SIGINT and SIGHUP, and SIGTERM until the feed closes (a preemption's SIGTERM to the whole process group must not end
  it before the main process commits; the main process stops it after committing). The workers are forked with
  SIGTERM blocked, and each unblocks it once its handler is set: in between, torch's own worker handler would end it
  (a SIGTERM to the group while the workers start failed the job, or hung it). On Linux a worker gets SIGKILL when
  its rank's process ends, however that ends (``kill -9``, a second SIGTERM's stop at once): a worker stuck in a load
  never looks at its parent, as the loader's workers otherwise do between batches, and would outlive the job. Then
  the user's own ``worker_init_fn`` runs. When starting the loader fails, the workers it started are ended.
- **Death** (:meth:`LoaderWorkers.started`): the loader's SIGCHLD handler raises its report of a dead worker
  (often the out-of-memory killer's doing) wherever the main thread happens to be: in ``process_batch``, in the
  middle of a commit or of a collective. While the job runs the report is kept instead and raised by the feed's
  next batch, a point where the loop handles it (:class:`~torch_batch_process.errors.LoaderWorkerDiedError`:
  the job fails, no example is blamed). A worker that dies while the main thread waits for its batch is found
  by the loader itself, as before.
- **End** (:meth:`LoaderWorkers.stop`): the loader's shutdown, after which SIGTERM ends a worker (so its
  ``terminate()`` works on one stuck in a load); a worker still alive after it (stuck in native code) is killed,
  so the interpreter's exit never waits for it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LoaderWorkers", "WorkerInit"]

_KILLED_JOIN_S = 5.0
"""How long :meth:`LoaderWorkers.stop` waits for a killed worker to be gone."""

_PR_SET_PDEATHSIG = 1

_CAN_BLOCK = hasattr(signal, "pthread_sigmask")
"""Signal masks (POSIX): the workers are forked with SIGTERM blocked."""


class WorkerInit:
    """The loader's ``worker_init_fn`` (see the module docstring), then the user's ``user_fn``."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn
        self.stopping = multiprocessing.RawValue("b", 0)  # shared memory: 1 once the feed closes

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if hasattr(signal, "SIGHUP"):  # a terminal's hangup reaches the whole group: the rank commits and stops
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if _CAN_BLOCK:  # forked with SIGTERM blocked (LoaderWorkers.start): one that came meanwhile reaches the handler
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _die_with_parent()
        if self.user_fn is not None:
            self.user_fn(worker_id)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        del signum, frame
        if self.stopping.value:  # the loader's terminate() at close: the worker did not stop on its own
            os._exit(0)  # exit code 0: the loader's child watch does not report it


class LoaderWorkers:
    """The workers of one feed's loader (see the module docstring).

    Args:
        user_init: the user's ``worker_init_fn``, if any.
    """

    def __init__(self, user_init: Callable[[int], None] | None) -> None:
        self.init = WorkerInit(user_init)
        self.died: BaseException | None = None
        """The loader's report of a dead worker, kept until the feed's next batch raises it."""
        self._loader_handler: Any = None

    def start(self, loader: Any) -> Any:
        """``iter(loader)``: starts the loader's workers (see the module docstring) and returns its iterator."""
        before = set(multiprocessing.active_children())
        blocked = _CAN_BLOCK and signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            iterator = iter(loader)
        except BaseException:
            for worker in set(multiprocessing.active_children()) - before:  # the workers it started, left running
                worker.kill()
                worker.join(timeout=_KILLED_JOIN_S)
            raise
        finally:
            if blocked:  # a SIGTERM to this process meanwhile is handled now
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        self.started(iterator)
        return iterator

    def started(self, iterator: Any) -> None:
        """After the loader's iterator started its workers (and the loader set its SIGCHLD handler)."""
        if not getattr(iterator, "_workers", None) or threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGCHLD)
        if callable(handler):
            self._loader_handler = handler
            signal.signal(signal.SIGCHLD, self._on_sigchld)

    def stop(self, iterator: Any) -> None:
        """Ends the workers of ``iterator`` and gives the loader its SIGCHLD handler back."""
        if self._loader_handler is not None:
            signal.signal(signal.SIGCHLD, self._loader_handler)
            self._loader_handler = None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is None:
            return
        workers = list(getattr(iterator, "_workers", ()))
        self.init.stopping.value = 1
        shutdown()
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=_KILLED_JOIN_S)

    def _on_sigchld(self, signum: int, frame: Any) -> None:
        from torch_batch_process.errors import LoaderWorkerDiedError

        try:
            self._loader_handler(signum, frame)
        except RuntimeError as exc:
            if not LoaderWorkerDiedError.reports(exc):
                raise
            if self.died is None:
                self.died = exc


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the one that started it ends. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl (an unusual libc): workers keep the loader's own check
        pass
