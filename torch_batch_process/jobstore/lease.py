"""The job lease of object stores: one job at a time per storage path where there are no locks.

**Object stores** have no locks, so the job holds a *lease*: the object ``_tbp/lease.json`` =
``{owner, host, pid, heartbeat, ttl...}``, rewritten by a background thread every ``ttl / 5``
seconds (``ttl`` = ``TBP_LEASE_TTL_S``, default 15). A second job that finds a lease:

- refuses at once when the lease's heartbeat advances while it watches (the holder is alive);
- takes it over when the holder ran on this very host (same boot and pid namespace) and its
  process no longer exists: a resume after ``kill -9`` on the same machine is immediate;
- otherwise takes it over when the heartbeat has not moved for ``1.5 * ttl``: a resume on another
  machine after the holder was killed waits at most that long (about 22 s by default).

On S3 every lease write is conditional (``If-None-Match: *`` to create, ``If-Match: <etag>`` to renew
or take over), so two jobs racing for the lease cannot both win, and a holder whose lease was taken
over learns it at its next heartbeat. A holder that cannot renew its lease for ``ttl`` seconds
(storage unreachable) considers it lost. Rank 0 checks the lease before writing each commit record
and fails the job with :class:`JobLockedError` when it was lost, so a job never commits after
another one took over.

Limits: the guarantee rests on clocks *ticking* at the same rate on both machines (not on synchronized
clocks), and on the holder not pausing for longer than ``ttl / 2`` between checking its lease and
writing a commit record (a frozen VM, SIGSTOP). On backends without conditional writes (``memory://``,
``gs://``, other fsspec protocols, S3-compatible stores answering 501 to the condition headers), the
lease is written then read back; two jobs starting within the same fraction of a second could both take an expired
lease, and the loser notices at its next heartbeat (within ``ttl / 5``) and stops before its next
commit. Keep a storage path to one job, and use ``TBP_LEASE_TTL_S`` larger than the longest pause
the holder may suffer (long GC pauses, a suspended VM).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

from torch_batch_process import settings
from torch_batch_process.errors import JobLockedError, StorageError
from torch_batch_process.jobstore.job_lock import JobLock, holder_info, locked_message, machine_id
from torch_batch_process.jobstore.layout import LEASE_FILE
from torch_batch_process.processes import pid_alive
from torch_batch_process.storage.base import ConditionalWrites, ConditionFailed, Storage

__all__ = ["LeaseJobLock", "lease_ttl_s"]

logger = logging.getLogger(__name__)

_READ_BACK_DELAY_S = 0.2

def lease_ttl_s() -> float:
    """Lease time-to-live in seconds (``TBP_LEASE_TTL_S``, default 15)."""
    return settings.current().lease_ttl_s


class LeaseJobLock(JobLock):
    """A heartbeat lease on ``_tbp/lease.json`` (object stores; see the module docstring).

    Args:
        storage: the object store.
        conditional: its conditional writes, where it has them (S3); ``None``: write then read back.
    """

    GRACE = 3.0
    """:meth:`holder`: a lease whose last heartbeat is older than this many TTLs belongs to a job that is gone."""

    def __init__(self, storage: Storage, conditional: ConditionalWrites | None = None) -> None:
        self._storage = storage
        self._conditional = conditional  # None: written then read back (see the module docstring)
        self._ttl = lease_ttl_s()
        self._owner = uuid.uuid4().hex
        self._since = time.time()
        self._beat = 0
        self._version: str | None = None
        self._lost: str | None = None
        self._renewed = time.monotonic()
        self._stop = threading.Event()
        self._take()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="tbp-lease", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- taking

    def _lease(self) -> bytes:
        value = {
            **holder_info(),
            "since": self._since,
            "owner": self._owner,
            "heartbeat": self._beat,
            "ttl": self._ttl,
            "renewed": time.time(),
        }
        return json.dumps(value, sort_keys=True).encode("utf-8")

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """The current lease and its version (``None, None`` when there is none)."""
        try:
            if self._conditional is not None:
                raw, version = self._conditional.read_versioned(LEASE_FILE)
            else:
                raw, version = self._storage.read_bytes(LEASE_FILE), None
        except FileNotFoundError:
            return None, None
        try:
            value = json.loads(raw.decode("utf-8"))
        except ValueError:
            value = None
        if not isinstance(value, dict):
            value = {"owner": "?", "heartbeat": raw.hex()[:64]}  # unreadable: treated as a silent holder
        return value, version

    def _take(self) -> None:
        for _ in range(5):
            current, version = self._read()
            if current is not None:
                stale, current, version = self._watch(current, version)
                if not stale:
                    raise JobLockedError(locked_message(self._storage, current))
                if current is None:
                    continue  # released while watching
                logger.warning(
                    "storage %s: taking over the job lease of pid %s on host %s, which stopped renewing it",
                    self._storage.url,
                    current.get("pid"),
                    current.get("host"),
                )
            sent = time.monotonic()  # the lease counts from before the write (see _renew)
            if self._write_lease(if_version=version, create=current is None):
                self._renewed = sent
                return
        current, _ = self._read()
        raise JobLockedError(locked_message(self._storage, current))

    def _write_lease(self, *, if_version: str | None, create: bool) -> bool:
        """Writes our lease over the version read (or only if absent); False when another job won."""
        if self._conditional is not None:
            try:
                return self._write_lease_conditional(if_version=if_version, create=create)
            except StorageError as exc:
                if not _unsupported(exc):
                    raise
                self._fall_back(exc)
        self._storage.write_bytes(LEASE_FILE, self._lease())
        time.sleep(_READ_BACK_DELAY_S)  # let a writer racing us land, then see who won
        current, _ = self._read()
        return current is not None and current.get("owner") == self._owner

    def _write_lease_conditional(self, *, if_version: str | None, create: bool) -> bool:
        assert self._conditional is not None
        try:
            self._version = self._conditional.write_conditional(
                LEASE_FILE, self._lease(), if_version=None if create else if_version
            )
            return True
        except ConditionFailed:
            # Lost the race, or our own first attempt succeeded but its answer was lost: look.
            current, version = self._read()
            if current is not None and current.get("owner") == self._owner:
                self._version = version
                return True
            return False

    def _fall_back(self, exc: BaseException) -> None:
        logger.warning(
            "storage %s: the object store does not support conditional writes (%s); the job lease falls back to "
            "write-and-read-back, a weaker guarantee (see torch_batch_process.jobstore.lease)",
            self._storage.url,
            exc,
        )
        self._conditional = None
        self._version = None

    def _watch(
        self, lease: dict[str, Any], version: str | None
    ) -> tuple[bool, dict[str, Any] | None, str | None]:
        """Whether the holder of ``lease`` is gone; returns the last lease and version seen."""
        if _holder_is_dead_here(lease):
            return True, lease, version
        try:
            ttl = float(lease.get("ttl", self._ttl))
        except (TypeError, ValueError):
            ttl = self._ttl
        window = 1.5 * ttl
        logger.info(
            "storage %s: a job lease exists; watching its heartbeat for up to %.0fs to see whether its holder is alive",
            self._storage.url,
            window,
        )
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            time.sleep(min(1.0, ttl / 10))
            now, now_version = self._read()
            if now is None:
                return True, None, None
            if now.get("owner") != lease.get("owner") or now.get("heartbeat") != lease.get("heartbeat"):
                return False, now, now_version
            if _holder_is_dead_here(now):
                return True, now, now_version
            version = now_version if now_version is not None else version
        return True, lease, version

    # ----------------------------------------------------------------- holding

    def _heartbeat_loop(self) -> None:
        interval = self._ttl / 5
        while not self._stop.wait(interval):
            if not self._expired():
                try:
                    self._renew()
                except Exception as exc:  # noqa: BLE001 - keep beating through transient errors
                    logger.warning("storage %s: job lease heartbeat failed: %s", self._storage.url, exc)
            if self._lost or self._expired():
                logger.error("storage %s: %s", self._storage.url, self._lost)
                return

    def _expired(self) -> bool:
        """Marks the lease lost when it was not renewed for a TTL, and says so.

        This process was paused (SIGSTOP, a frozen VM) or storage was out of reach: another job may
        have taken the lease over, and even finished and released it, so that renewing now could
        succeed and hide it. An expired lease is therefore never renewed.
        """
        if time.monotonic() - self._renewed <= self._ttl:
            return False
        self._lost = (
            f"the job lease expired: it was not renewed for more than {self._ttl:.0f}s (process paused or "
            "storage unreachable); another job may have taken it over, so this job stops before its next commit"
        )
        return True

    def _renew(self) -> None:
        """Renews the lease. The renewal counts from *before* the request: a process paused while the
        request was in flight (or just after it returned) must not count the pause as held time."""
        self._beat += 1
        sent = time.monotonic()
        if self._conditional is not None:
            try:
                self._version = self._conditional.write_conditional(LEASE_FILE, self._lease(), if_version=self._version)
                self._renewed = sent
                return
            except ConditionFailed:
                current, version = self._read()
                if current is not None and current.get("owner") == self._owner:
                    self._version = version  # our previous renewal landed but its answer was lost
                    self._renewed = sent
                    return
                self._lost = "the job lease was taken over by another job"
                return
            except StorageError as exc:
                if not _unsupported(exc):
                    raise
                self._fall_back(exc)
        current, _ = self._read()
        if current is None or current.get("owner") != self._owner:
            self._lost = "the job lease was taken over by another job"
            return
        self._storage.write_bytes(LEASE_FILE, self._lease())
        self._renewed = sent

    def check(self) -> None:
        if self._lost:
            raise JobLockedError(f"storage_path {self._storage.url!r}: {self._lost}; the commit was not written")
        if time.monotonic() - self._renewed > self._ttl:
            raise JobLockedError(
                f"storage_path {self._storage.url!r}: the job lease was not renewed for {self._ttl:.0f}s; "
                "the commit was not written"
            )

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=30)
        if self._lost:
            return
        try:
            current, _ = self._read()
            if current is not None and current.get("owner") == self._owner:
                self._storage.delete(LEASE_FILE)
        except Exception as exc:  # noqa: BLE001 - a leftover lease expires by itself
            logger.warning("storage %s: could not remove the job lease: %s", self._storage.url, exc)

    @classmethod
    def holder(cls, storage: Storage) -> tuple[bool | None, dict[str, Any] | None]:
        """Whether a job holds a live lease now (its heartbeat is recent), and who. Read-only."""
        lease = storage.read_json_object(LEASE_FILE)
        if not lease:
            return False, None
        heartbeat = lease.get("renewed", lease.get("since"))  # time of the last heartbeat
        ttl = float(lease.get("ttl", 15.0))
        alive = isinstance(heartbeat, (int, float)) and time.time() - heartbeat < cls.GRACE * ttl
        return alive, ({"host": lease.get("host"), "pid": lease.get("pid")} if alive else None)


def _unsupported(exc: BaseException) -> bool:
    """Whether a conditional write failed because the store does not implement the condition headers."""
    text = f"{exc} {exc.__cause__}".lower()
    return "notimplemented" in text or "not implemented" in text or " 501" in text


def _holder_is_dead_here(lease: dict[str, Any]) -> bool:
    """Whether ``lease`` was taken by a process of this machine (same boot, same pid namespace) that is gone."""
    here = machine_id()
    if lease.get("host") != here["host"] or not isinstance(lease.get("pid"), int):
        return False
    for key in ("boot_id", "pid_ns"):
        if key in here and lease.get(key) != here[key]:
            return False
    return not pid_alive(lease["pid"])
