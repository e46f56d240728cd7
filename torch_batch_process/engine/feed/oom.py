"""Out-of-memory errors with ``on_oom="split"`` (DESIGN §15): a batch that does not fit runs in parts that do.

**What counts** (:func:`~torch_batch_process.engine.feed.device_memory.is_out_of_memory`).
``torch.OutOfMemoryError`` (CUDA's, and every accelerator whose allocator raises it), and the
``RuntimeError`` s raised for the same thing elsewhere (MPS: ``"MPS backend out of memory"``; a CUDA call that
fails with ``cudaErrorMemoryAllocation``; cuBLAS/cuDNN workspaces; a CPU allocation that fails), raised by
``process_batch`` or by the copy of its batch to the device (:mod:`~torch_batch_process.engine.feed.prefetch`).

**What happens** (:class:`OomSplitter`): the failed attempt leaves nothing (it ran as a transaction, see
:mod:`~torch_batch_process.engine.feed.failing_examples`), its frames are cleared and the device's cache is released
(a garbage collection of the young generations, then ``empty_cache()`` of the device's module; see
:func:`~torch_batch_process.engine.feed.device_memory.release_device_memory`), and the rank's
:class:`~torch_batch_process.engine.feed.fitting.BatchFitter` learns the size that did not fit. The batch's examples
then run in parts, in their order, each loaded again in the main process and run as a transaction: each part's
``process_batch`` gets the batch's own ``batch_idx``, ``context.batch_indices`` gives the part's examples, and its
``upload_path()`` files go under ``part_<first dataset index>/`` (the naming of §11), so the outputs equal those
of the batch run whole, each written once. A part that runs out of memory is cut again (each cut smaller than the
part that failed); what fits is learned too, so later batches are cut *before* they run
(:mod:`~torch_batch_process.engine.feed.batches`) and do not fail again.

**One example that does not fit**: tried once more after a full garbage collection and the cache's release; if it
runs out of memory again, it is a failing example with ``on_error="skip"`` (recorded, skipped) and otherwise the
job fails with :class:`~torch_batch_process.errors.ExampleTooLargeError` naming it and its length. Any other error
of a part is handled as the error of a batch: bisected with ``"skip"``, else it fails the job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from torch_batch_process.engine.feed.device_memory import forget_frames, is_out_of_memory, release_device_memory
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.work import Part
from torch_batch_process.errors import ExampleTooLargeError

if TYPE_CHECKING:
    from torch_batch_process.engine.feed.failing_examples import FailingExamples

__all__ = ["OomSplitter"]

logger = logging.getLogger(__name__)

class OomSplitter:
    """Runs the examples of a batch that ran out of memory (or would) in parts that fit (see the module docstring).

    Args:
        fitter: the rank's fitter (what fits, learned).
        handler: the rank's transactions: loads and runs one part, records failing examples, bisects failures.
        device: the rank's device (its cache is released after each out-of-memory error).
        rank: this rank (for messages).
        lengths: every example's length (``bucket_by``), to name an example too large, or ``None``.
    """

    def __init__(
        self,
        *,
        fitter: BatchFitter,
        handler: FailingExamples,
        device: torch.device,
        rank: int,
        lengths: np.ndarray | None,
    ) -> None:
        self.fitter = fitter
        self._handler = handler
        self._device = device
        self._rank = rank
        self._lengths = lengths

    def run_parts(self, batch_idx: int, indices: Sequence[int], part: Part, error: BaseException | None) -> int:
        """Runs the examples ``indices`` of batch ``batch_idx`` in parts that fit; ``error``: the out-of-memory
        error they raised as one part (``None``: they were cut before running). Returns how many succeeded.

        Raises:
            ExampleTooLargeError: one example does not fit (without ``on_error="skip"``).
            Exception: a part's other error, when it is not bisected (``on_error="raise"``), and the errors that
                fail a job even with ``"skip"`` (``TooManyFailuresError``...).
        """
        fitter = self.fitter
        remaining = list(indices)
        below: int | None = None
        if error is not None:
            self._ran_out(batch_idx, remaining, error)
            below = len(remaining)
        succeeded = 0
        retried = False
        while remaining:
            take = fitter.next_part(remaining, below)
            piece = remaining[:take]
            failure = self._handler.attempt(batch_idx, piece, part)
            if failure is None:
                fitter.fitted(piece)
                succeeded += take
                remaining, below, retried = remaining[take:], None, False
                continue
            phase, exc = failure
            try:
                if not is_out_of_memory(exc):
                    if not self._handler.skip:
                        raise exc
                    succeeded += self._handler.recover(batch_idx, piece, exc, phase, part, self.run_parts)
                    remaining, below, retried = remaining[take:], None, False
                elif take > 1 or not retried:  # a smaller part next; one example: once more, everything released
                    self._ran_out(batch_idx, piece, exc, thorough=take == 1)
                    below, retried = take, take == 1
                else:
                    self.fitter.ran_out(piece)
                    self._too_large(batch_idx, piece[0], phase, exc, part)
                    forget_frames(exc)
                    release_device_memory(self._device)
                    remaining, below, retried = remaining[1:], None, False
            finally:
                failure = exc = None  # its traceback reaches this frame: a cycle that would keep the part's batch alive
        return succeeded

    def _ran_out(self, batch_idx: int, piece: list[int], exc: BaseException, *, thorough: bool = False) -> None:
        """Learns that ``piece`` does not fit, says so, and frees what the attempt left."""
        key, size = self.fitter.ran_out(piece)
        unit = self.fitter.limits.unit
        logger.warning(
            "rank %d: batch %d: %d example(s) (%s) ran out of device memory (%s: %s); running them in parts that "
            "fit. Learned so far: %s",
            self._rank, batch_idx, len(piece), f"{size:,} {unit}", type(exc).__name__, _first_line(exc),
            self.fitter.limits.describe(),
        )
        forget_frames(exc)
        release_device_memory(self._device, thorough=thorough)

    def _too_large(self, batch_idx: int, index: int, phase: str, exc: BaseException, part: Part) -> None:
        """One example ran out of memory alone, twice: a failing example, or the job's error."""
        if self._handler.skip:
            self._handler.record(batch_idx, index, phase, exc)
            return
        length = f"length {int(self._lengths[index]):,}" if self._lengths is not None else "its length unknown"
        raise ExampleTooLargeError(
            f"example {index} of batch {batch_idx} ({length}) does not fit in the memory of {self._device} even "
            f"alone: {type(exc).__name__}: {_first_line(exc)}. Pass on_error='skip' to record it as a failing "
            "example and go on (tbp failures lists it), shorten it, or make the model need less memory (e.g. "
            "autocast='bf16'); the job stops here and a re-run resumes from its last commit"
        ) from exc


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""
