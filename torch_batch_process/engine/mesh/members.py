"""A replica's members (``mesh=``, DESIGN §18): the watch that makes every rank stop when a member of its replica
failed.

**A member that failed while its peers wait in a collective.** A tensor-parallel forward or a pipeline stage waits in
a collective of the replica's mesh groups for every member. A member killed outright closes its connections: gloo
wakes its peers' collectives at once with an error, which fails their batch. But a member whose ``process_batch``
raised (or whose loading failed) is alive: its peers stay blocked in the collective, and torch offers no way to
release a gloo collective from the member that failed while its process lives (``abort()``, ``shutdown()``,
destroying the group: notes/43-mesh.md §2). So each member runs a :class:`MemberWatch`: a failed member marks its
replica in the call's rendezvous store; a member that sees the mark and is still in its steps
``TBP_MESH_GRACE_S`` seconds later (default 10: time for a member that is not blocked to reach the ranks' agreement
and stop with them) logs its stacks and ends its process with exit code 1, as ``batch_timeout``'s watchdog does. Its
exit closes its connections, which releases whoever waited on it; the other ranks then see a lost rank and raise
(the failing rank its own exception), so no rank waits for the collective timeout.

**The store gone too.** Without torchrun the store lives in rank 0's process: when rank 0 dies while a member of
another replica raised (two faults at once), no mark can be set or read, and a member blocked in a collective with
the failed member would wait for gloo's collective timeout (30 min) for as long as that member's process lives (its
script may go on after the failed call). So the watch also ends its process when the store has stopped answering for
``TBP_MESH_GRACE_S`` seconds (every look since failed) and this rank is still in its steps: a job whose store is gone
cannot commit again, and a rank that is not blocked leaves its steps within that time (it meets the lost rank at the
ranks' next agreement or commit). A rank that failed itself waits twice as long, so that its peers, which wait on it,
go first and it raises its own exception.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from torch_batch_process import settings
from torch_batch_process.engine.rank_failure import RankFailure
from torch_batch_process.log import end_process, thread_stacks
from torch_batch_process.mesh_shape import MeshPosition

__all__ = ["MemberWatch"]

logger = logging.getLogger(__name__)

POLL_S = 0.2
"""Seconds between two looks of the watch at its rank's failure and its replica's mark."""


class MemberWatch:
    """Marks this rank's replica when this rank failed, and ends this rank when a member of its replica failed and it
    is still in its steps after the grace (see the module docstring). A daemon thread, from construction to
    :meth:`close`.

    Args:
        position: this rank's place in the mesh.
        store: the call's keys in the rendezvous store.
        rank_failure: this rank's failure.
        grace_s: ``None``: ``TBP_MESH_GRACE_S``.
    """

    def __init__(
        self, position: MeshPosition, store: Any, rank_failure: RankFailure, grace_s: float | None = None
    ) -> None:
        self._position = position
        self._store = store
        self._rank_failure = rank_failure
        self._grace_s = settings.current().mesh_grace_s if grace_s is None else grace_s
        self._key = f"mesh/failed/{position.replica_rank}"
        self._stop = threading.Event()
        self._in_steps = True
        self._store_error: BaseException | None = None
        """The store's last error while it does not answer (``None``: it answered the last look)."""
        self._thread = threading.Thread(target=self._run, name="tbp-mesh-members", daemon=True)
        self._thread.start()

    def steps_done(self) -> None:
        """This rank left its steps (it is in the ranks' closing exchange, which a lost rank ends with an error)."""
        self._in_steps = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        marked = False
        seen_at: float | None = None  # when this rank saw its replica marked failed
        lost_at: float | None = None  # since when every look at the store failed
        while not self._stop.wait(POLL_S):
            try:
                if self._rank_failure.failed:
                    # marks its replica once; then looks whether the store still answers
                    self._store.add(self._key, 0 if marked else 1)
                    marked = True
                elif seen_at is None:
                    if int(self._store.add(self._key, 0)) > 0:
                        seen_at = time.monotonic()
                elif self._in_steps and time.monotonic() - seen_at >= self._grace_s:
                    self._exit()
                lost_at, self._store_error = None, None
            except Exception as exc:  # noqa: BLE001 - the store does not answer: its host may be gone (see above)
                self._store_error = exc
                lost_at = time.monotonic() if lost_at is None else lost_at
                wait_s = self._grace_s * (2 if self._rank_failure.failed else 1)
                if self._in_steps and time.monotonic() - lost_at >= wait_s:
                    self._exit_store_lost(time.monotonic() - lost_at)

    def _exit(self) -> None:
        position = self._position
        logger.error(
            "rank %d: a member of replica %d failed and this rank is still in its steps %gs later (blocked in a "
            "collective with it, which nothing else releases): ending the process so that every rank stops. "
            "Stacks of rank %d:\n%s",
            position.rank, position.replica_rank, self._grace_s, position.rank, thread_stacks(),
        )
        end_process()

    def _exit_store_lost(self, lost_s: float) -> None:
        rank = self._position.rank
        logger.error(
            "rank %d: the job's rendezvous store has not answered for %.1fs (%s; its host, rank 0's process without "
            "torchrun, is gone, so the job cannot commit again) and this rank is still in its steps (blocked in a "
            "collective with a member that failed or left, which nothing else releases): ending the process so that "
            "every rank stops. Stacks of rank %d:\n%s",
            rank, lost_s, _describe(self._store_error), rank, thread_stacks(),
        )
        end_process()


def _describe(error: BaseException | None) -> str:
    """The store's error on one line."""
    first = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
