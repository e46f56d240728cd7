"""The ranks of a process, with Determined's ``DistributedContext`` accessors: a public type every layer may import
(``context.distributed``; the engine's :mod:`~torch_batch_process.engine.distributed` fills it in)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["DistributedInfo", "ObjectCollectives"]


class ObjectCollectives(Protocol):
    """The collectives of picklable objects that :class:`DistributedInfo` offers (the engine's
    :class:`~torch_batch_process.engine.distributed.Collectives`)."""

    def all_gather(self, obj: Any) -> list[Any]: ...

    def gather(self, obj: Any) -> list[Any] | None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


@dataclass
class DistributedInfo:
    """Ranks of this process, with Determined's ``DistributedContext`` accessors.

    Attributes:
        rank: global rank.
        size: number of processes (world size).
        local_rank: rank on this node.
        local_size: processes on this node.
        cross_rank: index of this node.
        cross_size: number of nodes.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    _collectives: ObjectCollectives | None = None

    def get_rank(self) -> int:
        return self.rank

    def get_size(self) -> int:
        return self.size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_size(self) -> int:
        return self.local_size

    def get_cross_rank(self) -> int:
        return self.cross_rank

    def get_cross_size(self) -> int:
        return self.cross_size

    def allgather(self, stuff: Any) -> list[Any]:
        """Gathers a picklable object from every rank, on every rank."""
        return self._coll().all_gather(stuff)

    def gather(self, stuff: Any) -> list[Any] | None:
        """Gathers a picklable object from every rank on rank 0 (others get ``None``)."""
        return self._coll().gather(stuff)

    def broadcast(self, stuff: Any) -> Any:
        """Returns rank 0's ``stuff`` on every rank."""
        return self._coll().broadcast(stuff)

    def _coll(self) -> ObjectCollectives:
        assert self._collectives is not None
        return self._collectives
