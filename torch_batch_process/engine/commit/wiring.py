"""Builds a rank's :class:`~torch_batch_process.engine.commit.committer.Committer` for a call: rank 0's record keeper
and the vote transport: gathered, or with the dynamic schedule on several ranks, queued (the vote queue and shared
stage numbers in the rendezvous store).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch_batch_process.engine.commit.committer import Committer, RankState
from torch_batch_process.engine.commit.gathered import GatheredVotes
from torch_batch_process.engine.commit.keeper import KeeperStart, RecordKeeper, Summary
from torch_batch_process.engine.commit.participants import Participants
from torch_batch_process.engine.commit.queued import QueuedVotes
from torch_batch_process.engine.commit.reducer_summaries import ReducerSummaries
from torch_batch_process.engine.commit.transport import VoteTransport
from torch_batch_process.engine.distributed import Collectives, RendezvousStore
from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.engine.rank_failure import RankFailure
from torch_batch_process.engine.work import RankWork
from torch_batch_process.jobstore.opening import Start
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.outputs.stager import OutputStager

__all__ = ["CommitCall", "make_committer"]


@dataclass(frozen=True)
class CommitCall:
    """The call a committer commits for: the stored job, where the job starts from, and how votes travel.

    Attributes:
        store: the job's stored state (rank 0 holds its lock).
        plan: the job's plan (to count examples).
        start: what opening the job found.
        started: when the call started (``time.monotonic()``).
        collectives: the library's collectives.
        call_store: the call's keys in the rendezvous store with the dynamic schedule on several ranks (votes are
            queued there), else ``None`` (votes are gathered).
        on_background_error: called from rank 0's vote collector thread when it fails (the dynamic schedule then
            stops every rank).
        result_json: the final result's JSON from the reduced metrics and the summary (rank 0, final record).
    """

    store: JobStore
    plan: Plan
    start: Start
    started: float
    collectives: Collectives
    call_store: RendezvousStore | None
    on_background_error: Callable[[], None]
    result_json: Callable[[dict[str, Any], Summary], dict[str, Any]]


def make_committer(
    call: CommitCall,
    participants: Participants,
    summaries: ReducerSummaries,
    stager: OutputStager,
    work: RankWork,
    observer: Any,
    rank_failure: RankFailure,
) -> Committer:
    """The committer of this rank for this call.

    Args:
        call: the call and its stored job.
        participants: what the call's capabilities store with each commit (the reducers' summaries among them).
        summaries: the reducers' summaries (their state files, and on rank 0 the metrics).
        stager: the rank's ``upload_path()`` files.
        work: the rank's work since its previous commit.
        observer: the rank's observer (told about commits; rank 0 adds its stats to records).
        rank_failure: the rank's failure.
    """
    coll, start, plan = call.collectives, call.start, call.plan
    keeper = None
    if coll.rank == 0:
        keeper = RecordKeeper(
            store=call.store,
            start=KeeperStart(start.attempt, start.next_number, start.latest, call.started),
            plan=plan,
            world_size=coll.world_size,
            summaries=summaries,
            participants=participants,
            observer=observer,
            result_of=call.result_json,
        )
    transport: VoteTransport
    store = call.call_store
    if store is None:
        transport = GatheredVotes(coll, keeper, start.next_number)
    else:
        latest = start.latest
        committed = (len(latest.committed), plan.count_examples(latest.committed)) if latest is not None else (0, 0)
        stage_counter = lambda: start.next_number + store.add("stage", 1) - 1  # noqa: E731
        transport = QueuedVotes(store, coll.rank, stage_counter, keeper, call.on_background_error, committed)
    return Committer(
        collectives=coll,
        transport=transport,
        state=RankState(call.store, summaries),
        stager=stager,
        work=work,
        participants=participants,
        observer=observer,
        rank_failure=rank_failure,
    )
