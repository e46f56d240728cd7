"""A batch sent from a replica's first member to the others over the replica's own gloo group (DESIGN §18).

Every member of a replica must run the same batch: a tensor-parallel forward on different inputs gives wrong
outputs without any error. Where the members do not each load the batch themselves, the first member loads it and
sends it: any picklable structure (dicts, lists, tuples, a tokenizer's ``BatchEncoding``, dataclasses), whose tensors
travel as raw bytes rather than pickled. The structure is pickled with every CPU tensor replaced by a slot (pickle's
``persistent_id``); the header (that pickle and each tensor's dtype and shape) and the tensors' bytes pack into one
buffer (:func:`pack_message`), which the library sends inside the replica's step message
(:mod:`~torch_batch_process.engine.mesh.exchange`: no collective of its own). :func:`broadcast_batch` sends a batch on
its own (the header, then the tensors' bytes: three collectives whatever its number of tensors; what
``benchmarks/mesh_feed.py`` measures against each member loading). The receivers' tensors are views into the
received buffer (no copy); each is a CPU tensor equal to the sender's, contiguous, with the sender's dtype and shape.

Tensors on a device are not sent (the library broadcasts before the copy to the device); a batch holding one is an
error naming it.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BatchHeader", "broadcast_batch", "pack_batch", "pack_message", "unpack_batch", "unpack_message"]

_ALIGN = 16
"""Alignment of each tensor in the packed buffer (the largest element size, complex128's)."""

_LENGTH = 8
"""Bytes of a message's header length (:func:`pack_message`)."""


@dataclass(frozen=True)
class BatchHeader:
    """What the receivers need to rebuild a batch: its structure and its tensors' dtypes and shapes."""

    structure: bytes
    """The batch pickled with its tensors replaced by slots."""
    tensors: tuple[tuple[torch.dtype, tuple[int, ...]], ...]

    @property
    def sizes(self) -> list[int]:
        """Bytes of each tensor."""
        return [_numel(shape) * _itemsize(dtype) for dtype, shape in self.tensors]

    def offsets(self) -> tuple[list[int], int]:
        """Where each tensor starts in the packed buffer (aligned to :data:`_ALIGN` bytes, so that a slice views as
        any dtype), and the buffer's length."""
        starts, end = [], 0
        for size in self.sizes:
            start = _aligned(end)
            starts.append(start)
            end = start + size
        return starts, end


class _SlotPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._slots: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise ValueError(
                    f"a batch sent to a replica's members holds a tensor on {obj.device}: send CPU tensors"
                )
            slot = self._slots.get(id(obj))
            if slot is None:  # a tensor the batch holds twice is sent once and received as one tensor
                slot = self._slots[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return slot
        return None


class _SlotUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[pid]


def pack_batch(batch: Any) -> tuple[BatchHeader, torch.Tensor]:
    """The header and the tensors' bytes of ``batch``, packed in one ``uint8`` buffer."""
    out = io.BytesIO()
    pickler = _SlotPickler(out)
    pickler.dump(batch)
    tensors = [t.contiguous() for t in pickler.tensors]
    header = BatchHeader(out.getvalue(), tuple((t.dtype, tuple(t.shape)) for t in tensors))
    starts, length = header.offsets()
    buffer = torch.empty(length, dtype=torch.uint8)
    for tensor, start, size in zip(tensors, starts, header.sizes, strict=True):
        buffer[start : start + size] = _bytes_of(tensor)
    return header, buffer


def unpack_batch(header: BatchHeader, buffer: torch.Tensor) -> Any:
    """The batch that :func:`pack_batch` packed, its tensors views into ``buffer``."""
    starts, _ = header.offsets()
    tensors = [
        _from_bytes(buffer[start : start + size], dtype, shape)
        for (dtype, shape), start, size in zip(header.tensors, starts, header.sizes, strict=True)
    ]
    return _SlotUnpickler(io.BytesIO(header.structure), tensors).load()


def pack_message(batch: Any) -> torch.Tensor:
    """``batch`` as one self-describing ``uint8`` buffer: the header's length (8 bytes), the header pickled, then the
    tensors' bytes (:func:`pack_batch`), each part aligned to :data:`_ALIGN` bytes. What a replica's step message
    carries (:mod:`~torch_batch_process.engine.mesh.exchange`): no collective of its own for the header."""
    header, tensors = pack_batch(batch)
    structure = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    start = _aligned(_LENGTH + len(structure))
    message = torch.zeros(start + tensors.numel(), dtype=torch.uint8)
    message[:_LENGTH].view(torch.int64)[0] = len(structure)
    message[_LENGTH : _LENGTH + len(structure)] = torch.frombuffer(bytearray(structure), dtype=torch.uint8)
    message[start:] = tensors
    return message


def unpack_message(message: torch.Tensor) -> Any:
    """The batch that :func:`pack_message` packed (``message`` starting at an aligned address, as a slice of a
    received buffer at an offset that is a multiple of :data:`_ALIGN`); its tensors are views into ``message``."""
    length = int(message[:_LENGTH].view(torch.int64)[0])
    header = pickle.loads(message[_LENGTH : _LENGTH + length].numpy().tobytes())
    return unpack_batch(header, message[_aligned(_LENGTH + length) :])


def broadcast_batch(batch: Any, group: dist.ProcessGroup | None, src: int) -> Any:
    """``batch`` of global rank ``src`` on every rank of ``group`` (``src`` passes its own batch back, unchanged).

    Every rank of ``group`` calls it with the same ``src``; only ``src``'s ``batch`` is read. ``group`` ``None``:
    a replica of one rank, nothing sent."""
    if group is None:
        return batch
    sender = dist.get_rank() == src
    header: BatchHeader | None = None
    buffer: torch.Tensor | None = None
    if sender:
        header, buffer = pack_batch(batch)
    box: list[Any] = [header]
    dist.broadcast_object_list(box, src=src, group=group)
    header = box[0]
    if not sender:
        buffer = torch.empty(header.offsets()[1], dtype=torch.uint8)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return batch if sender else unpack_batch(header, buffer)


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat ``uint8`` view."""
    return tensor.reshape(-1).view(torch.uint8)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return data.view(dtype).reshape(shape)
