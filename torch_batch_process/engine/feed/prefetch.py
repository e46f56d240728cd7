"""Device prefetch: the next batch is copied to the GPU on a side stream while the current one runs.

:class:`DevicePrefetcher` wraps the iterator of ``(key, batch)`` pairs that the loop consumes. On CUDA
it pulls the next batch from that iterator as soon as the current one is handed out, issues its
host-to-device copies on a side stream of its own, and hands it out on the caller's stream already on
the device, so that ``process_batch`` receives device tensors and ``context.to_device`` is a no-op.
Everywhere else (CPU, mps, or when disabled) it is a pass-through: the source's items, unchanged,
with no copy.

Synchronisation, and why it is correct:

- *Use after copy.* Each batch's copies are followed by an event recorded on the side stream. When the
  batch is handed out, the caller's current stream (the consumer) waits on that event
  (``Stream.wait_event``): every kernel the caller queues on it afterwards runs after the copy has
  landed. The host never blocks on the event.
- *Memory lifetime: ``record_stream``.* The device tensors are allocated on the side stream, and
  PyTorch's caching allocator only knows about that stream: once a tensor is freed, its block could be
  handed to the next copy on the side stream while kernels that the consumer queued earlier still
  read it. So, when a batch is handed out, every device tensor of it is marked with
  ``Tensor.record_stream(consumer)``; when the tensor is freed (whenever, and by whoever drops the last
  reference), the allocator records an event on the consumer and does not reuse the block before the
  consumer's work queued until then has finished. The alternative, keeping references until an event
  completes, is not safe here: the batch goes to user code, which may keep tensors (or views of them)
  for as long as it likes and use them in later kernels; only the allocator sees the last reference
  go. ``record_stream`` is what the PyTorch documentation recommends for "a function that created a
  tensor on a side stream" whose users should not have to think about streams. Its cost: a freed
  block is reused only after the allocator has seen the consumer's event complete, so the device may
  hold a batch or two more memory.
- *Objects the allocator cannot track.* Only strided tensors are copied ahead. Other leaves that have
  a ``to()`` method (custom batch classes, sparse or nested tensors) are moved when the batch is
  handed out, on the consumer stream, where the allocator's own stream-ordering makes them safe.
- *Pinned host memory.* A non-blocking copy from a pinned CPU tensor makes PyTorch's caching host
  allocator record the side stream on the pinned block, so the CPU batch can be dropped as soon as its
  copy is issued. Pageable tensors are copied synchronously (as ``to_device`` does), which is why the
  side stream is *not* made to wait on the consumer before a copy: that would block the host behind
  the consumer's queued work.

The batch's structure follows :func:`torch_batch_process.device.to_device` (dicts, lists, tuples,
namedtuples; numpy arrays become tensors; strings, numbers, PIL images pass through), and each tensor
or array is moved by ``to_device`` itself, so a prefetched batch equals ``to_device(batch, device)``.

An exception raised by a copy (the device's memory ran out: DESIGN §15) is delivered at its batch's
position, as ``error_of(key, exc)`` when given (the loop attributes it to the batch, whose parts are then
loaded again and copied one by one).

Order and errors: the caller sees exactly the sequence of items and exceptions that the source
produces, in order; only the timing differs. An exception raised by the source while the prefetcher
pulls batch ``i`` ahead is kept and raised, unchanged, when the caller asks for batch ``i``; the
source is not advanced past a failure the caller has not yet received. ``KeyboardInterrupt`` and
other ``BaseException`` s propagate at once. The keys are opaque and passed through.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from torch_batch_process.device import rebuild_mapping, to_device
from torch_batch_process.errors import InvalidArgumentError

__all__ = ["DevicePrefetcher", "Lookahead", "validate_device_prefetch"]

T = TypeVar("T")
S = TypeVar("S")
U = TypeVar("U")


def validate_device_prefetch(value: bool | None, device: torch.device | str) -> bool:
    """Checks the ``device_prefetch`` option and says whether batches will be prefetched.

    Args:
        value: ``None`` (default: on for a CUDA device, off elsewhere), ``True`` or ``False``.
            ``True`` on a device that is not CUDA is allowed and does nothing (batches are passed
            through as loaded), so one script runs unchanged on a laptop and on a GPU node.
        device: the rank's device.

    Returns:
        True when batches will be copied ahead to the device, i.e. the option is on and the device is
        CUDA.

    Raises:
        InvalidArgumentError: ``value`` is not ``None`` or a bool.
    """
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(
            f"device_prefetch must be True, False or None (default: on for CUDA devices), got {value!r}"
        )
    on_cuda = torch.device(device).type == "cuda"
    return on_cuda if value is None else value and on_cuda


def _check_depth(depth: int) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise InvalidArgumentError(f"depth (batches fetched ahead) must be an int >= 1, got {depth!r}")
    return depth


class _Failure:
    """An exception raised by the source (or by starting an item), kept until its position is reached."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class Lookahead(Generic[T, S, U]):
    """Iterates over ``source`` ``depth`` items ahead, starting each item's preparation early.

    Each item pulled from the source is passed to ``start`` at once (for a device copy: issue the
    copy); ``finish`` turns the started item into what the caller gets, when the caller asks for it.
    When item ``i`` is handed out, items ``i+1 .. i+depth`` have already been pulled and started.

    The caller sees the source's sequence of items and exceptions unchanged: an ``Exception`` raised
    by the source (or by ``start``) for item ``i`` is raised when the caller asks for item ``i``, and
    the source is not advanced past it before then; a ``BaseException`` (``KeyboardInterrupt``...)
    propagates at once, and the items already pulled stay queued. After the source is exhausted it is
    not called again.

    Args:
        source: the items.
        start: called once per item, right after it is pulled.
        finish: called once per started item, when the caller asks for it.
        depth: how many items to keep started ahead of the one handed out (>= 1).
    """

    def __init__(
        self, source: Iterable[T], start: Callable[[T], S], finish: Callable[[S], U], depth: int = 1
    ) -> None:
        self._depth = _check_depth(depth)
        self._source: Iterator[T] | None = iter(source)
        self._start = start
        self._finish = finish
        self._queue: deque[S | _Failure] = deque()
        self._failure_queued = False

    def __iter__(self) -> Lookahead[T, S, U]:
        return self

    def __next__(self) -> U:
        self._fill()
        if not self._queue:
            raise StopIteration
        entry = self._queue.popleft()
        if isinstance(entry, _Failure):
            self._failure_queued = False
            error = entry.error
            del entry
            raise error
        return self._finish(entry)

    def close(self) -> None:
        """Drops the items started ahead and the source; later calls raise ``StopIteration``."""
        self._queue.clear()
        self._source = None
        self._failure_queued = False

    def _fill(self) -> None:
        """Pulls and starts items until the head plus ``depth`` are queued, the source is exhausted, or
        a failure is queued."""
        queue = self._queue
        while len(queue) <= self._depth and self._source is not None and not self._failure_queued:
            try:
                item = next(self._source)
            except StopIteration:
                self._source = None
                return
            except Exception as exc:  # noqa: BLE001 - delivered at its position, unchanged
                self._fail(exc)
                return
            try:
                queue.append(self._start(item))
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
                return

    def _fail(self, exc: Exception) -> None:
        self._queue.append(_Failure(exc))
        self._failure_queued = True


