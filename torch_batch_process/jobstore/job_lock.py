"""The job lock: one job at a time per storage path.

Rank 0 takes the lock before its first write to storage and holds it until the job returns. The stored job picks
the lock by what its storage offers (:meth:`~torch_batch_process.jobstore.store.JobStore.take_lock`): a file of this
machine's file system, or an object store (with or without conditional writes).

**Local storage** (a local or network-mounted folder) uses an OS file lock on ``_tbp/lock``
(``filelock``; ``flock``, which Linux maps to POSIX locks on NFS). The kernel releases it when the
holding process dies, even by ``kill -9``, so a killed job never blocks its resume. The holder's
host and pid are written to ``_tbp/lock.json`` for the error message of a refused job.

**Object stores** hold a heartbeat lease instead (:mod:`torch_batch_process.jobstore.lease`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import filelock

from torch_batch_process.errors import JobLockedError
from torch_batch_process.jobstore.layout import LOCK_INFO_FILE
from torch_batch_process.processes import pid_alive
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.errors import storage_error

__all__ = [
    "FileJobLock",
    "JobLock",
    "flock_held",
    "holder_info",
    "locked_message",
    "machine_id",
]

logger = logging.getLogger(__name__)


class JobLock:
    """Held by rank 0 for the whole job (:func:`take_job_lock` takes the kind its storage allows)."""

    def release(self) -> None:
        """Releases the lock (idempotent)."""

    def check(self) -> None:
        """Raises :class:`~torch_batch_process.errors.JobLockedError` when the lock was lost (lease taken over or
        not renewable)."""


def machine_id() -> dict[str, Any]:
    """What tells whether a pid recorded by another process can be checked from here."""
    ident: dict[str, Any] = {"host": socket.gethostname()}
    for key, path in (("boot_id", "/proc/sys/kernel/random/boot_id"),):
        try:
            with open(path, encoding="ascii") as f:
                ident[key] = f.read().strip()
        except OSError:
            pass
    try:
        ident["pid_ns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return ident


def holder_info() -> dict[str, Any]:
    """Who holds a lock or lease: this machine's identity, this process and since when."""
    return {**machine_id(), "pid": os.getpid(), "since": time.time()}


class FileJobLock(JobLock):
    """An OS file lock on ``_tbp/lock`` (local and network-mounted folders).

    Args:
        storage: the local storage (its folder ``_tbp`` exists).
        lock_path: the local path of its :data:`LOCK_FILE`.
    """

    def __init__(self, storage: Storage, lock_path: str) -> None:
        self._storage = storage
        self._lock = filelock.FileLock(lock_path, timeout=0)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise JobLockedError(locked_message(storage, storage.read_json_object(LOCK_INFO_FILE))) from None
        except OSError as exc:
            raise storage_error(storage.url, "create the job lock", exc) from exc
        try:
            storage.write_json(LOCK_INFO_FILE, holder_info())
        except BaseException:
            self._lock.release()
            raise

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()

    @staticmethod
    def holder(storage: Storage, lock_path: str) -> tuple[bool | None, dict[str, Any] | None]:
        """Whether a process holds the lock now (``None``: cannot tell from this host), and who.

        Read-only: it looks at ``/proc/locks`` instead of trying to take the lock.
        """
        info = storage.read_json_object(LOCK_INFO_FILE)
        who = {"host": info.get("host"), "pid": info.get("pid")} if info else None
        same_host = not info or info.get("host") == socket.gethostname()
        held = flock_held(lock_path, info.get("pid") if info else None)
        if held:
            return True, who
        if not same_host:
            return None, who  # a lock taken on another host (NFS...) is not visible here
        if held is None:  # no /proc/locks: fall back on the holder's pid
            alive = bool(info) and isinstance(info.get("pid"), int) and pid_alive(info["pid"])
            return alive, who if alive else None
        return False, None


def locked_message(storage: Storage, info: dict[str, Any] | None) -> str:
    """The error message of a job refused because ``info``'s holder has the storage path."""
    holder = ""
    if info:
        since = info.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
        holder = f" (held by pid {info.get('pid')} on host {info.get('host')} since {when})"
    return (
        f"storage_path {storage.url!r} is in use by another running job{holder}. Two jobs cannot share a "
        "storage path: wait for that job to end, stop it, or give this job another storage_path."
    )


def flock_held(path: str, pid: Any = None) -> bool | None:
    """Whether some process holds a ``flock`` on ``path`` (Linux ``/proc/locks``), without taking it.

    A lock matches by device and inode, or by inode and the holder's ``pid`` (overlay filesystems may
    show another device number there). ``None`` when ``/proc/locks`` cannot be read.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":  # "->": a waiter, not a holder
            continue
        dev, _, inode = fields[5].rpartition(":")
        if inode == str(st.st_ino) and (dev == device or fields[4] == str(pid)):
            return True
    return False
