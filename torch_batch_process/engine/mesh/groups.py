"""The job's ``DeviceMesh`` and the library's group per replica, created over the job's default process group.

:func:`build_job_mesh` runs on every rank at the same point of a call, after the library's control group exists
and before the processor is built (its ``__init__`` parallelizes the model over ``context.mesh``). It creates:

- ``device_mesh``: torch's ``DeviceMesh`` with the user's dimension names (``init_device_mesh``), on the job's
  device type: gloo groups on CPU, NCCL on CUDA. Its groups are communicators of their own: a tensor-parallel
  collective never queues behind a collective of the user's default group, nor behind the library's control group
  (gloo, see :mod:`~torch_batch_process.engine.distributed`), and the other way round;
- ``replica_group``: a gloo group of this replica's members (``None`` for a replica of one rank), the library's: the
  batch a replica's first member sends to the others (:mod:`~torch_batch_process.engine.mesh.broadcast`), and any
  agreement inside a replica, on CPU memory, never on the user's device streams.

Both are kept for the process's life, keyed by the default group and the layout (as the library keeps the default
group it created, see :mod:`~torch_batch_process.engine.distributed`): creating groups again in each call of a
script that calls :func:`~torch_batch_process.torch_batch_process` several times would only add connections, and
torch cannot release a ``DeviceMesh``'s groups while the user's model (its ``DTensor`` parameters) holds the mesh.

Verified with torch 2.14 on CPU (gloo, 4 processes as 2 replicas x 2): tensor parallel (``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel``) and ``torch.distributed.pipelining`` (``PipelineStage`` on
``mesh["pp"].get_group()``, ``ScheduleGPipe``) run on these groups next to the control group; see
notes/43-mesh.md for what works on gloo and what does not.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torch_batch_process.engine.join import connect_timeout
from torch_batch_process.errors import InvalidArgumentError, WorkerLostError
from torch_batch_process.mesh_shape import MeshLayout, MeshPosition, MeshShape

__all__ = ["JobMesh", "build_job_mesh", "check_job_mesh", "open_job_mesh"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobMesh:
    """This rank's view of the job's mesh."""

    layout: MeshLayout
    position: MeshPosition
    device_mesh: DeviceMesh
    """``context.mesh``: the user's dimension names, outer (the replicas) first."""
    replica_group: dist.ProcessGroup | None
    """The library's gloo group of this replica's members; ``None`` when a replica is one rank."""

    @property
    def units(self) -> tuple[int, int]:
        """What the static schedule deals batches over: this rank's replica and the number of replicas."""
        return self.position.replica_rank, self.position.num_replicas


_BUILT: dict[tuple[Any, ...], tuple[Any, JobMesh]] = {}
"""Meshes built in this process: key -> (the default group they were built over, the mesh)."""


def build_job_mesh(layout: MeshLayout, device: torch.device, timeout: datetime.timedelta) -> JobMesh:
    """This rank's :class:`JobMesh` over the job's default process group (initialized, ``layout.world_size``
    ranks), built on the first call with this layout and reused by the later ones.

    A collective over the default group: every rank calls it, at the same point, with the same layout. ``timeout``
    is the replica group's collective timeout."""
    if not dist.is_initialized():
        raise RuntimeError("build_job_mesh needs the job's default process group (initialize it first)")
    world = dist.group.WORLD
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"the mesh is laid out for {layout.world_size} ranks, the job has {dist.get_world_size()}")
    key = (device.type, layout.names, layout.shape)
    built = _BUILT.get(key)
    if built is not None and built[0] is world:
        return built[1]
    position = layout.position(dist.get_rank())
    replica_group = None
    # the groups connect under the connect timeout, then get the collective timeout (see _connecting)
    settable = hasattr(dist, "set_timeout")
    connect = connect_timeout() if settable else timeout
    with _connecting(position.rank):
        options = _gloo_options(device, layout, connect)
        device_mesh = init_device_mesh(device.type, layout.shape, mesh_dim_names=layout.names, backend_override=options)
        if layout.members > 1:
            # every rank creates every replica's group (new_group is a collective over the default group), keeps its
            # own
            replica_group, _ = dist.new_subgroups_by_enumeration(layout.replicas(), timeout=connect, backend="gloo")
    if settable:
        for group in [*(device_mesh.get_group(n) for n in layout.names if device.type == "cpu"), replica_group]:
            if group is not None:
                dist.set_timeout(timeout, group)
    mesh = JobMesh(layout, position, device_mesh, replica_group)
    _BUILT[key] = (world, mesh)
    return mesh


