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

    def get_num_agents(self) -> int:
        """Number of machines (nodes) of the job, as Determined names it (``cross_size``)."""
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

    def allgather_local(self, stuff: Any) -> list[Any]:
        """Gathers a picklable object from every rank of this machine, on each of them, in local rank order.

        Every rank of the job calls it (on one machine the job's ranks are the machine's ranks; on several, the
        objects travel over the job's group and each machine keeps its own).
        """
        if self.local_size == 1:
            return [stuff]
        if self.cross_size == 1:
            return self.allgather(stuff)
        everything = self.allgather((self.cross_rank, self.local_rank, stuff))
        return [value for _, _, value in sorted((e for e in everything if e[0] == self.cross_rank), key=lambda e: e[1])]

    def gather_local(self, stuff: Any) -> list[Any] | None:
        """Gathers a picklable object from every rank of this machine on its local rank 0 (others get ``None``).

        Every rank of the job calls it, as :meth:`allgather_local`.
        """
        if self.local_size == 1:
            return [stuff]
        if self.cross_size == 1:
            return self.gather(stuff)
        local = self.allgather_local(stuff)
        return local if self.local_rank == 0 else None

    def broadcast_local(self, stuff: Any = None) -> Any:
        """Returns the ``stuff`` of this machine's local rank 0 on every rank of the machine.

        Every rank of the job calls it, as :meth:`allgather_local`.
        """
        if self.local_size == 1:
            return stuff
        if self.cross_size == 1:
            return self.broadcast(stuff)
        return self.allgather_local(stuff)[0]

    def close(self) -> None:
        """Does nothing: the library owns the job's process groups and closes them when the job returns (kept for
        code written for Determined's ``DistributedContext``)."""

    def _coll(self) -> ObjectCollectives:
        assert self._collectives is not None
        return self._collectives
