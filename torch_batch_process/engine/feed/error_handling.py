"""The call's error handling around a rank's batches (DESIGN §11, §15): ``on_error="skip"`` and ``on_oom="split"``
(a :class:`~torch_batch_process.engine.feed.failing_examples.FailingExamples` on the runner for transactions and
bisection, and an :class:`~torch_batch_process.engine.feed.oom.OomSplitter`), ``batch_timeout`` (a
:class:`~torch_batch_process.engine.feed.watchdog.BatchWatchdog` timing the runner's batches and the feed's
loads), and ``max_failures`` over all ranks at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torch_batch_process.context import CurrentBatch
from torch_batch_process.device import to_device
from torch_batch_process.engine.distributed import RendezvousStore
from torch_batch_process.engine.feed.batches import BatchFeed
from torch_batch_process.engine.feed.failing_examples import FailingExamples, check_total
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.feed.oom import OomSplitter
from torch_batch_process.engine.feed.runner import BatchRunner
from torch_batch_process.engine.feed.watchdog import BatchWatchdog
from torch_batch_process.failure_options import FailureOptions
from torch_batch_process.jobstore.opening import Start
from torch_batch_process.outputs.files import OutputStager
from torch_batch_process.reducers import ReducerRegistry

__all__ = ["check_max_failures", "guard_batches"]


def guard_batches(
    runner: BatchRunner,
    feed: BatchFeed,
    options: FailureOptions,
    *,
    rank: int,
    store: Callable[[], RendezvousStore] | None,
    device: torch.device | None,
    current: CurrentBatch,
    stager: OutputStager,
    reducers: ReducerRegistry,
    start: Start,
    num_examples: int,
    failures_url: str,
    fitter: BatchFitter | None = None,
    original_batch: Callable[[int, int], int] | None = None,
    lengths: np.ndarray | None = None,
    rank_device: torch.device | None = None,
) -> BatchWatchdog | None:
    """Sets up ``on_error="skip"``, ``on_oom="split"`` and ``batch_timeout`` on ``runner`` and ``feed``; returns the
    started watchdog
    (``batch_timeout``), which the caller closes when its call ends (so that a rank whose batches are done still
    dumps its stacks when another rank's batch times out), else ``None``.

    Args:
        runner: the rank's batch runner.
        feed: the rank's batch feed (its loader's dataset and ``collate_fn`` load a failing batch's parts).
        options: ``on_error``, ``max_failures``, ``batch_timeout``.
        rank: this rank.
        store: several ranks: a factory of rendezvous store connections for the watchdog (a timeout is told to
            the others); ``None``: one rank.
        device: the device a failing batch's parts go to before ``process_batch`` (device prefetch: batches
            arrive there); ``None``: they stay where the loader put them.
        current: the context's current batch.
        stager: the rank's ``upload_path()`` files (a failed part's are dropped, failure records staged).
        reducers: the rank's reducers (restored after a failed part).
        start: what opening the job found (the attempt, the failures committed before).
        num_examples: examples of the job's plan (``max_failures`` as a fraction).
        failures_url: where failure records are published (for messages).
        fitter: the rank's memory limits with ``on_oom="split"`` (``None``: ``"raise"``).
        original_batch: a retry's plan: the batch an example failed in, in the job (its failure records keep it).
        lengths: the examples' lengths of a ``bucket_by`` plan (the splitter cuts by them), else ``None``.
        rank_device: the rank's device (the splitter releases its memory after an out-of-memory error).
    """
    watchdog = None
    if options.batch_timeout is not None:
        watchdog = BatchWatchdog(options.batch_timeout, rank, store)
        runner.span = watchdog.span
        feed.watch = watchdog.span  # a batch whose loading hangs is a stuck batch too
        watchdog.start()
    if options.skip or fitter is not None:
        place: Any = (lambda batch: to_device(batch, device)) if device is not None else (lambda batch: batch)
        runner.guard = FailingExamples(
            skip=options.skip,
            dataset=feed.loader.dataset,  # a source's rows by global row number (engine/feed/streams.py)
            collate_fn=feed.loader.collate_fn,
            place=place,
            process=runner.process,
            span=runner.span,
            current=current,
            stager=stager,
            reducers=reducers,
            rank=rank,
            attempt=start.attempt,
            failed_before=_failed_before(start),
            limit=options.limit(num_examples),
            failures_url=failures_url,
            original_batch=original_batch,
        )
    if fitter is not None:
        assert runner.guard is not None
        runner.splitter = OomSplitter(
            fitter=fitter,
            handler=runner.guard,
            device=rank_device if rank_device is not None else torch.device("cpu"),
            rank=rank,
            lengths=lengths,
        )
        runner.guard.on_oom = runner.splitter.run_parts
    return watchdog


def check_max_failures(
    options: FailureOptions, failed: int | None, start: Start, num_examples: int, failures_url: str
) -> None:
    """After the closing commit, on every rank: fails the job when its committed failures exceed ``max_failures``
    (the same counts on every rank, so every rank raises together).

    Args:
        options: the call's failure options (nothing to check without ``on_error="skip"``).
        failed: the failed examples the closing commit counted; ``None``: every batch was committed before this
            call (the latest record's count then).
        start: what opening the job found.
        num_examples: examples of the job's plan.
        failures_url: where failure records are published (for the message).
    """
    if not options.skip:
        return
    check_total(failed if failed is not None else _failed_before(start), options.limit(num_examples), failures_url)


def _failed_before(start: Start) -> int:
    """Failed examples committed by earlier attempts."""
    latest = start.latest
    return int(latest.stats.get("failed_examples", 0)) if latest is not None else 0
