"""torch_batch_process: resumable, exactly-once batch processing with PyTorch on many GPUs and machines.

A drop-in for Determined AI's Torch Batch Processing API that runs on plain ``torch.distributed``::

    from torch_batch_process import TorchBatchProcessor, torch_batch_process

    class Processor(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context
            self.model = context.prepare_model_for_inference(build_model())

        def process_batch(self, batch, batch_idx):
            with self.context.upload_path() as path:
                torch.save(self.model(self.context.to_device(batch)), path / f"pred_{batch_idx}.pt")

    torch_batch_process(Processor, dataset, batch_size=64, checkpoint_interval=10)

The public names are imported lazily, on first use (PEP 562): ``import torch_batch_process`` and
``torch_batch_process.__version__`` do not import torch, so the ``tbp`` command starts in a fraction
of a second; ``from torch_batch_process import X`` imports what ``X`` needs, as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torch_batch_process.version import __version__

_EXPORTS: dict[str, str] = {
    "BatchProcessError": "torch_batch_process.errors",
    "BatchProcessResult": "torch_batch_process.result",
    "BatchTimeoutError": "torch_batch_process.errors",
    "CheckpointCorruptError": "torch_batch_process.errors",
    "DistributedInfo": "torch_batch_process.distributed_info",
    "DuplicateKeyError": "torch_batch_process.outputs.keyed.diff",
    "ExampleTooLargeError": "torch_batch_process.errors",
    "InvalidArgumentError": "torch_batch_process.errors",
    "JobLockedError": "torch_batch_process.errors",
    "JobMismatchError": "torch_batch_process.errors",
    "LoaderWorkerDiedError": "torch_batch_process.errors",
    "MetricReducer": "torch_batch_process.reducers",
    "OutputCorruptError": "torch_batch_process.errors",
    "PreemptedError": "torch_batch_process.errors",
    "SchemaConflictError": "torch_batch_process.errors",
    "StorageError": "torch_batch_process.errors",
    "TooManyFailuresError": "torch_batch_process.errors",
    "TorchBatchProcessor": "torch_batch_process.processor",
    "TorchBatchProcessorContext": "torch_batch_process.context",
    "VersionChangedError": "torch_batch_process.outputs.keyed.diff",
    "WorkerFailedError": "torch_batch_process.errors",
    "WorkerLostError": "torch_batch_process.errors",
    "get_default_device": "torch_batch_process.device",
    "iter_outputs": "torch_batch_process.outputs.readback",
    "predict": "torch_batch_process.functional",
    "read_failures": "torch_batch_process.observe.failures",
    "read_outputs": "torch_batch_process.outputs.readback",
    "to_device": "torch_batch_process.device",
    "torch_batch_process": "torch_batch_process.batch_process",
}
"""Public name -> the module that defines it (imported on first access)."""

_SUBMODULES = frozenset({"core", "launch", "lengths", "pytorch", "sources", "tables"})
"""Public sub-packages and modules reachable as attributes once the package is imported, as a user spells them
(``torch_batch_process.sources.parquet(...)``; ``import torch_batch_process as det`` then
``det.pytorch.experimental``, Determined's ``import determined as det`` with only the import changed)."""

__all__ = [
    "BatchProcessError",
    "BatchProcessResult",
    "BatchTimeoutError",
    "CheckpointCorruptError",
    "DistributedInfo",
    "DuplicateKeyError",
    "ExampleTooLargeError",
    "InvalidArgumentError",
    "JobLockedError",
    "JobMismatchError",
    "LoaderWorkerDiedError",
    "MetricReducer",
    "OutputCorruptError",
    "PreemptedError",
    "SchemaConflictError",
    "StorageError",
    "TooManyFailuresError",
    "TorchBatchProcessor",
    "TorchBatchProcessorContext",
    "VersionChangedError",
    "WorkerFailedError",
    "WorkerLostError",
    "__version__",
    "get_default_device",
    "iter_outputs",
    "predict",
    "read_failures",
    "read_outputs",
    "to_device",
    "torch_batch_process",
]

if TYPE_CHECKING:  # static checkers and IDEs see the eager imports
    from torch_batch_process.batch_process import torch_batch_process
    from torch_batch_process.context import TorchBatchProcessorContext
    from torch_batch_process.device import get_default_device, to_device
    from torch_batch_process.distributed_info import DistributedInfo
    from torch_batch_process.errors import (
        BatchProcessError,
        BatchTimeoutError,
        CheckpointCorruptError,
        ExampleTooLargeError,
        InvalidArgumentError,
        JobLockedError,
        JobMismatchError,
        LoaderWorkerDiedError,
        OutputCorruptError,
        PreemptedError,
        SchemaConflictError,
        StorageError,
        TooManyFailuresError,
        WorkerFailedError,
        WorkerLostError,
    )
    from torch_batch_process.functional import predict
    from torch_batch_process.observe.failures import read_failures
    from torch_batch_process.outputs.keyed.diff import DuplicateKeyError, VersionChangedError
    from torch_batch_process.outputs.readback import iter_outputs, read_outputs
    from torch_batch_process.processor import TorchBatchProcessor
    from torch_batch_process.reducers import MetricReducer
    from torch_batch_process.result import BatchProcessResult


def __getattr__(name: str) -> Any:
    """Imports a public name's module on first access and caches the name in this module."""
    if name in _SUBMODULES:  # importing it binds it in this module, as a plain submodule import does
        return importlib.import_module(f"{__name__}.{name}")
    module_name = _EXPORTS.get(name)
    if module_name is None:  # AttributeError lets ``from torch_batch_process import <submodule>`` import it
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)
