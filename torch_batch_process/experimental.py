"""Alias of :mod:`torch_batch_process.pytorch.experimental`: ``from torch_batch_process import experimental``."""

from torch_batch_process.pytorch.experimental import (
    MetricReducer,
    TorchBatchProcessor,
    TorchBatchProcessorContext,
    get_default_device,
    torch_batch_process,
)

__all__ = [
    "MetricReducer", "TorchBatchProcessor", "TorchBatchProcessorContext", "get_default_device", "torch_batch_process"
]
