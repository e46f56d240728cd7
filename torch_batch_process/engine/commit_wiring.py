"""Builds a rank's :class:`~torch_batch_process.engine.committer.Committer` for a call: rank 0's record keeper,
and with the dynamic schedule on several ranks, the vote queue and shared stage numbers in the rendezvous store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch_batch_process.engine.committer import Committer
from torch_batch_process.engine.keeper import KeeperStart, RecordKeeper, Summary
from torch_batch_process.engine.votes import QueuedVotes
from torch_batch_process.observe.metrics import MetricsLog

if TYPE_CHECKING:
    from torch_batch_process.context import TorchBatchProcessorContext
    from torch_batch_process.engine.job import Start
    from torch_batch_process.engine.loop import JobRun

__all__ = ["make_committer"]


def make_committer(
    job: JobRun,
    start: Start,
    context: TorchBatchProcessorContext,
    result_json: Callable[[dict[str, Any], Summary], dict[str, Any]],
    on_background_error: Callable[[], None],
) -> Committer:
    """The committer of ``job``'s rank for this call.

    Args:
        job: the call on this rank.
        start: what opening the job found.
        context: the processor's context (its reducers are committed).
        result_json: the final result's JSON from the reduced metrics and the summary (rank 0, final record).
        on_background_error: called when rank 0's vote collector fails (dynamic schedule).
    """
    keeper = None
    if job.rank == 0:
        keeper = RecordKeeper(
            store=job.opener.store,
            plan=job.plan,
            start=KeeperStart(start.attempt, start.next_number, start.latest, start.frozen_state_files),
            world_size=job.world_size,
            reducers=context.reducers,
            observer=job.observer,
            metrics_log=MetricsLog(job.storage),
            lock=job.opener.lock,
            result_of=result_json,
            started=job.started,
            table=job.table_commits,
        )
    store = job.call_store()
    latest = start.latest
    committed = (len(latest.committed), job.plan.count_examples(latest.committed)) if latest is not None else (0, 0)
    assert job.stager is not None
    return Committer(
        rank=job.rank,
        collectives=job.coll,
        store=job.opener.store,
        stager=job.stager,
        reducers=context.reducers,
        failures=job.failures,
        keeper=keeper,
        observer=job.observer,
        committed=committed,
        first_stage=start.next_number + (store.add("stage", 1) - 1 if store is not None else 0),
        queue=QueuedVotes(store, job.rank) if store is not None else None,
        stage_counter=(lambda: start.next_number + store.add("stage", 1) - 1) if store is not None else None,
        on_background_error=on_background_error,
        records=job.records,
        fitter=job.fitter,
    )
