"""The feed of a replica's members (``mesh=``, DESIGN §18): every member of a replica runs the same batch.

The replica's first member (its *source*) loads the replica's batches with the user's ``DataLoader`` (its workers,
``collate_fn``...), as any rank loads its own, and sends each one to the other members over the replica's own gloo
group (:func:`~torch_batch_process.engine.mesh.broadcast.broadcast_batch`: tensors as raw bytes, three collectives
per batch); the other members run no loader at all. The batch goes with its feed key (its id, or the
:class:`~torch_batch_process.engine.feed.batches.Cut` of a batch run in parts), so every member runs the same
``batch_idx`` with the same ``context.batch_indices``.

Under the dynamic schedule the source claims the replica's batches as its loader asks for them (the other members
claim none), and sends the end of its feed (no batch left, or a stop seen at a claim) as it sends a batch.

A batch that fails to load on the source fails on every member: the members receive the failure (its type and
message) and raise a :class:`~torch_batch_process.engine.feed.batches.LoadFailed` for that batch, so every rank of the
replica records a failure at the same step. A member lost during the broadcast is that batch's failure too (a
:class:`~torch_batch_process.errors.WorkerLostError`): the rank records it and goes on idling in step with the others
until they all stop together, rather than leaving the ranks' protocol where it stands (its collectives in flight
would then wait for it).

Why broadcast rather than each member loading: loading costs CPU on every member (tokenizing, decoding, remote reads)
and a dataset may not give the same batch twice (random augmentation, a stream); the broadcast costs the same
whatever the number of members (notes/43-mesh.md §6.2 measures both).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from torch_batch_process.engine.distributed import peers_answering
from torch_batch_process.engine.feed.batches import BatchFeed, LoadFailed, batch_id
from torch_batch_process.engine.mesh.broadcast import broadcast_batch
from torch_batch_process.errors import WorkerLostError

__all__ = ["ReplicaFeed", "SourceLoadFailed"]


class SourceLoadFailed(RuntimeError):
    """The replica's source member could not load a batch (its error, as the other members receive it)."""


class _Failed:
    """What the source sends in place of a batch that failed to load."""

    def __init__(self, batch_idx: int, error: BaseException) -> None:
        self.batch_idx = batch_idx
        self.message = f"{type(error).__name__}: {error}"


class _End:
    """What the source sends when its feed ended (the dynamic schedule: no batch left to claim, or a mark seen)."""


class ReplicaFeed:
    """An iterator of ``(key, batch)`` like :class:`~torch_batch_process.engine.feed.batches.BatchFeed`, the same on
    every member of a replica (see the module docstring).

    Args:
        order: the replica's batch order (the same on every member; what a member expects next; under the dynamic
            schedule only the source claims, and the members learn the end of the batches from it).
        feed: this rank's feed; only the source's is started (the other members' loaders never run: no worker
            process, no batch loaded; a batch's parts run again after an out-of-memory error load with its dataset and
            ``collate_fn``).
        group: the library's gloo group of the replica's members.
        source: the global rank of the replica's source member.
    """

    def __init__(self, order: Any, feed: BatchFeed, group: dist.ProcessGroup, source: int) -> None:
        self._expected = iter(order.batch_ids()) if dist.get_rank() != source else None
        self._feed = feed if dist.get_rank() == source else None
        self.loader = feed.loader
        self.watch = feed.watch
        self._group = group
        self._source = source
        self.load_error = BatchFeed.load_error

    def start(self) -> None:
        if self._feed is not None:
            self._feed.start()

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self

    def __next__(self) -> tuple[Any, Any]:
        item: Any = None
        failed: LoadFailed | None = None
        expected = next(self._expected, -1) if self._expected is not None else -1
        if self._feed is not None:
            try:
                item = next(self._feed)
            except StopIteration:  # the dynamic schedule's end (never under the static schedule's step count)
                item = _End()
            except LoadFailed as exc:
                failed = exc
                item = _Failed(exc.batch_idx, exc.error)
        try:
            with peers_answering(dist.get_rank()):  # the source (or a receiver) lost: WorkerLostError
                item = broadcast_batch(item, self._group, self._source)
        except WorkerLostError as lost:
            raise LoadFailed(failed.batch_idx if failed is not None else _id_of(item, expected), lost) from lost
        if failed is not None:
            raise failed
        if isinstance(item, _End):
            raise StopIteration
        if isinstance(item, _Failed):
            error = SourceLoadFailed(f"rank {self._source} (the replica's source) failed to load it: {item.message}")
            raise LoadFailed(item.batch_idx, error)
        return item

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()


def _id_of(item: Any, expected: int) -> int:
    """The batch id of a feed item the source could not send (``expected`` on the other members)."""
    if isinstance(item, tuple) and item:
        return batch_id(item[0])
    return item.batch_idx if isinstance(item, _Failed) else expected
