"""Asynchronous copies of device tensors passed to ``context.write`` into pinned host memory.

``tensor.cpu()`` blocks the host until the GPU has finished everything queued before it, so a
``process_batch`` that writes its model's outputs would wait for its own forward pass at every batch and
the next batch could not be prepared (loaded, collated, launched) meanwhile. Instead, :class:`DeviceCopies`
starts each copy with ``non_blocking=True`` into a pinned host tensor and records a CUDA event after the
copies of one ``write`` call; the rows' Arrow table is built at once over the pinned memory (zero-copy), and
nothing reads its values before :meth:`CopiesDone.wait` returns. The record writer waits on its background
encoder thread, just before the row group is encoded, so the batch's thread never waits for the GPU (JSONL
and a change of column types wait on the batch's thread, where the values are needed at once).

Why it is correct:

- *Order.* The copies are queued on the current stream of the tensor's device, the stream the user's
  kernels that produced the tensor ran on, so they start after those kernels; the event recorded after them
  completes once every copy has landed. :meth:`CopiesDone.wait` synchronizes on it before the values are read.
- *Memory lifetime.* The device tensor may be freed as soon as ``write`` returns: its block goes back to the
  caching allocator on that same stream, and later work on the stream is ordered after the copy. The pinned
  tensor is kept alive by the table's buffers (numpy views of it); PyTorch's caching host allocator does not
  hand out a pinned block again before the copies that used it have finished.
- *Bounded memory.* Pinned tensors live exactly as long as the rows that reference them: at most the row
  group being filled and the one being encoded (see :mod:`torch_batch_process.outputs.records`).

Copied this way: strided CUDA tensors of a numeric type (``bfloat16`` becomes ``float32`` on the device
first, as neither numpy nor Parquet has it). Anything else (CPU tensors, booleans, other devices) is converted
as before, with ``.cpu()``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CopiesDone", "DeviceCopies"]

_COPIED_DTYPES = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
    }
)


class CopiesDone:
    """The end of one ``write`` call's copies: :meth:`wait` returns once they have all landed."""

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    @property
    def pending(self) -> bool:
        """Whether some copy may still be running (never waits)."""
        return any(not event.query() for event in self._events)

    def wait(self) -> None:
        """Blocks until every copy has landed (at once when there was none)."""
        events, self._events = self._events, []
        for event in events:
            event.synchronize()


class DeviceCopies:
    """Starts the asynchronous copies of one ``write`` call (see the module docstring)."""

    def __init__(self) -> None:
        self._devices: dict[torch.device, None] = {}  # devices with copies queued, in order

    @staticmethod
    def eligible(value: Any) -> bool:
        """Whether ``value`` is a tensor this class copies asynchronously."""
        return (
            isinstance(value, torch.Tensor)
            and value.is_cuda
            and value.layout == torch.strided
            and value.dtype in _COPIED_DTYPES
        )

    def start(self, tensor: torch.Tensor) -> torch.Tensor:
        """Queues the copy of ``tensor`` (see :meth:`eligible`) and returns its pinned host tensor, whose values
        are valid only after :meth:`CopiesDone.wait` of :meth:`done`."""
        tensor = tensor.detach()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()  # on the device, ordered on the same stream
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        self._devices[tensor.device] = None
        return host

    def done(self) -> CopiesDone:
        """Records an event after the copies on each device's current stream; no copy may be started after."""
        events = []
        for device in self._devices:
            event = torch.cuda.Event(blocking=True)  # a waiting thread sleeps: it never spins on a CPU core
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        self._devices = {}
        return CopiesDone(events)
