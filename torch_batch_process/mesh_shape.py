"""The job's device mesh as numbers: ``mesh=`` checked, and where each rank stands in it (DESIGN §18).

``torch_batch_process(..., mesh={"replica": -1, "tp": 2})`` runs one model over several ranks. The mapping's first
entry is the data-parallel dimension, over *replicas* (``-1``: as many as the world size leaves); the others are the
user's model-parallel dimensions (tensor parallel, pipeline stages, or both), whose product ``k`` is the number of
ranks of a replica, its *members*. The world is ``R x k`` ranks.

Ranks are laid out row-major, as torch's ``init_device_mesh`` lays them (``torch.arange(W).reshape(shape)``):
replica ``r`` holds the contiguous ranks ``[r*k, (r+1)*k)``, so a replica whose ``k`` divides the processes per
node lies on one node (torchrun numbers ranks node by node). Within a replica, the *member rank* is the index of a
rank among them.

Two members have roles:

- the *source*, the replica's first member, loads a batch and sends it to the others where the library broadcasts
  batches (:mod:`torch_batch_process.engine.mesh`);
- the *writer*, the replica's **last** member, whose ``context.write`` rows, ``upload_path()`` files and reducers are
  the replica's outputs. The last member has the largest coordinate in every inner dimension, so whatever the order
  of the inner dimensions it is on the last pipeline stage (which holds a pipeline's outputs), and in a
  tensor-parallel group every member holds the outputs of a model whose last layer gathers them. No dimension needs
  a reserved name.

This module is pure arithmetic (no torch.distributed): :func:`parse_mesh` checks the argument before any work,
:meth:`MeshShape.resolve` checks it against the world size once that is known.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.integers import is_integer

__all__ = ["MeshLayout", "MeshPosition", "MeshShape", "generation_on_a_mesh", "parse_mesh"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

_EXAMPLE = "{'replica': -1, 'tp': 2}"


@dataclass(frozen=True)
class MeshShape:
    """``mesh=`` checked: dimension names, outermost (the replicas) first, and their sizes (the outer may be ``-1``)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def members(self) -> int:
        """Ranks of one replica: the product of the inner sizes (1 for a mesh of replicas only)."""
        return math.prod(self.sizes[1:])

    def describe(self) -> str:
        """The mesh as the user wrote it, e.g. ``{'replica': -1, 'tp': 2}``."""
        return "{" + ", ".join(f"{name!r}: {size}" for name, size in zip(self.names, self.sizes, strict=True)) + "}"

    def resolve(self, world_size: int) -> MeshLayout:
        """The layout over ``world_size`` ranks; raises :class:`InvalidArgumentError` (naming the sizes and the fix)
        when the world cannot be cut that way."""
        k = self.members
        inner = " x ".join(f"{n}={s}" for n, s in zip(self.names[1:], self.sizes[1:], strict=True)) or "1"
        if world_size % k:
            raise InvalidArgumentError(
                f"mesh={self.describe()}: a replica has {k} ranks ({inner}), which does not divide the job's "
                f"{world_size} ranks: start a multiple of {k} ranks ({k} or {2 * k}: torchrun --nproc-per-node, "
                f"--nnodes), or choose inner sizes whose product divides {world_size} "
                f"({', '.join(str(d) for d in _divisors(world_size))})"
            )
        replicas = world_size // k
        if self.sizes[0] not in (-1, replicas):
            raise InvalidArgumentError(
                f"mesh={self.describe()} has {self.sizes[0]} x {k} = {self.sizes[0] * k} ranks but the job has "
                f"{world_size}: start {self.sizes[0] * k} ranks, or set {self.names[0]!r}: -1 (as many replicas as "
                f"the world size allows: {replicas})"
            )
        return MeshLayout(self.names, (replicas, *self.sizes[1:]), world_size)


