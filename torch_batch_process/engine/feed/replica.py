"""The feed of a replica's members (``mesh=``, DESIGN §18): every member of a replica runs the same batch.

The replica's first member (its *source*) loads the replica's batches with the user's ``DataLoader`` (its workers,
``collate_fn``...), as any rank loads its own; the other members run no loader at all. Before each step the members
exchange one message (:class:`~torch_batch_process.engine.mesh.exchange.StepMessages`, one ``all_gather`` over the
replica's own gloo group): every member's status, the source's mark (the dynamic schedule's stop or failure seen at a
claim) and the step's batch, packed (:func:`~torch_batch_process.engine.mesh.broadcast.pack_message`: tensors as raw
bytes). :meth:`ReplicaFeed.exchange` runs it; the step's ``next()`` then hands out the batch it brought. The batch goes
with its feed key (its id, or the :class:`~torch_batch_process.engine.feed.batches.Cut` of a batch run in parts), so
every member runs the same ``batch_idx`` with the same ``context.batch_indices``. The source loads one batch ahead:
each message announces the next batch's length, so that no collective is spent on sizes.

Under the dynamic schedule the source claims the replica's batches as its loader asks for them (the other members
claim none), and sends the end of its feed (no batch left, or a stop seen at a claim) as it sends a batch.

A batch that fails to load (or to pack) on the source fails on every member: the members receive the failure (its
type and message) and raise a :class:`~torch_batch_process.engine.feed.batches.LoadFailed` for that batch, so every rank
of the replica records a failure at the same step. A member lost during the exchange is this rank's failure (a
:class:`~torch_batch_process.errors.WorkerLostError`): the rank records it and goes on idling in step with the others
until they all stop together, rather than leaving the ranks' protocol where it stands (its collectives in flight
would then wait for it).

Why the source loads and sends rather than each member loading: loading costs CPU on every member (tokenizing,
decoding, remote reads) and a dataset may not give the same batch twice (random augmentation, a stream); sending
costs the same whatever the number of members (notes/43-mesh.md §6.2 measures both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torch_batch_process.engine.distributed import peers_answering
from torch_batch_process.engine.feed.batches import BatchFeed, LoadFailed, batch_id
from torch_batch_process.engine.mesh.broadcast import pack_message, unpack_message
from torch_batch_process.engine.mesh.exchange import StepMessages
from torch_batch_process.engine.rank_failure import RankFailure
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


class _Loaded(NamedTuple):
    """What the source loaded for a step: the feed's item, packed, and its load failure (``None``: none)."""

    item: Any
    message: torch.Tensor
    failed: LoadFailed | None


class ReplicaFeed:
    """An iterator of ``(key, batch)`` like :class:`~torch_batch_process.engine.feed.batches.BatchFeed`, the same on
    every member of a replica, each step's item brought by :meth:`exchange` (see the module docstring).

    Args:
        feed: this rank's feed; only the source's is started (the other members' loaders never run: no worker
            process, no batch loaded; a batch's parts run again after an out-of-memory error load with its dataset and
            ``collate_fn``).
        group: the library's gloo group of the replica's members.
        source: the global rank of the replica's source member.
    """

    def __init__(self, feed: BatchFeed, group: dist.ProcessGroup, source: int) -> None:
        self._rank = dist.get_rank()
        self._feed = feed if self._rank == source else None
        self.loader = feed.loader
        self.watch = feed.watch
        self._source = source
        self._messages = StepMessages(group, source)
        self._ahead: _Loaded | None = None
        """The source: the batch the next message sends (its length went out with the last message)."""
        self._started = False
        self._step: _Loaded | Any = None
        """What the last exchange brought for this step (the source: its own :class:`_Loaded`)."""
        self.load_error = BatchFeed.load_error

    def start(self) -> None:
        if self._feed is not None:
            self._feed.start()

    def exchange(self, rank_failure: RankFailure, mark: Callable[[], int]) -> tuple[bool, int]:
        """Every member of the replica, at the same step before its batch: whether none of them has failed, and the
        source's mark (``mark()``, read on the source once it loaded ahead: a stop or failure seen at a claim); the
        step's batch is then this feed's next item. A replica whose member failed (in a hook, at a commit, in an
        earlier batch) runs no batch, so that no member waits in a collective for a member that is not coming (the
        ranks' agreement stops the job soon after). A member lost meanwhile is this rank's failure (a
        :class:`~torch_batch_process.errors.WorkerLostError`): it idles on in step with the other ranks, whose
        agreement then stops every rank together."""
        self._step = None
        first, self._started = not self._started, True
        if first:  # the first message only announces the first batch's length
            self._ahead = self._load()
        loaded, code = self._ahead, 0
        if loaded is not None:  # the source
            self._ahead = self._load()
            code = mark()
        try:
            with peers_answering(self._rank):
                ok = not first or self._messages.exchange(rank_failure.failed, 0, _EMPTY, self._length(loaded)).ok
                status = self._messages.exchange(
                    rank_failure.failed, code, loaded.message if loaded else None, self._length(self._ahead)
                )
        except WorkerLostError as lost:
            rank_failure.record(lost, f"exchanging the status of rank {self._rank}'s replica")
            return False, 0
        self._step = loaded if loaded is not None else unpack_message(status.message)
        return ok and status.ok, status.mark

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self

    def __next__(self) -> tuple[Any, Any]:
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("a replica's feed hands out a batch only after the step's exchange")
        if isinstance(step, _Loaded):  # the source: its own item, and its own load failure
            if step.failed is not None:
                raise step.failed
            step = step.item
        if isinstance(step, _End):
            raise StopIteration
        if isinstance(step, _Failed):
            error = SourceLoadFailed(f"rank {self._source} (the replica's source) failed to load it: {step.message}")
            raise LoadFailed(step.batch_idx, error)
        return step

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()

    def _load(self) -> _Loaded | None:
        """The source: its feed's next item (the end of the feed, or a failure to load or pack it, as what the other
        members receive in its place), packed; ``None`` on the other members."""
        if self._feed is None:
            return None
        failed: LoadFailed | None = None
        try:
            item: Any = next(self._feed)
        except StopIteration:  # the dynamic schedule's end (the static schedule stops its steps before)
            item = _End()
        except LoadFailed as exc:
            failed, item = exc, _Failed(exc.batch_idx, exc.error)
        try:
            return _Loaded(item, pack_message(item), failed)
        except Exception as exc:  # noqa: BLE001 - a batch that cannot be sent (a tensor on a device, not picklable)
            failed = LoadFailed(batch_id(item[0]), exc)
            return _Loaded(_Failed(failed.batch_idx, exc), pack_message(_Failed(failed.batch_idx, exc)), failed)

    @staticmethod
    def _length(loaded: _Loaded | None) -> int:
        return loaded.message.numel() if loaded is not None else 0


_EMPTY = torch.empty(0, dtype=torch.uint8)
