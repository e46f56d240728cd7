"""Running one batch: ``process_batch(batch, batch_idx)`` under the job's modes, timed, with its failures kept.

The context tells the processor which batch it is in (``context.batch_indices``); the batch counts as done
(part of this rank's next commit) only when ``process_batch`` returned, for each of its parts if it ran in
parts. An exception in loading or in ``process_batch`` is recorded for this rank (see
:class:`~torch_batch_process.engine.rank_failure.RankFailure`), and the loop makes every rank stop with it,
except that:

- with ``on_oom="split"`` (the default) an out-of-memory error goes to the
  :class:`~torch_batch_process.engine.feed.oom.OomSplitter`, which runs the batch in parts that fit, and a batch that
  the rank's :class:`~torch_batch_process.engine.feed.fitting.BatchFitter` knows would not fit arrives from the feed
  already cut in parts (:class:`~torch_batch_process.engine.feed.batches.Cut`), or is cut here when what the rank
  learned changed since the feed loaded it;
- with ``on_error="skip"`` the batch goes to the
  :class:`~torch_batch_process.engine.feed.failing_examples.FailingExamples`, which bisects it.

With either, every attempt runs as a transaction
(:class:`~torch_batch_process.engine.feed.failing_examples.Transactions`), and the runner holds no reference to a
batch that failed while its parts run, so its device memory can be released. With ``batch_timeout`` each call is
timed by the :class:`~torch_batch_process.engine.feed.watchdog.BatchWatchdog`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_batch_process.context import CurrentBatch
from torch_batch_process.engine.feed.batches import Cut, LoadFailed
from torch_batch_process.engine.feed.device_memory import forget_frames, is_out_of_memory
from torch_batch_process.engine.feed.failing_examples import FailingExamples, no_span
from torch_batch_process.engine.feed.oom import OomSplitter
from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.engine.rank_failure import RankFailure
from torch_batch_process.engine.work import Part, RankWork
from torch_batch_process.processor import TorchBatchProcessor

__all__ = ["BatchCall", "BatchRunner", "Guards"]


class BatchCall:
    """``process_batch(batch, batch_idx)`` of one rank's processor under the job's modes.

    Args:
        processor: the rank's processor.
        current: the context's current batch (``context.batch_indices``; told whether the call returned).
        inference_mode: run under ``torch.inference_mode()``.
        mode: extra context manager factory around ``process_batch`` (autocast), or ``None``.
        no_grad: ``inference_mode`` means ``torch.no_grad()`` (``mesh=`` jobs).
    """

    def __init__(
        self,
        processor: TorchBatchProcessor,
        current: CurrentBatch,
        *,
        inference_mode: bool,
        mode: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        no_grad: bool = False,
    ) -> None:
        self._processor: TorchBatchProcessor | None = processor
        self.current = current
        # a mesh job (no_grad): torch.no_grad() stands for inference_mode, under which DTensor's tensor-parallel
        # layers take a slower path (all-gathers instead of all-reduces; notes/43-mesh.md §2): no autograd either way
        inference = torch.no_grad if no_grad else torch.inference_mode
        self.inference = inference if inference_mode else contextlib.nullcontext
        self._mode = mode or contextlib.nullcontext

    def __call__(self, batch: Any, batch_idx: int) -> None:
        """``process_batch`` under the job's modes; tells the current batch whether it returned (its
        ``context.write()`` rows join the rank's shard, or are dropped)."""
        assert self._processor is not None, "the rank's batches are done"
        try:
            with self.inference(), self._mode():
                self._processor.process_batch(batch, batch_idx)
        except BaseException:
            self.current.finish(False)
            raise
        self.current.finish(True)

    def close(self) -> None:
        """When the rank's batches are done: drops the processor (its model, on the device too), so that it goes
        when the call returns (a second call in the process may need that memory)."""
        self._processor = None


@dataclass(frozen=True)
class Guards:
    """What guards a rank's batches (:func:`~torch_batch_process.engine.feed.error_handling.guard_batches`)."""

    failing: FailingExamples | None = None
    """Transactions and bisection (``on_error="skip"`` or ``on_oom="split"``); ``None``: a failure fails the job and
    nothing is to be undone."""
    splitter: OomSplitter | None = None
    """``on_oom="split"``: runs a batch that ran out of memory in parts that fit."""


