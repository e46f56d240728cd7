"""Process groups a failed call leaves behind: kept alive for the process's life, so that releasing one never hangs.

**Why.** Destroying a gloo ``ProcessGroup`` joins its worker threads, and a worker blocked in a collective with a
rank that is alive but waits itself (in its own collective, or in the same join) never returns: no error comes, since
the peer's connection stays open. When a rank dies mid-commit, the ranks next to it in the collective fail at once and
raise, while others still wait on those ranks; if a rank that raised then frees its groups (when the exception that
held the library's objects is dropped, in a garbage collection, or when the interpreter exits), its main thread waits
for its worker, the ranks waiting on it never see their connection close, and nobody exits (notes/43-mesh.md §11).
torch offers no abort for gloo (``ProcessGroup.abort`` is NCCL's).

**What.** When a call fails, :func:`keep_groups_alive` takes one more reference to every process group torch knows of
(the library's control group, the mesh's groups, the default group, the user's), which is never given back: their
destructors never run, not even at the interpreter's exit, so a rank that raised exits and its exit closes its
connections, which fails the collectives of the ranks that still wait on it, and they raise and exit in turn. The
groups stay usable (nothing is destroyed); what is lost is their memory and sockets until the process exits, once per
failed call.
"""

from __future__ import annotations

import ctypes
import logging

import torch.distributed as dist

__all__ = ["keep_groups_alive", "kept_groups"]

logger = logging.getLogger(__name__)

_KEPT: list[dist.ProcessGroup] = []
"""The groups kept (one reference each from this list, and one more the interpreter's finalization cannot drop)."""


def keep_groups_alive(*groups: dist.ProcessGroup | None) -> None:
    """Keeps ``groups`` and every process group registered with torch alive until the process exits (see the module
    docstring). Idempotent."""
    registered: list[dist.ProcessGroup] = []
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        registered = list(distributed_c10d._world.pg_map)
    for group in (*groups, *registered):
        if group is None or any(group is kept for kept in _KEPT):
            continue
        _KEPT.append(group)
        # the module list is cleared when the interpreter finalizes its modules: this reference is not
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    if _KEPT:
        logger.debug("%d process group(s) kept alive after a failed call (no join can hang)", len(_KEPT))


def kept_groups() -> tuple[dist.ProcessGroup, ...]:
    """The groups kept so far (for tests and diagnostics)."""
    return tuple(_KEPT)
