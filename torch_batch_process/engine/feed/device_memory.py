"""The device's memory as the batch runner meets it (``on_oom="split"``, DESIGN §15): which errors say that it ran
out, what kind of device learned limits hold for, and releasing what a failed attempt left.

Apart from the splitter (:mod:`~torch_batch_process.engine.feed.oom`) because the failing examples' transactions
(:mod:`~torch_batch_process.engine.feed.failing_examples`), which the splitter runs its parts through, ask whether an
error is an out-of-memory error too.
"""

from __future__ import annotations

import gc
import traceback

import torch

__all__ = ["MemberOutOfMemoryError", "device_kind", "forget_frames", "is_out_of_memory", "release_device_memory"]

_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    {t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t}
)
_OOM_MESSAGES = (
    "CUDA error: out of memory",
    "MPS backend out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "HIPBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
)
"""Allocators that raise a plain ``RuntimeError`` when memory runs out say one of these."""


class MemberOutOfMemoryError(RuntimeError):
    """``mesh=``: another member of this rank's replica ran out of memory in the same attempt (this rank's attempt
    succeeded and was undone), so every member splits the batch together."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says that the device's memory ran out (see the module docstring)."""
    if isinstance(exc, (*_OOM_TYPES, MemberOutOfMemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(marker in text for marker in _OOM_MESSAGES)


def device_kind(device: torch.device) -> str:
    """What the learned limits hold for: the device's type, and for CUDA its name and memory (a job resumed on
    another kind of GPU learns its limits anew)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda {props.name} {props.total_memory}"
    return device.type


def release_device_memory(device: torch.device, *, thorough: bool = False) -> None:
    """Frees what the failed attempt left: unreachable objects first (they may hold device tensors), then the
    device's cached blocks, so the next attempt starts from as much free memory as there is.

    The failed attempt's objects are young, so a collection of the young generations finds them (microseconds);
    a full collection (``thorough``, before one example is declared too large) also finds older cycles, and
    costs a few hundred milliseconds in a process that imported a model library (a heap of 10^5-10^6 objects),
    which a job that learns its limits pays only then."""
    gc.collect() if thorough else gc.collect(1)
    if device.type == "cuda" and not torch.cuda.is_initialized():
        return
    empty_cache = getattr(getattr(torch, device.type, None), "empty_cache", None)
    if callable(empty_cache):
        empty_cache()


def forget_frames(exc: BaseException) -> None:
    """Clears the local variables of the frames ``exc``'s traceback holds (the failed attempt's batch and
    activations), so that releasing the device's memory can free them."""
    if exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)