@contextlib.contextmanager
def _connecting(rank: int) -> Iterator[None]:
    """Around the creation of the mesh's groups, which connect under the connect timeout
    (:func:`~torch_batch_process.engine.join.connect_timeout`, as the library's own group does): a peer killed before
    it connected would otherwise keep the others waiting for the collective timeout (30 min). Such a failure is a
    :class:`~torch_batch_process.errors.WorkerLostError` saying so."""
    try:
        yield
    except (RuntimeError, ConnectionError, TimeoutError) as exc:
        raise WorkerLostError(
            f"rank {rank}: connecting the groups of mesh= failed after every rank joined the job: a rank stopped "
            f"meanwhile (see the other ranks' logs) ({type(exc).__name__}: {str(exc).strip()[:300]})"
        ) from exc


def _gloo_options(device: torch.device, layout: MeshLayout, connect: datetime.timedelta) -> dict[str, Any] | None:
    """``init_device_mesh``'s ``backend_override`` on CPU: gloo groups created with the ``connect`` timeout (torch
    gives them the default group's 30 min otherwise); ``None`` on GPUs (NCCL communicators)."""
    if device.type != "cpu":
        return None
    options: dict[str, Any] = {}
    for name in layout.names:
        gloo = dist.ProcessGroupGloo._Options()
        gloo._timeout = connect
        options[name] = ("gloo", gloo)
    return options


def check_job_mesh(shape: MeshShape, world_size: int, device: torch.device) -> MeshLayout:
    """``mesh=`` against the job whose ranks joined: its layout over ``world_size`` ranks
    (:meth:`~torch_batch_process.mesh_shape.MeshShape.resolve`) and, on GPUs, the job's NCCL group. Raises the same
    :class:`~torch_batch_process.errors.InvalidArgumentError` on every rank; the call runs it as soon as the ranks
    joined, before any planning or storage access (a keyed job's or a retry's included)."""
    layout = shape.resolve(world_size)
    if device.type == "cuda" and dist.is_initialized() and dist.get_backend() != "nccl":
        raise InvalidArgumentError(
            f"mesh={shape.describe()} on GPUs needs one process per GPU (the job's process group is "
            f"{dist.get_backend()}, not NCCL): start as many processes per node as it has GPUs"
        )
    return layout


def open_job_mesh(
    shape: MeshShape | None, world_size: int, device: torch.device, timeout: datetime.timedelta, local_size: int = 1
) -> JobMesh | None:
    """Every rank, at the same point of a call, once the ranks joined: the :class:`JobMesh` of ``mesh=`` (``None``
    without one).

    The layout is checked first (:func:`check_job_mesh`, which the call already ran: the same
    :class:`~torch_batch_process.errors.InvalidArgumentError` on every rank, before any work). A job of one process
    has no process group: it gets a process group of its own (kept for the process's life, as the job's default
    group is), so that ``context.mesh`` is a real ``DeviceMesh`` (a 1 x 1 mesh on one GPU runs the NCCL path).
    ``local_size``: processes per node (rank 0 warns when a replica would span two nodes)."""
    if shape is None:
        return None
    layout = check_job_mesh(shape, world_size, device)
    if world_size == 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        extra: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **extra)
    mesh = build_job_mesh(layout, device, timeout)
    if mesh.position.rank == 0 and layout.members > 1 and local_size % layout.members:
        logger.warning(
            "mesh=%s: a replica has %d ranks but %d processes run per node, so some replicas span two nodes (their "
            "tensor-parallel collectives then cross the network): start a multiple of %d processes per node",
            shape.describe(), layout.members, local_size, layout.members,
        )
    return mesh
