"""The ``autocast`` option: ``None``, ``"bf16"`` or ``"fp16"``, run as ``torch.autocast`` around ``process_batch``.

:func:`resolve_autocast` checks the value once, before any work, and returns a factory that makes a
fresh context manager per batch (``contextlib.nullcontext`` for ``None``).

What each value does where (checked on torch 2.14; the check itself asks the installed torch, so an
older one that lacks a combination refuses it at validation instead of silently running in float32):

- CUDA: ``"bf16"`` (GPUs with bfloat16: Ampere and later; older ones emulate it or are refused with a
  hint to use ``"fp16"``) and ``"fp16"``. No gradient scaler is involved: this is inference.
- CPU: ``"bf16"`` is the usual choice (fast on CPUs with AVX512-BF16 or AMX). ``"fp16"`` is accepted
  because torch supports float16 autocast on CPU, but most CPUs have no fast float16 arithmetic, so it
  is mostly useful to run a GPU configuration unchanged on a laptop.
- mps: whatever torch's mps autocast accepts (float16; bfloat16 on recent macOS).

Torch itself only warns and runs in float32 when a device does not support a dtype; here that is an
:class:`~torch_batch_process.errors.InvalidArgumentError` naming ``autocast`` and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torch_batch_process.errors import InvalidArgumentError

__all__ = ["AUTOCAST_DTYPES", "resolve_autocast"]

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

_SPELLINGS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def resolve_autocast(
    value: str | None, device: torch.device | str
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """Checks ``autocast`` for ``device`` and returns a factory of the context to run each batch in.

    Args:
        value: ``None`` (no autocast), ``"bf16"`` or ``"fp16"``.
        device: the rank's device; its type is autocast's ``device_type``.

    Returns:
        A callable with no arguments returning a new context manager: ``torch.autocast(device.type,
        dtype=...)``, or ``contextlib.nullcontext()`` for ``None``.

    Raises:
        InvalidArgumentError: an unknown value, or a dtype that torch's autocast does not support on
            this device (the message names the value to use instead).
    """
    if value is None:
        return contextlib.nullcontext
    if not isinstance(value, str) or value not in AUTOCAST_DTYPES:
        raise InvalidArgumentError(f"autocast must be None, 'bf16' or 'fp16', got {value!r}{_hint(value)}")
    device = torch.device(device)
    dtype = AUTOCAST_DTYPES[value]
    _check_supported(value, dtype, device)
    return functools.partial(torch.autocast, device.type, dtype=dtype)


def _hint(value: Any) -> str:
    if isinstance(value, torch.dtype):
        for name, dtype in AUTOCAST_DTYPES.items():
            if value == dtype:
                return f" (a torch.dtype): pass autocast={name!r}"
        return ": autocast supports bfloat16 ('bf16') and float16 ('fp16') only"
    if isinstance(value, str):
        name = value.strip().lower()
        name = _SPELLINGS.get(name, name)
        if name in AUTOCAST_DTYPES:
            return f": did you mean autocast={name!r}?"
    if value is False:
        return ": pass autocast=None for no autocast"
    return ""


def _check_supported(value: str, dtype: torch.dtype, device: torch.device) -> None:
    """Enters an autocast region once and asks torch whether it is on, with this dtype."""
    other = "fp16" if value == "bf16" else "bf16"
    if not torch.amp.is_autocast_available(device.type):
        raise InvalidArgumentError(
            f"autocast={value!r}: torch has no autocast for device type {device.type!r}; pass autocast=None"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(f"autocast={value!r} on {device}: CUDA is not available; pass autocast=None")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns "Disabling autocast": the check below says it
            with torch.autocast(device.type, dtype=dtype):
                enabled = _autocast_enabled(device.type)
                active_dtype = _autocast_dtype(device.type)
    except RuntimeError as exc:  # e.g. "Current CUDA Device does not support bfloat16"
        raise InvalidArgumentError(
            f"autocast={value!r} is not supported on {device} ({exc}); use autocast={other!r} or None"
        ) from exc
    if not enabled or active_dtype != dtype:
        raise InvalidArgumentError(
            f"autocast={value!r}: torch {torch.__version__} has no {dtype} autocast on {device.type}; "
            f"use autocast={other!r} or None"
        )


def _autocast_enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4: one function per device type
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return bool(torch.is_autocast_enabled())


def _autocast_dtype(device_type: str) -> torch.dtype:
    get = getattr(torch, "get_autocast_dtype", None)
    if get is not None:
        return get(device_type)
    if device_type == "cpu":  # torch < 2.4
        return torch.get_autocast_cpu_dtype()
    return torch.get_autocast_gpu_dtype()
