"""The messages a replica's members exchange between batches (``mesh=``, DESIGN §18): statuses and the next batch.

Before each step every member of a replica must learn three things together: whether a member failed (then no member
runs the batch: a member that idles would leave the others waiting in the model's collectives), the mark its source
saw at a claim (the dynamic schedule's stop or failure, taken by every member at this same step), and the step's batch,
which only the source loads. With ``on_oom="split"`` they also learn after each attempt whether a member ran out of
memory in it (then every member undoes it and runs the batch in parts). One ``all_gather`` over the replica's group
carries it all: each member's chunk starts with its status (its failure flag, its attempt's code; the source's also the
mark and the length of the batch the *next* message carries), and the source's chunk then holds a batch
(:func:`~torch_batch_process.engine.mesh.broadcast.pack_message`). Every member therefore knows the size of the next
message from this one, and no collective is spent on sizes; the source loads one batch ahead to announce it.

:meth:`StepMessages.exchange` sends a message with a batch; :meth:`StepMessages.agree` one with statuses only (an
attempt of a part, once the next batch went out). The caller
(:class:`~torch_batch_process.engine.feed.replica.ReplicaFeed`) sends the next step's batch with the exchange after the
first attempt of a step, so a step costs one collective of the replica's own.

Why one collective: on gloo over 2 busy cores each small collective costs 0.3-2 ms plus the wait for every peer to be
scheduled, and a tensor-parallel forward already makes its own (8 all-reduces for the examples' encoder). The members
made five per step before (a status ``all_reduce``, ``broadcast_object_list``'s two, the batch's ``broadcast``, the
attempt's ``all_reduce``); notes/43-mesh.md §12 measures both. A batch larger than :data:`INLINE_MAX` bytes does not
ride in the chunks (every member would send as many bytes of padding): its message carries only the statuses and a
``broadcast`` of the batch follows, where the transfer outweighs one more collective.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_batch_process.engine import pending_collectives

__all__ = ["INLINE_MAX", "StepMessages", "StepStatus"]

INLINE_MAX = 1 << 18
"""Bytes of a packed batch carried in the message's ``all_gather`` itself; a larger one follows in a ``broadcast``."""

_STATUS = 32
"""Bytes of a chunk's status: int64 fields (failed, code, mark, next length), a multiple of the batch's 16-byte
alignment."""
_FAILED, _CODE, _MARK, _NEXT = 0, 1, 2, 3
_ALIGN = 16


@dataclass(frozen=True)
class StepStatus:
    """What every member of a replica received in a message."""

    failed: bool
    """A member had failed when it sent its status."""
    code: int
    """The largest of the members' codes (an attempt's outcome; 0 when none)."""
    mark: int
    """The source's mark (0: none)."""
    message: torch.Tensor | None
    """The packed batch this message carried (on the source, and in :meth:`StepMessages.agree`: ``None``)."""


class StepMessages:
    """The messages of one replica (see the module docstring); every member calls :meth:`exchange` and :meth:`agree`
    at the same points, in the same order.

    Args:
        group: the library's gloo group of the replica's members.
        source: the global rank of the replica's source.
    """

    def __init__(self, group: dist.ProcessGroup, source: int) -> None:
        self._group = group
        self._members = dist.get_world_size(group)
        self._source = source
        self._source_index = dist.get_group_rank(group, source)
        self._is_source = dist.get_rank() == source
        self.length = 0
        """Bytes of the batch the next :meth:`exchange` carries (announced by the last one; 0 before the first)."""

    def exchange(
        self,
        failed: bool,
        code: int = 0,
        mark: int = 0,
        message: torch.Tensor | None = None,
        next_length: int = 0,
        timeout_s: float | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> StepStatus:
        """A message with a batch: this member's status against the others'; on the source also ``mark``, the batch
        (``message``, of the length the last exchange announced) and the next batch's length. ``meanwhile`` runs
        while the message is in flight (the source loads its next batch there, off the members' critical path: this
        member's chunk is on its way before it starts, and the wait that ``timeout_s`` bounds starts after it).

        Raises what ``torch.distributed`` raises when a member is gone, and a ``RuntimeError`` saying "timed out" when
        the others did not come within ``timeout_s`` (``None``: the group's timeout)."""
        length = self.length
        if self._is_source and (message is None or message.numel() != length):
            raise ValueError(f"the batch has {_numel(message)} bytes, the last message announced {length}")
        inline = length <= INLINE_MAX
        fields, chunks = self._gather(
            failed, code, mark, next_length, message if inline else None, _aligned(length) if inline else 0, timeout_s,
            meanwhile,
        )
        source = fields[self._source_index]
        received: torch.Tensor | None = None
        if not self._is_source:
            if inline:
                received = chunks[self._source_index, _STATUS : _STATUS + length]
            else:
                received = torch.empty(length, dtype=torch.uint8)
        if not inline:
            dist.broadcast(message if self._is_source else received, src=self._source, group=self._group)
        self.length = int(source[_NEXT])
        return StepStatus(bool(fields[:, _FAILED].any()), int(fields[:, _CODE].max()), int(source[_MARK]), received)

    def agree(self, failed: bool, code: int, timeout_s: float | None = None) -> StepStatus:
        """A message with statuses only (the batch the last exchange announced waits for the next exchange)."""
        fields, _ = self._gather(failed, code, 0, 0, None, 0, timeout_s)
        return StepStatus(bool(fields[:, _FAILED].any()), int(fields[:, _CODE].max()), 0, None)

    def _gather(
        self,
        failed: bool,
        code: int,
        mark: int,
        next_length: int,
        batch: torch.Tensor | None,
        room: int,
        timeout_s: float | None,
        meanwhile: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``all_gather`` of every member's chunk (its status, then ``room`` bytes: the source's ``batch``), with
        ``meanwhile`` run while it is in flight; the members' status fields (one row each) and their chunks."""
        chunk = torch.zeros(_STATUS + room, dtype=torch.uint8)
        fields = chunk[:_STATUS].view(torch.int64)
        fields[_FAILED], fields[_CODE] = int(failed), code
        if self._is_source:
            fields[_MARK], fields[_NEXT] = mark, next_length
            if batch is not None:
                chunk[_STATUS : _STATUS + batch.numel()] = batch
        gathered = torch.empty(self._members * chunk.numel(), dtype=torch.uint8)
        if timeout_s is None and meanwhile is None:
            dist.all_gather_single(gathered, chunk, group=self._group)
        else:
            work = dist.all_gather_single(gathered, chunk, group=self._group, async_op=True)
            pending_collectives.started(work, self._group)
            try:
                if meanwhile is not None:
                    meanwhile()
            finally:
                if timeout_s is None:
                    work.wait()
                else:  # raising (a member late or lost): left in flight
                    work.wait(timeout=datetime.timedelta(seconds=timeout_s))
            pending_collectives.settled(work)
        chunks = gathered.view(self._members, chunk.numel())
        return chunks[:, :_STATUS].reshape(-1).view(torch.int64).view(self._members, _STATUS // 8), chunks


def _aligned(length: int) -> int:
    return -(-length // _ALIGN) * _ALIGN


def _numel(message: torch.Tensor | None) -> int:
    return 0 if message is None else message.numel()
