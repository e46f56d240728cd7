"""The arguments of one call of :func:`~torch_batch_process.torch_batch_process`, checked: a public type every
layer may import (the checks themselves are :mod:`torch_batch_process.validation`'s)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch_batch_process.failure_options import FailureOptions
from torch_batch_process.mesh_shape import MeshShape
from torch_batch_process.processor import TorchBatchProcessor

__all__ = ["DEFAULT_BUCKET_WINDOW", "JobArguments", "Script"]

DEFAULT_BUCKET_WINDOW = 100
"""Default ``bucket_window``: the examples of 100 batches are sorted together."""


@dataclass(frozen=True)
class Script:
    """The script that runs a job: the resolved absolute path of the ``__main__`` file, and the working directory
    it was started from (both resolved, symbolic links followed)."""

    path: str
    workdir: str

    @property
    def from_workdir(self) -> str:
        """The script's path relative to its working directory (``job.py``, ``../a/job.py``)."""
        return os.path.relpath(self.path, self.workdir)

    def same_as(self, other: Script) -> bool:
        """Whether ``other`` names the same script: the same file, or the same path from the working directory
        (the checkout was moved, or the cluster copied the code to a new folder, and the script is started from
        the same place in it)."""
        return self.path == other.path or self.from_workdir == other.from_workdir


@dataclass(frozen=True)
class JobArguments:
    """Validated arguments of one call."""

    processor_cls: type[TorchBatchProcessor]
    dataset: Any
    dataset_length: int
    """Examples of a map-style dataset; for a streaming source its rows if known from metadata, else -1."""
    batch_size: int
    max_batches: int | None
    checkpoint_interval: int
    dataloader_kwargs: dict[str, Any]
    storage_path: str
    storage_options: dict[str, Any] | None
    job_name: str
    resume: bool
    inference_mode: bool
    schedule: str = "static"
    lengths: Any = None
    """``bucket_by`` resolved: one length per example (an integer numpy array), or ``None`` (contiguous batches)."""
    bucket_window: int = DEFAULT_BUCKET_WINDOW
    max_tokens: int | str | None = None
    """As given: an int, ``"auto"`` (learned, DESIGN §15) or ``None``; plans use
    :func:`~torch_batch_process.engine.plan.bucket_options.planned_max_tokens`."""
    lengths_s: float = 0.0
    """Seconds spent getting the lengths (part of the plan's cost)."""
    device_prefetch: bool | None = None
    """Checked on the rank's device (:func:`~torch_batch_process.engine.feed.prefetch.validate_device_prefetch`)."""
    autocast: str | None = None
    """Checked on the rank's device (:func:`~torch_batch_process.engine.feed.autocast.resolve_autocast`)."""
    output_format: str = "parquet"
    """Format of the shards of ``context.write()``: ``"parquet"`` or ``"jsonl"``."""
    failures: FailureOptions = FailureOptions()
    """``on_error``, ``max_failures``, ``batch_timeout`` (:mod:`torch_batch_process.failure_options`)."""
    table: Any = None
    """The table target of ``context.write()`` rows (a :class:`~torch_batch_process.tables.TableTarget`), or
    ``None``."""
    script: Script | None = None
    """The script that runs the call (:func:`~torch_batch_process.validation.launching_script`): a job started by
    another one is refused."""
    keyed: Any = None
    """A keyed job's options (``key=``...: :class:`~torch_batch_process.outputs.keyed.options.KeyedOptions`), or
    ``None``."""
    mesh: MeshShape | None = None
    """``mesh=`` parsed (names and sizes, the outer one the replicas), or ``None``: every rank its own replica."""
