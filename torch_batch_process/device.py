"""Devices: which device a rank uses, and moving nested batches onto it."""

from __future__ import annotations

import copy
import logging
import os
import socket
from collections import UserDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_PASSTHROUGH_TYPES = (str, bytes, int, float, bool, complex, type(None))


def _local_rank() -> int:
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def get_default_device(core_context: Any = None) -> torch.device:
    """Returns the device of this rank: ``cuda:<LOCAL_RANK>`` when CUDA is there, else ``mps``, else cpu.

    With CUDA it also makes that device current (``torch.cuda.set_device``), so that code which
    allocates on "cuda" without an index lands on this rank's GPU. When there are fewer GPUs than
    local ranks, ranks share GPUs round-robin.

    Args:
        core_context: optional, for code written for Determined's ``get_default_device(core_context)``: an object
            whose ``distributed.local_rank`` (Determined's core context) or ``distributed.get_local_rank()`` (the
            processor's context) gives the local rank; ``None``: the ``LOCAL_RANK`` environment variable.
    """
    return local_rank_device(_context_local_rank(core_context))


def local_rank_device(local_rank: int) -> torch.device:
    """The device of the process of local rank ``local_rank`` (see :func:`get_default_device`), made current."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _context_local_rank(core_context: Any) -> int:
    """The local rank a Determined-style context states, else ``LOCAL_RANK``."""
    distributed = getattr(core_context, "distributed", None)
    local_rank = getattr(distributed, "local_rank", None)
    if local_rank is None and callable(getattr(distributed, "get_local_rank", None)):
        local_rank = distributed.get_local_rank()
    return int(local_rank) if local_rank is not None else _local_rank()


def gpu_uuid(device: torch.device) -> str:
    """A name of the CUDA ``device`` unique across machines: its UUID (the same in every process that sees the
    GPU, whatever ``CUDA_VISIBLE_DEVICES`` numbers it), else the host, visible devices and index."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        return str(uuid)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return f"{socket.gethostname()}/{visible}/{device.index}"


def to_device(data: Any, device: torch.device | str, warned_types: set[type] | None = None) -> Any:
    """Moves ``data`` to ``device``, recursively.

    Tensors are moved (``non_blocking`` when the source is in pinned memory, so the copy overlaps
    with compute); numpy arrays become tensors; dicts, lists, tuples and namedtuples are rebuilt with
    their items moved; other objects with a callable ``to`` attribute are moved with it. Anything
    else (strings, numbers, None, PIL images...) is returned unchanged; for types that are not plain
    Python values a warning is logged once per type.

    Args:
        data: a tensor, array, or any nesting of dicts, lists and tuples of them.
        device: the target device.
        warned_types: types already warned about (kept for Determined compatibility).

    Returns:
        ``data`` with every tensor on ``device``.
    """
    device = torch.device(device)
    if warned_types is None:
        warned_types = set()
    return _to_device(data, device, warned_types)


def _to_device(data: Any, device: torch.device, warned_types: set[type]) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=data.device.type == "cpu" and data.is_pinned())
    if isinstance(data, np.ndarray):
        if data.dtype.kind in "OUSV":  # objects, strings, raw bytes: no tensor equivalent
            _warn_once(type(data), warned_types, "numpy arrays of dtype " + str(data.dtype))
            return data
        return torch.as_tensor(data).to(device)
    if isinstance(data, np.generic):
        return data
    if isinstance(data, _PASSTHROUGH_TYPES):
        return data
    if isinstance(data, Mapping):
        return rebuild_mapping(data, {key: _to_device(value, device, warned_types) for key, value in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_to_device(value, device, warned_types) for value in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(value, device, warned_types) for value in data)
    to = getattr(data, "to", None)
    if callable(to):
        return to(device)
    _warn_once(type(data), warned_types, type(data).__name__)
    return data


def rebuild_mapping(data: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """A mapping of ``data``'s type holding ``items`` (``data``'s values moved), ``data`` left as it was.

    A ``UserDict`` (a tokenizer's ``BatchEncoding``, an image processor's ``BatchFeature``) is copied with its
    attributes, so what they hold besides the items stays (a fast tokenizer's encodings: ``word_ids()``,
    ``char_to_token()``... keep working, as after ``BatchEncoding.to(device)``); another mapping type is built from
    ``items``, or, when its constructor does not take them, a plain dict is returned.
    """
    if isinstance(data, UserDict):
        clone = copy.copy(data)
        clone.data = items
        return clone
    try:
        return type(data)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def _warn_once(kind: type, warned_types: set[type], description: str) -> None:
    if kind not in warned_types:
        warned_types.add(kind)
        logger.warning("to_device: %s cannot be moved to a device; it is passed through unchanged", description)