@dataclass(frozen=True)
class MeshPosition:
    """Where one rank stands in the job's mesh."""

    rank: int
    replica_rank: int
    """Index of this rank's replica, ``0 <= replica_rank < num_replicas``."""
    num_replicas: int
    member_rank: int
    """Index of this rank among its replica's members, ``0 <= member_rank < members``."""
    members: int
    coordinate: tuple[int, ...]
    """This rank's index along every dimension, outer first (``coordinate[0] == replica_rank``), as
    ``DeviceMesh.get_coordinate()`` gives it."""

    @property
    def first_rank(self) -> int:
        """Global rank of the replica's first member (the source of broadcast batches)."""
        return self.replica_rank * self.members

    @property
    def writer_rank(self) -> int:
        """Global rank of the replica's writer, its last member (see the module docstring)."""
        return self.first_rank + self.members - 1

    @property
    def is_writer(self) -> bool:
        """Whether this rank's outputs are its replica's."""
        return self.rank == self.writer_rank

    @property
    def is_source(self) -> bool:
        """Whether this rank is its replica's first member."""
        return self.rank == self.first_rank


@dataclass(frozen=True)
class MeshLayout:
    """A mesh resolved against the world size: every dimension's size known."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    world_size: int

    @property
    def num_replicas(self) -> int:
        return self.shape[0]

    @property
    def members(self) -> int:
        """Ranks of one replica."""
        return math.prod(self.shape[1:])

    def replica_ranks(self, replica: int) -> range:
        """Global ranks of replica ``replica``'s members, in member order."""
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} is not in [0, {self.num_replicas})")
        return range(replica * self.members, (replica + 1) * self.members)

    def replicas(self) -> list[list[int]]:
        """Every replica's ranks, in replica order (``dist.new_subgroups_by_enumeration``'s argument)."""
        return [list(self.replica_ranks(r)) for r in range(self.num_replicas)]

    def position(self, rank: int) -> MeshPosition:
        """Where ``rank`` stands."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, {self.world_size})")
        coordinate = []
        rest = rank
        for size in reversed(self.shape):
            coordinate.append(rest % size)
            rest //= size
        replica, member = divmod(rank, self.members)
        return MeshPosition(rank, replica, self.num_replicas, member, self.members, tuple(reversed(coordinate)))


def parse_mesh(mesh: Any) -> MeshShape | None:
    """Checks ``mesh=``: ``None`` (every rank its own replica, no device mesh), or a mapping of dimension names to
    sizes, outermost (the replicas) first. Raises :class:`InvalidArgumentError` naming the problem and the fix."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mapping) or not mesh:
        raise InvalidArgumentError(
            f"mesh must be None or a non-empty dict of dimension names to sizes, the outer one the replicas "
            f"(data parallel), e.g. {_EXAMPLE}; got {mesh!r}"
        )
    names: list[str] = []
    sizes: list[int] = []
    for position, (name, size) in enumerate(mesh.items()):
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgumentError(
                f"mesh: dimension name {name!r} must be a string of letters, digits and underscores that does not "
                f"start with a digit, e.g. 'replica', 'tp', 'pp'"
            )
        if not is_integer(size) or not (size >= 1 or (size == -1 and position == 0)):
            where = (
                "an int >= 1, or -1 for as many replicas as the world size leaves"
                if position == 0
                else "an int >= 1 (only the outer dimension, the replicas, may be -1)"
            )
            raise InvalidArgumentError(f"mesh: the size of {name!r} must be {where}; got {size!r} in {mesh!r}")
        names.append(name)
        sizes.append(int(size))
    lowered = [n.lower() for n in names]
    duplicated = sorted({n for n in names if lowered.count(n.lower()) > 1})
    if duplicated:
        raise InvalidArgumentError(
            f"mesh: dimension names must differ by more than case, got {', '.join(map(repr, duplicated))}"
        )
    return MeshShape(tuple(names), tuple(sizes))


def generation_on_a_mesh(members: int) -> str:
    """Why a generation engine (DESIGN §19) is refused on replicas of several ranks, and what to do instead: every
    member would run an engine of its own, whose background loop steps on its own clock (a model split over the
    members would meet its peers' collectives out of step and hang; a whole model on each member would generate every
    prompt ``members`` times)."""
    return (
        f"a generation engine (generation.Generate, context.use_generation_engine) cannot run on a mesh= whose "
        f"replicas have {members} ranks: each rank would run an engine of its own, stepping on its own clock, so a "
        f"model split over them would wait on its peers out of step, and a whole model on each would answer every "
        f"prompt {members} times. Run one rank per model (no mesh=, or inner sizes of 1), or an engine that splits "
        f"the model over its GPUs itself (generation.VLLMEngine with tensor_parallel_size: docs/mesh.md, 'Engines "
        f"that own their GPUs')"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
