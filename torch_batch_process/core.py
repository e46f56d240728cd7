"""Determined's ``determined.core`` names that batch-processing code uses: :class:`DistributedContext`.

Code written for Determined passes ``distributed_context=det.core.DistributedContext.from_torch_distributed()`` to
``torch_batch_process``; with only the import changed (``import torch_batch_process as det``) that runs here. The
job always runs on ``torch.distributed``: the context states the ranks the caller expects (a mismatch with the
job's ranks is an error raised before any work), and its object collectives (``allgather``, ``gather``,
``broadcast`` and their ``_local`` forms) run over torch.distributed's default process group, not over Determined's
ZeroMQ sockets (``chief_ip`` and the port arguments are accepted and unused). Inside a processor,
``context.distributed`` is the job's own context with the same methods.
"""

from __future__ import annotations

import os
from typing import Any

from torch_batch_process.distributed_info import DistributedInfo, ObjectCollectives
from torch_batch_process.errors import InvalidArgumentError

__all__ = ["DistributedContext"]

_RANK_NAMES = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")


class DistributedContext(DistributedInfo):
    """The ranks of this process, as Determined's ``core.DistributedContext`` gives them.

    Build it with :meth:`from_torch_distributed` (torchrun's environment), :meth:`from_deepspeed`,
    :meth:`from_horovod`, or from the six ranks as keywords. All six or none: none means one process.

    Args:
        rank: global rank.
        size: number of processes.
        local_rank: rank on this machine.
        local_size: processes on this machine.
        cross_rank: index of this machine.
        cross_size: number of machines.
        chief_ip, pub_port, pull_port, port_offset, force_tcp: Determined's ZeroMQ settings, accepted for
            compatibility and unused (the collectives run over torch.distributed).
    """

    def __init__(
        self,
        *,
        rank: int | None = None,
        size: int | None = None,
        local_rank: int | None = None,
        local_size: int | None = None,
        cross_rank: int | None = None,
        cross_size: int | None = None,
        chief_ip: str | None = None,
        pub_port: int | None = None,
        pull_port: int | None = None,
        port_offset: int = 0,
        force_tcp: bool = False,
    ) -> None:
        values = (rank, size, local_rank, local_size, cross_rank, cross_size)
        given = sum(value is not None for value in values)
        if given not in (0, len(values)):
            missing = [name for name, value in zip(_RANK_NAMES, values, strict=True) if value is None]
            raise InvalidArgumentError(
                f"DistributedContext takes all of {', '.join(_RANK_NAMES)} or none of them (one process); "
                f"missing: {', '.join(missing)}"
            )
        ranks = dict(zip(_RANK_NAMES, values if given else (0, 1, 0, 1, 0, 1), strict=True))
        for name, value in ranks.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"DistributedContext's {name} must be an int, got {value!r}")
        for index, count in (("rank", "size"), ("local_rank", "local_size"), ("cross_rank", "cross_size")):
            if not 0 <= ranks[index] < ranks[count]:
                raise InvalidArgumentError(
                    f"DistributedContext's {index} must be in [0, {count}), got {index}={ranks[index]}, "
                    f"{count}={ranks[count]}"
                )
        super().__init__(**ranks)
        self.chief_ip = chief_ip

    @classmethod
    def from_torch_distributed(cls, chief_ip: str | None = None) -> DistributedContext:
        """The ranks torchrun (or ``tbp run``) sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``GROUP_RANK`` and ``GROUP_WORLD_SIZE``."""
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
        return cls(**_ranks_from_environment(names, "from_torch_distributed"), chief_ip=chief_ip)

    @classmethod
    def from_deepspeed(cls, chief_ip: str | None = None) -> DistributedContext:
        """The ranks DeepSpeed's launcher sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_SIZE``,
        ``CROSS_RANK`` and ``CROSS_SIZE``."""
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
        return cls(**_ranks_from_environment(names, "from_deepspeed"), chief_ip=chief_ip)

    @classmethod
    def from_horovod(cls, hvd: Any, chief_ip: str | None = None) -> DistributedContext:
        """The ranks of an initialized ``horovod`` module (``hvd.rank()``, ``hvd.size()``...)."""
        return cls(
            rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size(),
            cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(), chief_ip=chief_ip,
        )

    def _coll(self) -> ObjectCollectives:
        """The engine's collectives over torch.distributed's default process group, made when used (the caller or a
        job initializes the group; one process needs none)."""
        import torch.distributed as dist

        from torch_batch_process.engine.distributed import Collectives

        if self.size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedContext's collectives run over torch.distributed's default process group, which is not "
                "initialized: call torch.distributed.init_process_group() first, or use context.distributed inside "
                "the processor (the job's own ranks)"
            )
        return Collectives(None, self.rank, self.size)


def _ranks_from_environment(names: tuple[str, ...], method: str) -> dict[str, int]:
    """The six ranks read from the environment variables ``names`` (in :data:`_RANK_NAMES`' order)."""
    missing = [name for name in names if name not in os.environ]
    if missing:
        raise InvalidArgumentError(
            f"DistributedContext.{method}() reads {', '.join(names)} from the environment, and "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: start the script with torchrun "
            "or `tbp run` (which set them), or pass distributed_context=None (the job reads its ranks itself)"
        )
    ranks: dict[str, int] = {}
    for key, name in zip(_RANK_NAMES, names, strict=True):
        try:
            ranks[key] = int(os.environ[name])
        except ValueError:
            raise InvalidArgumentError(
                f"DistributedContext.{method}(): {name}={os.environ[name]!r} is not an integer"
            ) from None
    return ranks
