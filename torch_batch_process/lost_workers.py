"""Workers lost under the library's launcher: named by rank, pid and signal, in one line per rank.

When a worker dies of a signal (``kill -9``, the out-of-memory killer), torchrun's agent stops the others with
SIGTERM. Without more, a surviving rank logged "SIGTERM received" (a signal its user never sent), then printed a
35-line traceback ending in :class:`~torch_batch_process.errors.WorkerLostError` that named no one, and the
launcher named the pid of the worker's wrapper. So:

- the launcher's rank wrapper (:mod:`torch_batch_process.launch.rank_prefix`, standard library only) appends one
  JSON line ``{"rank", "local_rank", "pid", "signal"}`` to :func:`notes_path` when its command dies of a signal,
  *before* it exits itself: the agent notices the death, and stops the other workers, only after the note is there;
- a surviving rank reads the notes when SIGTERM comes (:func:`signal_origin`: "from the launcher's agent, after
  rank 1 (pid 4242) died of SIGKILL") and when it loses its peers (:func:`lost_peer_line`);
- an uncaught ``WorkerLostError`` prints as that one line, not a traceback (:func:`quiet_lost_peer_traceback`): the
  traceback of a lost peer shows the library's internals, never the user's code; every other exception keeps it;
- the launcher names the worker, not its wrapper, in its last line (:func:`lost_workers`).

Notes are per node (next to the launcher's state file, ``$TBP_LAUNCH_STATE``): a rank on another node than the
lost worker says only that a peer stopped answering.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from torch_batch_process import settings
from torch_batch_process.errors import WorkerLostError

__all__ = [
    "LOST_SUFFIX",
    "LostWorker",
    "lost_peer_line",
    "lost_workers",
    "notes_path",
    "one_line_for_a_lost_peer",
    "quiet_lost_peer_traceback",
    "signal_origin",
]

LOST_SUFFIX = ".lost"
"""The notes file is the launcher's state file with this suffix (``rank_prefix.py`` writes it by this name)."""
NOTE_WAIT_S = 2.0
"""How long a rank that lost a peer under the launcher waits for the note naming it, at the process's end only."""


@dataclass(frozen=True)
class LostWorker:
    """A worker of this node that died of a signal."""

    rank: int
    local_rank: int
    pid: int
    signal: str

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) died of {self.signal}"


def notes_path(state_file: str) -> str:
    """The notes file of the launcher whose state file is ``state_file``."""
    return state_file + LOST_SUFFIX


def lost_workers(state_file: str | None = None) -> list[LostWorker]:
    """The workers of this node noted as dead, first death first (``state_file``: the launcher's; default
    ``$TBP_LAUNCH_STATE``; none when not under the launcher). Best effort: unreadable lines are skipped."""
    state_file = state_file or settings.current().launch_state
    if not state_file:
        return []
    try:
        with open(notes_path(state_file), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    lost = []
    for line in lines:
        try:
            note = json.loads(line)
            lost.append(LostWorker(int(note["rank"]), int(note["local_rank"]), int(note["pid"]), str(note["signal"])))
        except (ValueError, KeyError, TypeError):
            continue
    return lost


def signal_origin(name: str) -> str:
    """How a rank words a signal it received: ``SIGTERM received``, or, when a worker of its node was lost just
    before, that the launcher's agent sent it because of that worker."""
    lost = lost_workers()
    if name == "SIGTERM" and lost:
        return f"SIGTERM from the launcher's agent, after {lost[0].describe()}"
    return f"{name} received"


def lost_peer_line(error: WorkerLostError) -> str:
    """The one line a rank shows for ``error``: which worker was lost (when this node's launcher knows) and what to
    do; else the error's own message without the transport's report that it wraps (``Connection reset by peer``)."""
    rank = os.environ.get("RANK")
    deadline = time.monotonic() + (NOTE_WAIT_S if settings.current().launch_state else 0.0)
    while True:  # the survivor may notice first: the dead worker's wrapper notes it a moment later
        lost = [worker for worker in lost_workers() if str(worker.rank) != rank]
        if lost or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if lost:
        return (
            f"rank {rank} stopped: {lost[0].describe()}. The last commit is intact: run the same command again to "
            "resume from it"
        )
    message, cause = str(error), str(error.__cause__ or "")
    if cause and message.endswith(f" ({cause})"):
        message = message[: -len(cause) - 3]
    return message


def _print_lost_peer(previous: Callable[..., Any]) -> Callable[..., Any]:
    def hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        if isinstance(value, WorkerLostError):
            print(f"{kind.__name__}: {lost_peer_line(value)}", file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    hook.tbp_lost_peer = True  # type: ignore[attr-defined]
    return hook


@contextlib.contextmanager
def one_line_for_a_lost_peer() -> Iterator[None]:
    """Around a call: a :class:`WorkerLostError` that leaves it will print as one line if nobody catches it (see
    :func:`quiet_lost_peer_traceback`)."""
    try:
        yield
    except WorkerLostError:
        quiet_lost_peer_traceback()
        raise


def quiet_lost_peer_traceback() -> None:
    """Makes an uncaught :class:`WorkerLostError` print one line instead of its traceback (once per process; every
    other exception goes to the hook that was there, torch's included). A caught one is the caller's business."""
    if not getattr(sys.excepthook, "tbp_lost_peer", False):
        sys.excepthook = _print_lost_peer(sys.excepthook)
