"""The message a replica's members exchange before each step (``mesh=``, DESIGN §18): their status and the batch.

Before each step every member of a replica must learn three things together: whether a member failed (then no member
runs the batch: a member that idles would leave the others waiting in the model's collectives), the mark its source
saw at a claim (the dynamic schedule's stop or failure, taken by every member at this same step), and the step's batch,
which only the source loads. One ``all_gather`` over the replica's group carries all three: each member's chunk starts
with its status (its failure flag; the source's also the mark and the length of the *next* step's batch), and the
source's chunk then holds this step's batch (:func:`~torch_batch_process.engine.mesh.broadcast.pack_message`). Every
member therefore knows the size of the next message from this one, and no collective is spent on sizes; the source
loads one batch ahead to announce it.

Why one collective: on gloo over 2 busy cores each small collective costs 0.3-2 ms plus the wait for every peer to be
scheduled, and a tensor-parallel forward already makes its own (8 all-reduces for the examples' encoder). The members
made four per step before (a status ``all_reduce``, ``broadcast_object_list``'s two, the batch's ``broadcast``);
notes/43-mesh.md §12 measures both. A batch larger than :data:`INLINE_MAX` bytes does not ride in the chunks (every
member would send as many bytes of padding): its message carries only the statuses and a ``broadcast`` of the batch
follows, where the transfer outweighs one more collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["INLINE_MAX", "StepMessages", "StepStatus"]

INLINE_MAX = 1 << 18
"""Bytes of a packed batch carried in the step's ``all_gather`` itself; a larger one follows in a ``broadcast``."""

_STATUS = 32
"""Bytes of a chunk's status: int64 fields (failed, mark, next length, unused), a multiple of the batch's 16-byte
alignment."""
_FAILED, _MARK, _NEXT = 0, 1, 2
_ALIGN = 16


@dataclass(frozen=True)
class StepStatus:
    """What every member of a replica received in a step's message."""

    ok: bool
    """No member had failed when it sent its status."""
    mark: int
    """The source's mark (0: none)."""
    message: torch.Tensor | None
    """The step's packed batch (on the source: ``None``, it keeps its own)."""
    next_length: int
    """Bytes of the next step's packed batch."""


class StepMessages:
    """The step messages of one replica (see the module docstring); every member calls :meth:`exchange` at the same
    steps, in the same order.

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
        self._length = 0
        """Bytes of this message's batch, announced by the previous message (0 before the first)."""

    def exchange(
        self, failed: bool, mark: int = 0, message: torch.Tensor | None = None, next_length: int = 0
    ) -> StepStatus:
        """This member's status (and on the source: ``mark``, this step's ``message``, of the length the previous
        message announced, and the next batch's length) against the others'. Raises what ``torch.distributed`` raises
        when a member is gone (the caller turns it into a lost member)."""
        length, inline = self._length, self._length <= INLINE_MAX
        chunk = torch.zeros(_STATUS + (-(-length // _ALIGN) * _ALIGN if inline else 0), dtype=torch.uint8)
        fields = chunk[:_STATUS].view(torch.int64)
        fields[_FAILED] = int(failed)
        if self._is_source:
            if message is None or message.numel() != length:
                raise ValueError(f"the step's batch has {_numel(message)} bytes, the last message announced {length}")
            fields[_MARK], fields[_NEXT] = mark, next_length
            if inline:
                chunk[_STATUS : _STATUS + length] = message
        gathered = torch.empty(self._members * chunk.numel(), dtype=torch.uint8)
        dist.all_gather_single(gathered, chunk, group=self._group)
        chunks = gathered.view(self._members, chunk.numel())
        statuses = chunks[:, :_STATUS].reshape(-1).view(torch.int64).view(self._members, _STATUS // 8)
        source = statuses[self._source_index]
        received: torch.Tensor | None = None
        if not self._is_source:
            if inline:
                received = chunks[self._source_index, _STATUS : _STATUS + length]
            else:
                received = torch.empty(length, dtype=torch.uint8)
        if not inline:
            dist.broadcast(message if self._is_source else received, src=self._source, group=self._group)
        self._length = int(source[_NEXT])
        return StepStatus(not bool(statuses[:, _FAILED].any()), int(source[_MARK]), received, self._length)


def _numel(message: torch.Tensor | None) -> int:
    return 0 if message is None else message.numel()
