"""The job lock: one job at a time per storage path.

Local storage uses an OS file lock (``filelock``): the kernel releases it when the holding process
dies, even by ``kill -9``, so a killed job never blocks its resume. The lock holder's host and pid
are written next to it, for the error message of a refused job.

Object stores have no locks, so a *lease* object is used: the holder writes
``{owner, host, pid, heartbeat, ttl}`` and a background thread rewrites it every few seconds. A
second job that finds a lease watches it: if its heartbeat advances, the holder is alive and the
job is refused; if it stays still for longer than the TTL (the holder was killed), the lease is
taken over. A lease of a process on this very host that no longer exists is taken over at once.
Limits: without conditional writes two jobs starting within the same instant could both take an
expired lease; the loser notices at its next heartbeat (it reads back another owner) and stops.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import filelock

from torch_batch_process.errors import JobLockedError, StorageError
from torch_batch_process.storage import Storage

logger = logging.getLogger(__name__)

LOCK_FILE = "_tbp/lock"
LOCK_INFO_FILE = "_tbp/lock.json"
LEASE_FILE = "_tbp/lease.json"

LEASE_TTL_S = float(os.environ.get("TBP_LEASE_TTL_S", "15"))
LEASE_HEARTBEAT_S = LEASE_TTL_S / 5


class JobLock:
    """Held by rank 0 for the whole job. Use :func:`acquire_job_lock` to get one."""

    def release(self) -> None:
        """Releases the lock (idempotent)."""

    def check(self) -> None:
        """Raises :class:`JobLockedError` when the lock was lost (lease taken over)."""


def acquire_job_lock(storage: Storage) -> JobLock:
    """Takes the job lock of ``storage`` or raises :class:`JobLockedError` naming the holder."""
    if storage.is_local:
        return _LocalLock(storage)
    return _LeaseLock(storage)


def _holder_info() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


class _LocalLock(JobLock):
    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        storage.makedirs("_tbp")
        self._lock = filelock.FileLock(storage.path(LOCK_FILE), timeout=0)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise JobLockedError(_locked_message(storage, _read_info(storage, LOCK_INFO_FILE))) from None
        except OSError as exc:
            raise StorageError(f"storage {storage.url!r}: cannot create the job lock: {exc}") from exc
        storage.write_json(LOCK_INFO_FILE, _holder_info())

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()


class _LeaseLock(JobLock):
    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._owner = uuid.uuid4().hex
        self._lost = False
        self._stop = threading.Event()
        self._take()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="tbp-lease", daemon=True)
        self._thread.start()

    def _lease(self, heartbeat: int) -> dict[str, Any]:
        return {**_holder_info(), "owner": self._owner, "heartbeat": heartbeat, "ttl": LEASE_TTL_S}

    def _take(self) -> None:
        current = _read_info(self._storage, LEASE_FILE)
        if current and current.get("owner") != self._owner and not self._stale(current):
            raise JobLockedError(_locked_message(self._storage, current))
        self._beat = 0
        self._storage.write_json(LEASE_FILE, self._lease(self._beat))
        # Read back: if another job wrote in the same instant, the last writer wins and the other leaves.
        time.sleep(0.05)
        back = _read_info(self._storage, LEASE_FILE)
        if not back or back.get("owner") != self._owner:
            raise JobLockedError(_locked_message(self._storage, back))

    def _stale(self, lease: dict[str, Any]) -> bool:
        """Whether the holder of ``lease`` is gone: dead pid on this host, or no heartbeat for a TTL."""
        if lease.get("host") == socket.gethostname() and isinstance(lease.get("pid"), int):
            if not _pid_alive(lease["pid"]):
                return True
        ttl = float(lease.get("ttl", LEASE_TTL_S))
        deadline = time.monotonic() + ttl * 1.5
        beat = lease.get("heartbeat")
        logger.info("storage %s: waiting up to %.0fs to see whether the job holding it is alive", self._storage.url, ttl * 1.5)
        while time.monotonic() < deadline:
            time.sleep(min(1.0, ttl / 10))
            now = _read_info(self._storage, LEASE_FILE)
            if not now:
                return True
            if now.get("owner") != lease.get("owner") or now.get("heartbeat") != beat:
                return False
        return True

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(LEASE_HEARTBEAT_S):
            try:
                current = _read_info(self._storage, LEASE_FILE)
                if current and current.get("owner") != self._owner:
                    self._lost = True
                    logger.error("storage %s: the job lease was taken over by another job", self._storage.url)
                    return
                self._beat += 1
                self._storage.write_json(LEASE_FILE, self._lease(self._beat))
            except Exception as exc:  # noqa: BLE001 - keep beating through transient errors
                logger.warning("storage %s: lease heartbeat failed: %s", self._storage.url, exc)

    def check(self) -> None:
        if self._lost:
            raise JobLockedError(f"storage {self._storage.url!r}: the job lease was taken over by another job")

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            current = _read_info(self._storage, LEASE_FILE)
            if current and current.get("owner") == self._owner:
                self._storage.delete(LEASE_FILE)
        except Exception as exc:  # noqa: BLE001 - a leftover lease expires by itself
            logger.warning("storage %s: could not remove the job lease: %s", self._storage.url, exc)


def _read_info(storage: Storage, rel: str) -> dict[str, Any] | None:
    try:
        value = storage.read_json(rel)
    except (FileNotFoundError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _locked_message(storage: Storage, info: dict[str, Any] | None) -> str:
    holder = ""
    if info:
        since = info.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
        holder = f" (held by pid {info.get('pid')} on host {info.get('host')} since {when})"
    return (
        f"storage_path {storage.url!r} is in use by another running job{holder}. Two jobs cannot share a "
        "storage path: wait for that job to end, stop it, or give this job another storage_path."
    )


def describe_lock(storage: Storage) -> str:
    """One line about the lock state, for ``tbp status``."""
    info = _read_info(storage, LEASE_FILE if not storage.is_local else LOCK_INFO_FILE)
    return json.dumps(info) if info else "none"
