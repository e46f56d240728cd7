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
        seen_at: float | None = None
        while not self._stop.wait(POLL_S):
            try:
                if self._rank_failure.failed:
                    if not marked:
                        marked = True
                        self._store.add(self._key, 1)
                    continue
                if seen_at is None:
                    if int(self._store.add(self._key, 0)) > 0:
                        seen_at = time.monotonic()
                elif self._in_steps and time.monotonic() - seen_at >= self._grace_s:
                    self._exit()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return

    def _exit(self) -> None:
        position = self._position
        logger.error(
            "rank %d: a member of replica %d failed and this rank is still in its steps %gs later (blocked in a "
            "collective with it, which nothing else releases): ending the process so that every rank stops. "
            "Stacks of rank %d:\n%s",
            position.rank, position.replica_rank, self._grace_s, position.rank, thread_stacks(),
        )
        end_process()
