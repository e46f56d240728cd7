"""Determined-style import paths: ``from torch_batch_process.pytorch import experimental, MetricReducer``.

Code written for Determined migrates by replacing ``determined`` with ``torch_batch_process`` in its
imports: ``from determined.pytorch import experimental`` becomes
``from torch_batch_process.pytorch import experimental``, and ``determined.pytorch.MetricReducer``
becomes ``torch_batch_process.pytorch.MetricReducer``. (Importing the names from
``torch_batch_process`` directly works too.)
"""

from torch_batch_process.device import to_device
from torch_batch_process.pytorch import experimental
from torch_batch_process.reducers import MetricReducer

__all__ = ["MetricReducer", "experimental", "to_device"]
