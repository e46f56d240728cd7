"""The :class:`~torch_batch_process.result.BatchProcessResult` of a call, the same on every rank."""

from __future__ import annotations

import logging
import time
from typing import Any

from torch_batch_process.engine.commit.call_summary import Summary
from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.jobstore.opening import Start
from torch_batch_process.result import BatchProcessResult

__all__ = ["job_result", "stored_result"]

logger = logging.getLogger(__name__)


def job_result(
    summary: Summary,
    metrics: dict[str, Any],
    *,
    plan: Plan,
    start: Start,
    preempted: bool,
    storage_url: str,
    outputs_url: str,
    world_size: int,
) -> BatchProcessResult:
    """The result of this call, from rank 0's summary of the votes."""
    return BatchProcessResult(
        metrics=metrics,
        preempted=preempted,
        finished=not preempted and summary.batches_committed >= plan.num_batches,
        storage_path=storage_url,
        outputs_path=outputs_url,
        num_batches=plan.num_batches,
        num_examples=plan.num_examples,
        batches_committed=summary.batches_committed,
        examples_committed=summary.examples_committed,
        batches_processed=summary.batches_processed,
        examples_processed=summary.examples_processed,
        batches_skipped=len(start.latest.committed) if start.latest else 0,
        attempt=start.attempt,
        world_size=world_size,
        commits=summary.commits,
        elapsed_s=summary.elapsed_s,
        failed_examples=summary.failed_examples,
        ooms=summary.ooms + summary.engine_ooms,
        split_batches=summary.split_batches,
        memory_limits=summary.memory_limits,
        generation_budget=summary.generation_budget,
        timings={key: round(value, 6) for key, value in summary.timings.items()},
        timings_per_rank=[{key: round(value, 6) for key, value in t.items()} for t in summary.timings_per_rank],
    )


def stored_result(start: Start, storage_url: str, world_size: int, started: float) -> BatchProcessResult:
    """The result of a call on a job that had finished before: no work, the stored metrics and counts."""
    assert start.finished_result is not None
    logger.info(
        "job at %s is already finished; nothing to do (to run it again: another storage_path, or resume=False, which "
        "erases its outputs)", storage_url,
    )
    return BatchProcessResult.from_json(
        start.finished_result,
        preempted=False,
        finished=True,
        already_finished=True,
        batches_processed=0,
        examples_processed=0,
        ooms=0,
        split_batches=0,
        batches_skipped=start.finished_result.get("batches_committed", 0),
        commits=0,
        world_size=world_size,
        elapsed_s=time.monotonic() - started,
        timings={},
        timings_per_rank=[],
    )
