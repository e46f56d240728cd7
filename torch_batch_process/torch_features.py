"""What the installed torch offers that some options need, checked before any work.

The rendezvous store's queues and connections of its own (``Store.queue_push``, ``Store.clone``) came with torch
2.8; ``schedule="dynamic"`` (its votes travel through a queue) and ``batch_timeout`` (its watchdog thread has a
store connection of its own) use them on several ranks. ``setup.cfg`` asks for torch 2.8 or later; an older torch
installed past that (``--no-deps``, a conda environment) gets an :class:`InvalidArgumentError` naming the option,
not a failure once the ranks run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_batch_process.errors import InvalidArgumentError

__all__ = ["MIN_TORCH", "require_store_queues"]

MIN_TORCH = "2.8"
"""The oldest torch the library supports (setup.cfg's ``install_requires``)."""


def require_store_queues(option: str) -> None:
    """Raises :class:`InvalidArgumentError` naming ``option`` when this torch's store has no queues or clones."""
    store = getattr(dist, "Store", None)
    if store is not None and hasattr(store, "queue_push") and hasattr(store, "clone"):
        return
    raise InvalidArgumentError(
        f"{option} needs torch >= {MIN_TORCH} (its rendezvous store's queues and connections), and this is torch "
        f"{torch.__version__}: upgrade torch (pip install 'torch>={MIN_TORCH}'), or leave {option.split('=')[0]} out"
    )