class BatchRunner:
    """Runs batches of one rank.

    Args:
        call: the rank's ``process_batch`` under the job's modes.
        plan: the job's plan.
        rank_failure: the rank's failure.
        work: the rank's work since its previous commit (a batch done joins its part).
        guards: what guards the batches.
        span: context manager factory timing a batch (``batch_timeout``), or ``None``.
        in_flight: whether a batch went in flight in a generation engine (it joins the part when its last prompt
            is answered: :class:`~torch_batch_process.engine.feed.in_flight.InFlight`), or ``None``.
    """

    def __init__(
        self,
        call: BatchCall,
        plan: Plan,
        rank_failure: RankFailure,
        work: RankWork,
        guards: Guards,
        span: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
        in_flight: Callable[[int], bool] | None = None,
    ) -> None:
        self._in_flight = in_flight or _never
        self._call = call
        self._current = call.current
        self._plan = plan
        self._rank_failure = rank_failure
        self._work = work
        self._inference = call.inference
        self.span = span or no_span
        self._guard = guards.failing
        self._splitter = guards.splitter
        self._split = self._splitter.run_parts if self._splitter is not None else None

    def close(self) -> None:
        """When the rank's batches are done: drops the processor (see :meth:`BatchCall.close`)."""
        self._call.close()

    def step(self, batches: Iterator[tuple[Any, Any]]) -> bool:
        """Loads this rank's next batch from ``batches`` (the feed) and runs it; on success the batch joins the
        rank's current part. Returns ``False`` when there is no batch left for this rank (dynamic schedule), or a
        stop was seen at a claim.

        Loading runs under ``torch.inference_mode()`` with ``inference_mode`` (as in a hand loop under it:
        tensors that the main process makes, e.g. ``collate_fn``'s without workers, cost less)."""
        part = self._work.part
        t0 = time.perf_counter()
        try:
            with self._inference():
                key, batch = next(batches)
        except StopIteration:
            return False
        except LoadFailed as failed:
            self.load_failed(failed, part, time.perf_counter() - t0)
            return True
        part.timings["data"] += time.perf_counter() - t0
        if self._guard is None:  # on_oom="raise", on_error="raise": nothing to undo, nothing to split
            self._run_plain(key, batch, part)
            return True
        if type(key) is Cut:
            pieces, loaded = key.pieces, batch
            batch_idx = key.batch_idx
        else:
            batch_idx = key
            pieces, loaded = [self._plan.batch_indices(batch_idx)], [batch]
        del batch  # the loaded pieces are dropped one by one as they run: none is kept while a split runs
        self._run_pieces(batch_idx, pieces, loaded, part, whole=type(key) is not Cut)
        return True

    def load_failed(self, failed: LoadFailed, part: Part, loaded_s: float) -> None:
        """A batch whose loading (or copy to the device) raised."""
        part.timings["data"] += loaded_s
        if self._guard is None:
            self._rank_failure.record(failed.error, f"loading batch {failed.batch_idx}")
            return
        indices = self._plan.batch_indices(failed.batch_idx)
        self._run_pieces(failed.batch_idx, [indices], [failed], part, whole=True)

    # ------------------------------------------------------------------ running

    def _run_plain(self, batch_idx: int, batch: Any, part: Part) -> None:
        """A batch with nothing to undo if it fails: the job fails with it."""
        indices = self._plan.batch_indices(batch_idx)
        self._current.enter(batch_idx, indices)
        t0 = time.perf_counter()
        try:
            with self.span(batch_idx):
                self._call(batch, batch_idx)
        except Exception as exc:  # noqa: BLE001 - every rank stops with it (the loop's agreement)
            self._rank_failure.record(exc, f"process_batch(batch_idx={batch_idx})")
            return
        finally:
            seconds = time.perf_counter() - t0
            part.timings["process"] += seconds
            self._current.leave()
        if not self._in_flight(batch_idx):
            part.add_batch(batch_idx, len(indices), seconds)

    def _run_pieces(
        self, batch_idx: int, pieces: list[Sequence[int]], loaded: list[Any], part: Part, *, whole: bool
    ) -> None:
        """Runs batch ``batch_idx`` as ``pieces`` (its examples, in order; one piece: the whole batch), each from
        ``loaded`` (a batch loaded by the feed, or its :class:`LoadFailed`), each as a transaction; a piece that
        fails goes to the splitter or the bisection. The batch joins ``part`` when no failure failed the job."""
        splitter = self._splitter
        fitter = splitter.fitter if splitter is not None else None
        t0 = time.perf_counter()
        succeeded = 0
        split = len(pieces) > 1  # in parts (counted once per batch)
        failed = False  # a piece failed (a failing example, or out of memory): the batch did not run whole
        try:
            for i, indices in enumerate(pieces):
                batch, loaded[i] = loaded[i], None
                error: BaseException | None = None
                if isinstance(batch, LoadFailed):
                    error, phase = batch.error, "load"
                elif fitter is not None and fitter.active and not fitter.fits(indices):
                    phase = "cut"  # what the rank learned since the feed loaded it: cut it now
                else:
                    error = self._attempt(batch_idx, indices, batch, part, "" if whole else f"part_{indices[0]}/")
                    phase = "process"
                    if error is None:
                        succeeded += len(indices)
                        if fitter is not None and fitter.active:
                            fitter.fitted(indices)
                        continue
                del batch
                failed = True
                split = split or (splitter is not None and (error is None or is_out_of_memory(error)))
                done = self._recover(batch_idx, indices, error, phase, part)
                if done is None:
                    return
                succeeded += done
        finally:
            seconds = time.perf_counter() - t0
            part.timings["process"] += seconds
            # the failed attempt's traceback reaches this frame (its frames' f_back): a reference to the error from
            # here is a cycle that keeps the batch (on the device too) alive until a garbage collection
            error = batch = None  # noqa: F841 - dropped on purpose (see above)
        if split and fitter is not None:
            fitter.split_batches += 1
        ran_whole = whole and not split and not failed
        if self._in_flight(batch_idx):  # in a generation engine: joins the part when its last prompt is answered
            return
        part.add_batch(batch_idx, succeeded, seconds if ran_whole else None)  # run whole: in the timeline

    def _attempt(
        self, batch_idx: int, indices: Sequence[int], batch: Any, part: Part, prefix: str
    ) -> BaseException | None:
        """Runs one loaded batch or piece as a transaction; returns its error."""
        guard = self._guard
        assert guard is not None
        guard.transactions.begin(part, prefix)
        self._current.enter(batch_idx, indices)
        try:
            with self.span(batch_idx):
                self._call(batch, batch_idx)
        except Exception as exc:  # noqa: BLE001 - handled by the caller
            return guard.transactions.rollback(part, exc)
        finally:
            self._current.leave()
        return guard.transactions.keep(part)  # mesh=: another member's out-of-memory error undoes it

    def _recover(
        self, batch_idx: int, indices: Sequence[int], error: BaseException | None, phase: str, part: Part
    ) -> int | None:
        """The examples ``indices`` failed together with ``error`` (``None``: they would not fit): splits or
        bisects them; returns how many succeeded, ``None`` when the failure fails the job (recorded)."""
        guard = self._guard
        assert guard is not None
        try:
            if self._splitter is not None and (error is None or is_out_of_memory(error)):
                return self._splitter.run_parts(batch_idx, indices, part, error)
            if error is not None and guard.skip and guard.recoverable(error):
                if phase == "process":
                    forget_frames(error)  # the failed attempt's batch: not kept while the halves run
                return guard.recover(batch_idx, indices, error, phase, part, self._split)
        except Exception as exc:  # noqa: BLE001 - ExampleTooLargeError, TooManyFailuresError, BatchTimeoutError...
            self._rank_failure.record(exc, f"running batch {batch_idx} in parts")
            return None
        assert error is not None
        where = f"loading batch {batch_idx}" if phase == "load" else f"process_batch(batch_idx={batch_idx})"
        self._rank_failure.record(error, where)
        return None


def _never(batch_idx: int) -> bool:
    """No batch goes in flight (no generation engine)."""
    return False
