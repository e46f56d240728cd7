"""Preemption: SIGTERM, SIGINT or SIGHUP asks the job to commit and stop at the next agreed step boundary (~50 ms
away).

While a job runs, :class:`SignalWatcher` replaces the handlers of SIGTERM, SIGINT and SIGHUP with one that
only records the request; the loop then makes every rank agree to stop (see
:mod:`torch_batch_process.engine.schedule.agreement`), commits and returns with ``preempted=True``. A second
signal of the same kind stops the process at once the usual way (for an impatient Ctrl-C), without
a commit; the last commit stays intact. The user's own handlers are restored when the job returns.

A repeat within :data:`REPEAT_WINDOW_S` seconds of the first signal counts as the same request:
schedulers that signal every process of a job (Slurm with cgroup process tracking, ``kill`` of a
process group) deliver it to the workers directly *and* through the launcher, which forwards it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from torch_batch_process.lost_workers import signal_origin

logger = logging.getLogger(__name__)

WATCHED_SIGNALS = (signal.SIGTERM, signal.SIGINT, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))
"""SIGHUP too: torchrun (and the launcher) forward it to the workers, and a terminal's hangup (a dropped ssh session)
sends it: a worker died of it without a commit while the launcher said it was asked to commit and stop."""
_KEPT_IF_IGNORED = tuple(signum for signum in WATCHED_SIGNALS if signum.name == "SIGHUP")
"""Signals left ignored where the process ignores them when the job starts (``nohup`` ignores SIGHUP; its children
inherit that)."""
REPEAT_WINDOW_S = 2.0


class SignalWatcher:
    """Records SIGTERM/SIGINT/SIGHUP while a job runs (main thread only; elsewhere it watches nothing)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._requested_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalWatcher:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("torch_batch_process runs outside the main thread: SIGTERM/SIGINT/SIGHUP do not preempt it")
            return self
        for signum in WATCHED_SIGNALS:
            if signum in _KEPT_IF_IGNORED and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # `nohup`: the user asked the job to outlive a hangup, not to stop at it
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except (ValueError, OSError):  # pragma: no cover - exotic embedding
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Puts back the handlers that were installed before the job."""
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, OSError):  # pragma: no cover
                pass
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.requested == name and now - self._requested_at < REPEAT_WINDOW_S:
            return  # the same request, delivered both directly and through the launcher
        if self.requested == name:
            logger.warning("second %s: stopping now without a commit; the last commit is intact", name)
            previous = self._previous.get(signum)
            self.restore()
            if callable(previous):
                previous(signum, frame)
            elif signum == signal.SIGINT:
                raise KeyboardInterrupt
            else:
                signal.raise_signal(signum)
            return
        if self.requested is None:
            self.requested = name
            self._requested_at = now
        logger.warning(
            "%s: committing and stopping at the next agreed step boundary (send it again, %.0f s or more "
            "later, to stop at once)",
            signal_origin(name),  # a SIGTERM from the launcher's agent after a worker died says so
            REPEAT_WINDOW_S,
        )

    @property
    def preempt_requested(self) -> bool:
        return self.requested is not None