def _copy_ahead(
    data: Any, device: torch.device, warned: set[type], tensors: list[torch.Tensor], deferred: list[bool]
) -> Any:
    """``data`` with its strided tensors and numpy arrays moved to ``device`` by ``to_device`` (on the
    current stream), rebuilt with ``to_device``'s container rules.

    The moved tensors are appended to ``tensors`` (for ``record_stream``). Other objects with a
    ``to()`` method (custom classes, sparse or nested tensors) are left as they are and
    ``deferred[0]`` is set: they are moved when the batch is handed out.
    """
    if isinstance(data, torch.Tensor) and data.layout == torch.strided and not data.is_nested:
        moved = to_device(data, device, warned)
        tensors.append(moved)
        return moved
    if isinstance(data, np.ndarray):
        moved = to_device(data, device, warned)  # a tensor, or the array itself for strings/objects
        if isinstance(moved, torch.Tensor):
            tensors.append(moved)
        return moved
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        items = {key: _copy_ahead(value, device, warned, tensors, deferred) for key, value in data.items()}
        return rebuild_mapping(data, items)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_copy_ahead(value, device, warned, tensors, deferred) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_copy_ahead(value, device, warned, tensors, deferred) for value in data)
    if callable(getattr(data, "to", None)):
        deferred[0] = True
    return data


