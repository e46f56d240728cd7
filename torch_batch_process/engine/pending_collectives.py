"""The library's asynchronous collectives while in flight, and what a failed call does with one left behind.

**Why.** Destroying a gloo process group joins its worker threads. A worker blocked in a collective that a live peer
never joins (the peer waits itself, on this rank, in another collective) never returns, and gloo has no abort
(``ProcessGroup.abort`` and ``shutdown`` do not stop a gloo collective in flight). So a rank that raised with one of
its collectives still in flight waited forever in the group's destructor (when it tore the group down, or when the
exception holding the library's objects was dropped), and the peers waiting on it waited with it: a cycle nothing
broke, seen when one member of a mesh job was killed just after a commit (notes/43-mesh.md §11).

**What.** Every asynchronous collective the library starts is registered until it is waited for
(:func:`started`, :func:`settled`). When a call fails with one still in flight (:func:`pending_groups`), its groups are
kept (:func:`keep_until_exit`): nothing destroys them, so no join can block the failing rank. At the interpreter's
exit such a process waits up to :data:`EXIT_WAIT_S` for them to finish (a late peer joins, or a dead peer's closed
connection fails them); if one is still in flight it ends at once, exit code 1, after flushing its output and logs,
because any later step (a group's destructor, the interpreter's finalization, where a worker finishing a collective
aborts the process) would wait forever on a peer that waits on it. The peers then see this rank's connections close,
fail their own collectives and exit in turn. A call that fails with nothing in flight tears down as usual.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

__all__ = ["EXIT_WAIT_S", "keep_until_exit", "pending_groups", "settled", "started"]

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 2.0
"""Seconds a process whose failed call left a collective in flight waits at exit for it to finish (a peer that is
only late joins within this) before it ends without waiting (see the module docstring). Short: the usual collective
left in flight is a send to a rank that died, which never finishes, and every survivor of a kill waits this long."""

_lock = threading.Lock()
_in_flight: dict[int, tuple[Any, dist.ProcessGroup | None]] = {}
"""``id(work)`` -> the work (kept alive while registered) and its group."""
_PRUNE_AT = 64
_kept: list[dist.ProcessGroup] = []
_exit_hook_registered = False


def started(work: Any, group: dist.ProcessGroup | None) -> None:
    """Registers an asynchronous collective of ``group`` (``None``: the default group) just started."""
    with _lock:
        if len(_in_flight) >= _PRUNE_AT:  # one a caller dropped without waiting (a job that ended): forget the done
            _forget_completed()
        _in_flight[id(work)] = (work, group)


def settled(work: Any) -> None:
    """Unregisters ``work`` once it was waited for (a completed or failed collective); ``None`` is ignored."""
    if work is not None:
        with _lock:
            _in_flight.pop(id(work), None)


def _forget_completed() -> None:
    """Unregisters the completed collectives (``_lock`` held)."""
    for key in [key for key, (work, _group) in _in_flight.items() if work.is_completed()]:
        del _in_flight[key]


def _pending() -> list[tuple[Any, dist.ProcessGroup | None]]:
    """The registered collectives not completed yet (completed ones are forgotten on the way)."""
    with _lock:
        _forget_completed()
        return list(_in_flight.values())


def pending_groups() -> list[dist.ProcessGroup]:
    """The groups of the library's collectives still in flight (the default group stands for ``None``)."""
    groups: list[dist.ProcessGroup] = []
    for _work, group in _pending():
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        if group is not None and not any(group is seen for seen in groups):
            groups.append(group)
    return groups


def keep_until_exit(groups: list[dist.ProcessGroup]) -> None:
    """Keeps ``groups`` alive for the process's life and makes its exit end a collective left in flight (see the
    module docstring)."""
    global _exit_hook_registered
    with _lock:
        _kept.extend(group for group in groups if not any(group is kept for kept in _kept))
        if not _exit_hook_registered:
            # registered after the library's other exit hooks, so it runs before them (atexit runs last-in first):
            # destroying the default group would join every group's worker
            atexit.register(_end_at_exit)
            _exit_hook_registered = True
    logger.debug("%d process group(s) kept alive: a failed call left a collective in flight", len(groups))


def _destroy_kept() -> None:
    """Destroys the kept groups once nothing of theirs is in flight: their workers are joined now, not during the
    interpreter's finalization (where a worker that still finishes a collective aborts the process)."""
    with _lock:
        groups, _kept[:] = list(_kept), []
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001 - the interpreter is exiting; the group may be gone already
            logger.debug("destroying a kept process group failed: %s", exc)


def _end_at_exit(wait_s: float = EXIT_WAIT_S) -> None:
    """Waits up to ``wait_s`` for the collectives left in flight; ends the process at once if one still is."""
    deadline = time.monotonic() + wait_s
    while _pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _pending()
    if not left:
        _destroy_kept()
        return
    message = (
        f"torch_batch_process: {len(left)} collective(s) of a failed call still wait on a peer that is alive but "
        f"does not take part; exiting now without waiting for them (exit code 1), so the peers see this process "
        f"end and stop too\n"
    )
    try:
        sys.stderr.write(message)
    except Exception:  # noqa: BLE001 - stderr may be closed: the exit must still happen
        pass
    logging.shutdown()  # flushes every handler (files included) before the unclean exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(1)
