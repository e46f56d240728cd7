"""Running one batch: ``process_batch(batch, batch_idx)`` under the job's modes, timed, with its failures kept.

The context tells the processor which batch it is in (``context.batch_indices``); the batch counts as done
(part of this rank's next commit) only when ``process_batch`` returned. An exception in loading or in
``process_batch`` is recorded for this rank (see :class:`~torch_batch_process.engine.agreement.FailureTracker`),
and the loop makes every rank stop with it; with ``on_error="skip"`` the batch goes to the
:class:`~torch_batch_process.engine.failures.FailureHandler` instead, which bisects it. With ``batch_timeout``
each call is timed by the :class:`~torch_batch_process.engine.watchdog.BatchWatchdog`.
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
from torch_batch_process.engine.failures import FailureHandler, no_span
from torch_batch_process.engine.part import Part
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
        span: context manager factory timing a batch (``batch_timeout``), or ``None``.
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
        span: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self._processor = processor
        self._current = current
        self._plan = plan
        self._failures = failures
        self._inference = torch.inference_mode if inference_mode else contextlib.nullcontext
        self._mode = mode or contextlib.nullcontext
        self.span = span or no_span
        self.skip: FailureHandler | None = None  # on_error="skip" (set by the loop)

    def loading(self) -> contextlib.AbstractContextManager[Any]:
        """The mode batches are loaded in: ``torch.inference_mode()`` with ``inference_mode`` (as in a hand loop
        under it: tensors that the main process makes, e.g. ``collate_fn``'s without workers, cost less), else
        none."""
        return self._inference()

    def process(self, batch: Any, batch_idx: int) -> None:
        """``process_batch`` under the job's modes; tells the current batch whether it returned (its
        ``context.write()`` rows join the rank's shard, or are dropped)."""
        try:
            with self._inference(), self._mode():
                self._processor.process_batch(batch, batch_idx)
        except BaseException:
            self._current.finish(False)
            raise
        self._current.finish(True)

    def load_failed(self, failed: LoadFailed, part: Part, loaded_s: float) -> None:
        """A batch whose loading raised."""
        part.timings["data"] += loaded_s
        if self.skip is not None and self.skip.recoverable(failed.error):
            indices = self._plan.batch_indices(failed.batch_idx)
            self._recover(failed.batch_idx, indices, failed.error, "load", part)
            return
        self._failures.record(failed.error, f"loading batch {failed.batch_idx}")

    def run(self, batch_idx: int, batch: Any, part: Part, loaded_s: float) -> None:
        """Runs ``process_batch`` on a loaded batch; on success the batch joins ``part``."""
        part.timings["data"] += loaded_s
        indices = self._plan.batch_indices(batch_idx)
        self._current.enter(batch_idx, indices)
        t0 = time.perf_counter()
        skip = self.skip
        if skip is not None:
            skip.begin(part)
        try:
            with self.span(batch_idx):
                self.process(batch, batch_idx)
        except Exception as exc:  # noqa: BLE001 - every rank stops with it (the loop's agreement)
            if skip is not None:
                skip.rollback(part)
            if skip is not None and skip.recoverable(exc):
                self._current.leave()
                self._recover(batch_idx, indices, exc, "process", part)
            else:
                self._failures.record(exc, f"process_batch(batch_idx={batch_idx})")
            return
        finally:
            seconds = time.perf_counter() - t0
            part.timings["process"] += seconds
            self._current.leave()
        if skip is not None:
            skip.keep()
        part.add_batch(batch_idx, len(indices), seconds)

    def _recover(self, batch_idx: int, indices: Any, error: BaseException, phase: str, part: Part) -> None:
        """``on_error="skip"``: bisects a failed batch; an error that is no example's fault fails the job."""
        assert self.skip is not None
        try:
            self.skip.recover(batch_idx, indices, error, phase, part)
        except Exception as exc:  # noqa: BLE001 - TooManyFailuresError, BatchTimeoutError...
            self._failures.record(exc, f"splitting failed batch {batch_idx}")