def _exhausted() -> Any:
    raise StopIteration


class _InFlight:
    """A batch whose copies were issued on the side stream."""

    __slots__ = ("key", "batch", "ready", "tensors", "deferred")

    def __init__(self, key: Any, batch: Any, ready: torch.cuda.Event, tensors: list[torch.Tensor], deferred: bool):
        self.key = key
        self.batch = batch
        self.ready = ready
        self.tensors = tensors  # the device tensors allocated for it (record_stream at hand-out)
        self.deferred = deferred  # it holds objects moved at hand-out, on the consumer stream


class DevicePrefetcher(Generic[T]):
    """Iterator over ``(key, batch)`` pairs that hands out each batch already on ``device``.

    On CUDA (and ``enabled``), batch ``i+1 .. i+depth`` are copied on a side stream while the caller
    works on batch ``i``; see the module documentation for the synchronisation and memory lifetime.
    Otherwise it passes the source's items through unchanged (no copy, no conversion of numpy arrays:
    ``context.to_device`` does that as before).

    Args:
        source: an iterable of ``(key, batch)`` pairs; the key is opaque (the loop passes batch ids).
        device: the device batches go to.
        enabled: prefetch when ``device`` is CUDA (see :func:`validate_device_prefetch`).
        depth: batches kept in flight ahead of the one handed out (>= 1; default 1).
        error_of: turns an exception raised while a batch is copied to the device (an out-of-memory error...)
            and its key into the exception the caller gets at that batch's position (the loop: the batch's
            :class:`~torch_batch_process.engine.feed.batches.LoadFailed`, so that it is attributed to the batch);
            ``None``: raised as it is.
    """

    def __init__(
        self,
        source: Iterable[tuple[T, Any]],
        device: torch.device | str,
        *,
        enabled: bool,
        depth: int = 1,
        error_of: Callable[[T, Exception], Exception] | None = None,
    ) -> None:
        _check_depth(depth)
        self._error_of = error_of
        device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None
        if enabled and device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._stream = torch.cuda.Stream(device=device)
            self._warned: set[type] = set()
            self._lookahead: Lookahead[tuple[T, Any], _InFlight, tuple[T, Any]] | None = Lookahead(
                source, self._start_copy, self._hand_out, depth
            )
            self._next: Callable[[], tuple[T, Any]] = self._lookahead.__next__
        else:
            self._lookahead = None
            self._next = iter(source).__next__
        self.device = device

    @property
    def active(self) -> bool:
        """True when batches are copied ahead (CUDA and enabled); False for a pass-through."""
        return self._stream is not None

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream the copies run on (``None`` for a pass-through)."""
        return self._stream

    def __iter__(self) -> DevicePrefetcher[T]:
        return self

    def __next__(self) -> tuple[T, Any]:
        return self._next()

    def close(self) -> None:
        """Drops the batches copied ahead (their device memory returns to the allocator) and the
        reference to the source; later calls raise ``StopIteration``. The source itself is not
        closed: its owner does that (the loop stops its DataLoader)."""
        if self._lookahead is not None:
            self._lookahead.close()
        self._next = _exhausted

    # ------------------------------------------------------------------------------- CUDA only

    def _start_copy(self, item: tuple[T, Any]) -> _InFlight:
        key, batch = item
        tensors: list[torch.Tensor] = []
        deferred = [False]
        stream = self._stream
        assert stream is not None
        try:
            with torch.cuda.stream(stream):
                moved = _copy_ahead(batch, self.device, self._warned, tensors, deferred)
                ready = torch.cuda.Event()
                ready.record(stream)
        except Exception as exc:
            if self._error_of is None:
                raise
            raise self._error_of(key, exc) from exc
        return _InFlight(key, moved, ready, tensors, deferred[0])

    def _hand_out(self, flight: _InFlight) -> tuple[T, Any]:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(flight.ready)
        for tensor in flight.tensors:
            if tensor.device == self.device:
                tensor.record_stream(consumer)
        batch = flight.batch
        if flight.deferred:
            try:
                batch = to_device(batch, self.device, self._warned)
            except Exception as exc:
                if self._error_of is None:
                    raise
                raise self._error_of(flight.key, exc) from exc
        return flight.key, batch
