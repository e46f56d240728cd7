"""The feed of a replica's members (``mesh=``, DESIGN §18): every member of a replica runs the same batch.

The replica's first member (its *source*) loads the replica's batches with the user's ``DataLoader`` (its workers,
``collate_fn``...), as any rank loads its own; the other members run no loader at all. Before each step the members
exchange one message (:class:`~torch_batch_process.engine.mesh.exchange.StepMessages`, one ``all_gather`` over the
replica's own gloo group): every member's status, the source's mark (the dynamic schedule's stop or failure seen at a
claim) and the step's batch, packed (:func:`~torch_batch_process.engine.mesh.broadcast.pack_message`: tensors as raw
bytes). :meth:`ReplicaFeed.exchange` runs it; the step's ``next()`` then hands out the batch it brought. The batch goes
with its feed key (its id, or the :class:`~torch_batch_process.engine.feed.batches.Cut` of a batch run in parts), so
every member runs the same ``batch_idx`` with the same ``context.batch_indices``. The source loads one batch ahead:
each message announces the next batch's length, so that no collective is spent on sizes. It loads while a message is
in flight (its own chunk already on its way, before the wait that ``TBP_MESH_GRACE_S`` bounds), so that its loading
overlaps the other members' work (the writer saving its outputs, a pipeline's last stage) instead of delaying the
next forward, which every member starts together.

Under the dynamic schedule the source claims the replica's batches as its loader asks for them (the other members
claim none), and sends the end of its feed (no batch left, or a stop seen at a claim) as it sends a batch. A claim that
finds the job's rendezvous store gone (rank 0's process hosts it) is the source's failure, which the next message
carries, and the end of its feed; the message in flight meanwhile stands (its batch runs on every member).

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

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from torch_batch_process import settings
from torch_batch_process.engine.distributed import peers_answering
from torch_batch_process.engine.feed.batches import BatchFeed, LoadFailed, batch_id
from torch_batch_process.engine.feed.failing_examples import ATTEMPT_FAILED
from torch_batch_process.engine.mesh.broadcast import pack_message, unpack_message
from torch_batch_process.engine.mesh.exchange import StepMessages, StepStatus
from torch_batch_process.engine.rank_failure import RankFailure
from torch_batch_process.errors import MemberOutOfStepError, WorkerLostError

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
    every member of a replica, each step's item brought by the replica's messages (see the module docstring):
    :meth:`exchange` before each step, :meth:`agree_attempt` after each attempt with ``on_oom="split"``.

    Args:
        feed: this rank's feed; only the source's is started (the other members' loaders never run: no worker
            process, no batch loaded; a batch's parts run again after an out-of-memory error load with its dataset and
            ``collate_fn``).
        group: the library's gloo group of the replica's members.
        source: the global rank of the replica's source member.
        rank_failure: this rank's failure (its status in each message).
        mark: the source's mark for its replica (:meth:`~torch_batch_process.engine.schedule.scheduler.Scheduler
            .replica_mark`), read once it loaded ahead: a stop or failure seen at a claim.
    """

    def __init__(
        self, feed: BatchFeed, group: dist.ProcessGroup, source: int, rank_failure: RankFailure,
        mark: Callable[[], int],
    ) -> None:
        self._rank = dist.get_rank()
        self._feed = feed if self._rank == source else None
        self.loader = feed.loader
        self.watch = feed.watch
        self._source = source
        self._rank_failure = rank_failure
        self._mark = mark
        self._messages = StepMessages(group, source)
        self._ahead: deque[_Loaded] = deque()
        """The source: batches loaded ahead, in order: the first goes with the next message (its length went out with
        the last one), which announces the second's length."""
        self._started = False
        self._ended = False
        self._next: tuple[bool, int, Any] | None = None
        """The next step's message when it came with the last attempt's exchange: whether no member had failed, the
        mark, the item."""
        self._step: _Loaded | Any = None
        """What the last exchange brought for this step (the source: its own :class:`_Loaded`)."""
        self.load_error = BatchFeed.load_error

    def start(self) -> None:
        if self._feed is not None:
            self._feed.start()

    def exchange(self) -> tuple[bool, int]:
        """Every member of the replica, at the same step before its batch: whether none of them had failed, and the
        source's mark; the step's batch is then this feed's next item. A replica whose member failed (in a hook, at a
        commit, in an earlier batch) runs no batch, so that no member waits in a collective for a member that is not
        coming (the ranks' agreement stops the job soon after). A member lost meanwhile is this rank's failure (a
        :class:`~torch_batch_process.errors.WorkerLostError`): it idles on in step with the other ranks, whose
        agreement then stops every rank together.

        No collective when the last attempt's exchange (:meth:`agree_attempt`) brought this step's message already:
        the members then run the batch they agreed on there, a member that failed since too (its failure reaches
        them with the next message), so that none of them waits for it in the model's collectives."""
        self._load_ahead()  # before the first message; the later ones load while they are in flight
        if self._next is not None:
            (ok, mark, self._step), self._next = self._next, None
            return ok, mark
        self._step = None
        first, self._started = not self._started, True
        failed = self._rank_failure.failed
        try:
            with peers_answering(self._rank):
                if first:  # the first message only announces the first batch's length
                    length = self._length(self._ahead[0]) if self._ahead else 0
                    failed = self._messages.exchange(failed, 0, 0, _EMPTY, length).failed or failed
                loaded, length, mark = self._next_batch()
                # the source loads what the attempt's exchange sends and announces while this message is in flight
                status = self._messages.exchange(
                    failed, 0, mark, self._message(loaded), length, meanwhile=self._load_ahead
                )
        except WorkerLostError as lost:
            self._rank_failure.record(lost, f"exchanging the status of rank {self._rank}'s replica")
            return False, 0
        self._step = self._item(loaded, status)
        return not status.failed, status.mark

    def agree_attempt(self, code: int) -> int:
        """Every member after an attempt of a batch or part (``on_oom="split"``): the largest of their ``code`` s
        (:data:`~torch_batch_process.engine.feed.failing_examples.ATTEMPT_OK`, ``ATTEMPT_OUT_OF_MEMORY``,
        ``ATTEMPT_FAILED``), so that they keep an attempt or split it together. A member lost: ``ATTEMPT_FAILED``.
        After a step's first attempt the message also carries the next step's batch and statuses (an attempt that
        failed counts as a member's failure), which :meth:`exchange` then hands out without a collective.

        Raises:
            MemberOutOfStepError: the other members did not come within ``TBP_MESH_GRACE_S``: they wait in a
                collective of the attempt this rank left (an out-of-memory error inside a tensor-parallel forward),
                which nothing releases but this rank's failure (the member watch then ends them).
        """
        grace_s = settings.current().mesh_grace_s
        with_next = self._next is None
        failed = self._rank_failure.failed
        try:
            if with_next:  # the source loads the batch after next while the message is in flight (see exchange())
                loaded, length, mark = self._next_batch()
                status = self._messages.exchange(
                    failed, code, mark, self._message(loaded), length, grace_s, meanwhile=self._load_ahead
                )
                ok = not status.failed and status.code != ATTEMPT_FAILED
                self._next = (ok, status.mark, self._item(loaded, status))
            else:
                status = self._messages.agree(failed, code, grace_s)
        except (RuntimeError, ConnectionError, EOFError) as exc:
            if "timed out" not in str(exc):
                return ATTEMPT_FAILED  # a member lost: the next exchange records it
            raise MemberOutOfStepError(
                f"rank {self._rank}: the other members of its replica did not reach the end of this attempt within "
                f"TBP_MESH_GRACE_S={grace_s:g}s: they wait in a collective of the model that this rank left when it "
                "ran out of memory, so the batch cannot be split on every member together; the replica stops (the "
                f"job resumes). Lower batch_size or max_tokens, or pass on_oom='raise' ({exc})"
            ) from exc
        return status.code

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
            if self._ended:  # the loader is not asked again past its end
                raise StopIteration
            item: Any = next(self._feed)
        except StopIteration:  # the dynamic schedule's end (the static schedule stops its steps before)
            self._ended, item = True, _End()
        except WorkerLostError as lost:  # a claim found the rendezvous store gone (rank 0's process hosts it)
            # this rank's failure, which the replica's next message carries, and the end of its feed: raised here, it
            # would leave the message in flight (this loads while it is) looking lost to this rank alone, while the
            # other members received it and ran its batch, waiting for this rank in the model's collectives
            self._rank_failure.record(lost, f"claiming the next batch of rank {self._rank}'s replica")
            self._ended, item = True, _End()
        except LoadFailed as exc:
            failed, item = exc, _Failed(exc.batch_idx, exc.error)
        try:
            return _Loaded(item, pack_message(item), failed)
        except Exception as exc:  # noqa: BLE001 - a batch that cannot be sent (a tensor on a device, not picklable)
            failed = LoadFailed(batch_id(item[0]), exc)
            return _Loaded(_Failed(failed.batch_idx, exc), pack_message(_Failed(failed.batch_idx, exc)), failed)

    def _load_ahead(self) -> None:
        """The source: two batches loaded ahead (the next message's and the one after, whose length it announces)."""
        while self._feed is not None and len(self._ahead) < 2:
            self._ahead.append(self._load())

    def _next_batch(self) -> tuple[_Loaded | None, int, int]:
        """The source: the batch a message carries, the length of the one after, and the mark (read after the loads'
        claims); ``(None, 0, 0)`` on the other members."""
        if self._feed is None:
            return None, 0, 0
        loaded = self._ahead.popleft()
        return loaded, self._length(self._ahead[0]), self._mark()

    def _item(self, loaded: _Loaded | None, status: StepStatus) -> Any:
        """What a message brought for its step: the source's own :class:`_Loaded`, or the batch unpacked."""
        if loaded is not None:
            return loaded
        assert status.message is not None
        return unpack_message(status.message)

    @staticmethod
    def _message(loaded: _Loaded | None) -> torch.Tensor | None:
        return loaded.message if loaded is not None else None

    @staticmethod
    def _length(loaded: _Loaded) -> int:
        return loaded.message.numel()


_EMPTY = torch.empty(0, dtype=torch.uint8)
