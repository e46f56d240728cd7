"""The call's error handling around a rank's batches (DESIGN §11, §15): ``on_error="skip"`` and ``on_oom="split"``
(the :class:`~torch_batch_process.engine.feed.runner.Guards` of the runner: a
:class:`~torch_batch_process.engine.feed.failing_examples.FailingExamples` for transactions and bisection, and an
:class:`~torch_batch_process.engine.feed.oom.OomSplitter`), and ``max_failures`` over all ranks at the end
(``batch_timeout``'s watchdog times the feed's loads and the runner's batches:
:func:`~torch_batch_process.engine.feed.watchdog.watch_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torch_batch_process.device import to_device
from torch_batch_process.engine.feed.batches import BatchFeed
from torch_batch_process.engine.feed.failing_examples import (
    FailingExamples,
    FailureLog,
    PartLoader,
    Transactions,
    check_total,
    no_span,
)
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.feed.oom import OomSplitter
from torch_batch_process.engine.feed.runner import BatchCall, Guards
from torch_batch_process.engine.plan.plans import BucketedPlan, Plan
from torch_batch_process.failure_options import FailureOptions
from torch_batch_process.jobstore.opening import Start

__all__ = ["Placement", "check_max_failures", "guard_batches"]


@dataclass(frozen=True)
class Placement:
    """Where a rank's batches go: its device, and whether the loader's batches arrive there (device prefetch), so
    that a part loaded again in the main process goes there too."""

    device: torch.device
    prefetch: bool

    def place(self, batch: Any) -> Any:
        return to_device(batch, self.device) if self.prefetch else batch


def guard_batches(
    call: BatchCall,
    feed: BatchFeed,
    plan: Plan,
    options: FailureOptions,
    transactions: Transactions,
    log: FailureLog,
    fitter: BatchFitter,
    placement: Placement,
) -> Guards:
    """What guards a rank's batches: ``on_error="skip"`` (bisection, failures recorded in ``log``) and
    ``on_oom="split"`` (an :class:`~torch_batch_process.engine.feed.oom.OomSplitter` cutting by ``fitter``), both on
    transactions; nothing for ``on_error="raise"`` with ``on_oom="raise"``.

    Args:
        call: the rank's ``process_batch`` under the job's modes.
        feed: the rank's batch feed (its loader's dataset and ``collate_fn`` load a failing batch's parts).
        plan: the job's plan (the lengths of a ``bucket_by`` plan: the splitter names an example too large by it).
        options: ``on_error``, ``on_oom``.
        transactions: the rank's transactions (what a failed attempt leaves is undone).
        log: the rank's failing examples.
        fitter: the rank's memory limits (learned and used with ``on_oom="split"``).
        placement: where a part loaded again goes.

    Each attempt is timed with the feed's watch (``batch_timeout``: the watchdog's span).
    """
    if not (options.skip or options.split_on_oom):
        return Guards()
    failing = FailingExamples(
        skip=options.skip,
        loader=PartLoader(feed.loader.dataset, feed.loader.collate_fn, placement.place),
        process=call,
        current=call.current,
        span=feed.watch or no_span,
        transactions=transactions,
        log=log,
    )
    if not options.split_on_oom:
        return Guards(failing)
    lengths = plan.lengths if isinstance(plan, BucketedPlan) else None
    splitter = OomSplitter(fitter=fitter, handler=failing, device=placement.device, rank=log.rank, lengths=lengths)
    return Guards(failing, splitter)


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
