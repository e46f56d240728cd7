"""Determined's ``determined.pytorch.experimental`` names, for code migrated by changing its imports."""

from torch_batch_process.batch_process import torch_batch_process
from torch_batch_process.context import TorchBatchProcessorContext
from torch_batch_process.device import get_default_device
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.reducers import MetricReducer

__all__ = [
    "MetricReducer", "TorchBatchProcessor", "TorchBatchProcessorContext", "get_default_device", "torch_batch_process"
]
