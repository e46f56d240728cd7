"""Running one batch: ``process_batch(batch, batch_idx)`` under the job's modes, timed, with its failures kept.

The context tells the processor which batch it is in (``context.batch_indices``); the batch counts as done
(part of this rank's next commit) only when ``process_batch`` returned. An exception in loading or in
``process_batch`` is recorded for this rank (see :class:`~torch_batch_process.engine.agreement.FailureTracker`),
and the loop makes every rank stop with it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from torch_batch_process.context import CurrentBatch
from torch_batch_process.engine.agreement import FailureTracker
from torch_batch_process.engine.batches import LoadFailed
from torch_batch_process.engine.committer import Part
from torch_batch_process.engine.plan import Plan
from torch_batch_process.processor import TorchBatchProcessor

__all__ = ["BatchRunner"]


class BatchRunner:
    """Runs batches of one rank.

    Args:
        processor: the rank's processor.
        current: the context's current batch (``context.batch_indices``).
        plan: the job's plan.
        failures: the rank's failure tracker.
        inference_mode: run under ``torch.inference_mode()``.
        mode: extra context manager factory around ``process_batch`` (autocast), or ``None``.
    """

    def __init__(
        self,
        processor: TorchBatchProcessor,
        current: CurrentBatch,
        plan: Plan,
        failures: FailureTracker,
        *,
        inference_mode: bool,
        mode: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self._processor = processor
        self._current = current
        self._plan = plan
        self._failures = failures
        self._inference = torch.inference_mode if inference_mode else contextlib.nullcontext
        self._mode = mode or contextlib.nullcontext

    def load_failed(self, failed: LoadFailed, part: Part, loaded_s: float) -> None:
        """A batch whose loading raised."""
        part.timings["data"] += loaded_s
        self._failures.record(failed.error, f"loading batch {failed.batch_idx}")

    def run(self, batch_idx: int, batch: Any, part: Part, loaded_s: float) -> None:
        """Runs ``process_batch`` on a loaded batch; on success the batch joins ``part``."""
        part.timings["data"] += loaded_s
        indices = self._plan.batch_indices(batch_idx)
        self._current.enter(batch_idx, indices)
        t0 = time.perf_counter()
        try:
            with self._inference(), self._mode():
                self._processor.process_batch(batch, batch_idx)
                self._current.finish(True)  # its context.write() rows join the rank's shard
        except Exception as exc:  # noqa: BLE001 - every rank stops with it (the loop's agreement)
            self._current.finish(False)  # a batch that raised contributes no rows
            self._failures.record(exc, f"process_batch(batch_idx={batch_idx})")
            return
        finally:
            part.timings["process"] += time.perf_counter() - t0
            self._current.leave()
        part.add_batch(batch_idx, len(indices))
