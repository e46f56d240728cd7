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
"""

from torch_batch_process.context import TorchBatchProcessorContext
from torch_batch_process.device import get_default_device, to_device
from torch_batch_process.engine.distributed import DistributedInfo
from torch_batch_process.errors import (
    BatchProcessError,
    CheckpointCorruptError,
    InvalidArgumentError,
    JobLockedError,
    JobMismatchError,
    StorageError,
    WorkerFailedError,
    WorkerLostError,
)
from torch_batch_process.batch_process import torch_batch_process
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.reducers import MetricReducer
from torch_batch_process.result import BatchProcessResult

__version__ = "0.1.0"

__all__ = [
    "BatchProcessError",
    "BatchProcessResult",
    "CheckpointCorruptError",
    "DistributedInfo",
    "InvalidArgumentError",
    "JobLockedError",
    "JobMismatchError",
    "MetricReducer",
    "StorageError",
    "TorchBatchProcessor",
    "TorchBatchProcessorContext",
    "WorkerFailedError",
    "WorkerLostError",
    "__version__",
    "get_default_device",
    "to_device",
    "torch_batch_process",
]
