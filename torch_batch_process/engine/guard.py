"""Wires the failure options into a rank's runner: ``on_error="skip"`` and ``on_oom="split"`` (a
:class:`~torch_batch_process.engine.failures.FailureHandler` for transactions and bisection, and an
:class:`~torch_batch_process.engine.oom.OomSplitter`), and ``batch_timeout`` (a
:class:`~torch_batch_process.engine.watchdog.BatchWatchdog`), and checks ``max_failures`` at the end.

Kept apart from the loop so that the loop only calls :func:`guard_runner` and :func:`check_failures`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch_batch_process.device import to_device
from torch_batch_process.engine.batches import BatchFeed
from torch_batch_process.engine.committer import Outcome
from torch_batch_process.engine.failures import FailureHandler, check_total
from torch_batch_process.engine.oom import OomSplitter
from torch_batch_process.engine.plan import BucketedPlan
from torch_batch_process.engine.runner import BatchRunner
from torch_batch_process.engine.watchdog import BatchWatchdog
from torch_batch_process.storage.layout import FAILURES_DIR

if TYPE_CHECKING:
    from torch_batch_process.engine.loop import JobRun

__all__ = ["check_failures", "guard_runner"]


def guard_runner(job: JobRun, runner: BatchRunner, feed: BatchFeed) -> None:
    """Sets up ``on_error="skip"`` and ``batch_timeout`` on ``runner`` and ``feed``; a started watchdog goes to
    ``job.watchdog``, which the job closes when its call ends (so that a rank whose batches are done still dumps
    its stacks when another rank's batch times out)."""
    options = job.args.failures
    if options.batch_timeout is not None:
        store = None
        if job.world_size > 1:
            call_id = job.call_id
            store = lambda: job.env.call_store(call_id).clone()  # noqa: E731
        watchdog = BatchWatchdog(options.batch_timeout, job.rank, store)
        runner.span = watchdog.span
        feed.watch = watchdog.span  # a batch whose loading hangs is a stuck batch too
        watchdog.start()
        job.watchdog = watchdog
    if options.skip or job.fitter is not None:
        device = job.env.device
        place: Any = (lambda batch: to_device(batch, device)) if job.device_prefetch else (lambda batch: batch)
        latest = job.start.latest
        runner.guard = FailureHandler(
            skip=options.skip,
            dataset=feed.loader.dataset,  # a source's rows by global row number (engine/streams.py)
            collate_fn=feed.loader.collate_fn,
            place=place,
            process=runner.process,
            span=runner.span,
            current=job.current,
            stager=job.stager,
            reducers=job.context.reducers,
            rank=job.rank,
            attempt=job.start.attempt,
            failed_before=int(latest.stats.get("failed_examples", 0)) if latest is not None else 0,
            limit=options.limit(job.plan.num_examples),
            failures_url=job.storage.url_of(FAILURES_DIR),
            original_batch=getattr(job.plan, "original_batch", None),  # a retry's plan keeps the original batches
        )
    if job.fitter is not None:
        assert runner.guard is not None
        runner.splitter = OomSplitter(
            fitter=job.fitter,
            handler=runner.guard,
            device=job.env.device,
            rank=job.rank,
            lengths=job.plan.lengths if isinstance(job.plan, BucketedPlan) else None,
        )
        runner.guard.on_oom = runner.splitter.run_parts


def check_failures(job: JobRun, outcome: Outcome | None) -> None:
    """After the closing commit (``outcome``; ``None``: every batch was committed before this call), on every
    rank: fails the job when its committed failures exceed ``max_failures`` (the same counts on every rank, so
    every rank raises together)."""
    options = job.args.failures
    if not options.skip:
        return
    if outcome is not None:
        failed = outcome.summary.failed_examples
    else:
        latest = job.start.latest
        failed = int(latest.stats.get("failed_examples", 0)) if latest is not None else 0
    check_total(failed, options.limit(job.plan.num_examples), job.storage.url_of(FAILURES_DIR))
