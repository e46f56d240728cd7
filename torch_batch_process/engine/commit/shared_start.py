"""Opening the job on every rank: rank 0 reads, checks and repairs what is stored
(:class:`~torch_batch_process.jobstore.opening.JobOpener`), and every rank gets its
:class:`~torch_batch_process.jobstore.opening.Start`, or raises what rank 0 raised, before any work."""

from __future__ import annotations

import socket

from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.errors import StorageError
from torch_batch_process.jobstore.layout import JOB_FILE
from torch_batch_process.jobstore.opening import JobOpener, Start
from torch_batch_process.storage.base import Storage

__all__ = ["open_job"]


def open_job(opener: JobOpener, collectives: Collectives, planned: int, planned_examples: int) -> Start:
    """Every rank: the :class:`Start` of this attempt (raises on every rank what rank 0 raised).

    Args:
        opener: the job's opener (rank 0 reads with it).
        collectives: the library's collectives.
        planned: the number of global batches of a fresh job (the plan's, after ``max_batches``).
        planned_examples: the examples in them.
    """
    answer = collectives.from_rank0(lambda: opener.read(planned, planned_examples), "opening the job")
    assert isinstance(answer, Start)
    if collectives.world_size > 1 and answer.finished_result is None:
        _check_shared_storage(opener.storage, collectives)
    return answer


def _check_shared_storage(storage: Storage, collectives: Collectives) -> None:
    """Every rank must see the storage rank 0 wrote (a local path must be shared by all nodes)."""
    try:
        visible = storage.exists(JOB_FILE)
    except Exception:  # noqa: BLE001
        visible = False
    everyone = collectives.all_gather((visible, socket.gethostname()))
    if not all(ok for ok, _ in everyone):
        blind = [rank for rank, (ok, _) in enumerate(everyone) if not ok]
        if storage.protocol == "memory":
            raise StorageError(
                f"storage_path {storage.url!r} is not shared by all ranks: memory:// lives in the memory of "
                f"each process, so rank(s) {blind} cannot see what rank 0 wrote. With several ranks use a local "
                "folder (one machine), a filesystem mounted on every node, or an object store URL (s3://...)"
            )
        if len({host for _, host in everyone}) == 1:  # one machine: the ranks were given different paths
            raise StorageError(
                f"storage_path {storage.url!r} is not the same on every rank: rank(s) {blind} cannot see what "
                "rank 0 wrote there, on the same machine. Give every rank the same storage_path (a path computed "
                "in each process, e.g. from a temporary folder, a pid or a time, differs between ranks)"
            )
        raise StorageError(
            f"storage_path {storage.url!r} is not shared by all ranks: rank(s) {blind} cannot see what rank "
            "0 wrote there. Use a filesystem mounted on every node (NFS, Lustre...) or an object store URL "
            "(s3://..., gs://...)"
        )
