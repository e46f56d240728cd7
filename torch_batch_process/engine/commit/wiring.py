"""Builds a rank's :class:`~torch_batch_process.engine.commit.committer.Committer` for a call: rank 0's record keeper
and the vote transport: gathered, or with the dynamic schedule on several ranks, queued (the vote queue and shared
stage numbers in the rendezvous store).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_batch_process.engine.commit.committer import Committer
from torch_batch_process.engine.commit.gathered import GatheredVotes
from torch_batch_process.engine.commit.keeper import KeeperStart, RecordKeeper, Summary
from torch_batch_process.engine.commit.queued import QueuedVotes
from torch_batch_process.engine.commit.rank_failure import RankFailure
from torch_batch_process.engine.commit.votes import VoteTransport
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.distributed import Collectives, RendezvousStore
from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.jobstore.opening import Start
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.observe.metrics import MetricsLog
from torch_batch_process.observe.observer import JobObserver
from torch_batch_process.outputs.files import OutputStager
from torch_batch_process.outputs.records import RecordWriter
from torch_batch_process.outputs.tables.commits import TableCommits
from torch_batch_process.reducers import ReducerRegistry
from torch_batch_process.storage.base import JobLock, Storage

__all__ = ["make_committer"]


def make_committer(
    *,
    rank: int,
    collectives: Collectives,
    job_store: JobStore,
    lock: JobLock | None,
    storage: Storage,
    plan: Plan,
    start: Start,
    reducers: ReducerRegistry,
    observer: JobObserver,
    rank_failure: RankFailure,
    stager: OutputStager,
    records: RecordWriter,
    call_store: RendezvousStore | None,
    result_json: Callable[[dict[str, Any], Summary], dict[str, Any]],
    started: float,
    on_background_error: Callable[[], None],
    table: TableCommits | None = None,
    fitter: BatchFitter | None = None,
) -> Committer:
    """The committer of this rank for this call.

    Args:
        rank: this rank.
        collectives: the library's collectives.
        job_store: the job's stored state.
        lock: the job lock (rank 0 holds it; ``None`` elsewhere).
        storage: the job's storage (``metrics.jsonl``).
        plan: the job's plan (to count examples).
        start: what opening the job found.
        reducers: the processor context's reducers (their states are committed).
        observer: the rank's observer (told about commits; rank 0 adds its stats to records).
        rank_failure: the rank's failure.
        stager: the rank's ``upload_path()`` files.
        records: the rank's record writer (``context.write()``).
        call_store: the call's keys in the rendezvous store with the dynamic schedule on several ranks, else
            ``None``.
        result_json: the final result's JSON from the reduced metrics and the summary (rank 0, final record).
        started: when the call started (``time.monotonic()``).
        on_background_error: called when rank 0's vote collector fails (dynamic schedule).
        table: rank 0's transactions of a table target (``table=``), made after each record.
        fitter: the rank's memory limits (``on_oom="split"``; ``None``: ``"raise"``), shared through the votes.
    """
    keeper = None
    if rank == 0:
        keeper = RecordKeeper(
            store=job_store,
            plan=plan,
            start=KeeperStart(start.attempt, start.next_number, start.latest, start.frozen_state_files),
            world_size=collectives.world_size,
            reducers=reducers,
            observer=observer,
            metrics_log=MetricsLog(storage),
            lock=lock,
            result_of=result_json,
            started=started,
            table=table,
        )
    latest = start.latest
    committed = (len(latest.committed), plan.count_examples(latest.committed)) if latest is not None else (0, 0)
    store = call_store
    transport: VoteTransport
    if store is not None:
        first_stage = start.next_number + store.add("stage", 1) - 1
        stage_counter = lambda: start.next_number + store.add("stage", 1) - 1  # noqa: E731
        transport = QueuedVotes(store, rank, stage_counter, keeper, on_background_error)
    else:
        first_stage = start.next_number
        transport = GatheredVotes(collectives, keeper)
    return Committer(
        rank=rank,
        collectives=collectives,
        store=job_store,
        stager=stager,
        reducers=reducers,
        rank_failure=rank_failure,
        keeper=keeper,
        observer=observer,
        committed=committed,
        first_stage=first_stage,
        transport=transport,
        records=records,
        fitter=fitter,
    )
