"""The committer: one commit path for 1 and N processes, for both schedules.

Exactly-once outputs rest on one rule: a file appears under ``outputs/`` only once the commit record that
covers it is durable, and a record covers a rank's files only together with the batches they came from.

**A rank's commit** (its *stage* ``s``, see :mod:`torch_batch_process.jobstore.layout`):

1. the loop runs ``on_checkpoint_start()``; everything written through ``upload_path()`` (and record
   outputs) since the rank's previous commit is in, or finishes uploading to, ``_tbp/staging/<s>/rank_<r>/``;
2. the rank writes ``_tbp/states/<s>/rank_<r>.pt`` (reducer summaries, processor state) when it has any;
3. it sends its vote (stage, batches completed, state file, metrics lines, timings, failure, preemption
   request) to rank 0 and goes on with its next batches.

**Rank 0** merges votes into the job's cumulative state
(:class:`~torch_batch_process.engine.commit.keeper.RecordKeeper`) and writes ``_tbp/commits/<n>.json`` atomically.
**That write is the commit point**: the record lists the committed global batches, the committed stages, every
rank's latest state file and those of earlier attempts. Once a record is durable, each rank *publishes* its stages
that it covers (``staging/<s>/rank_<r>`` moves to ``outputs/commit_<s>/rank_<r>``; one rename locally, see
:mod:`torch_batch_process.engine.commit.publisher`) and rank 0 deletes what the record supersedes.

**How votes travel**: by one of two transports behind one interface
(:class:`~torch_batch_process.engine.commit.votes.VoteTransport`), which the committer uses without asking which.
Gathered (``schedule="static"``, :mod:`~torch_batch_process.engine.commit.gathered`): all ranks commit at the same
step; their votes are gathered on rank 0 asynchronously, with the flags every rank needs back (failure, preemption,
durable records, :class:`~torch_batch_process.engine.commit.votes.CommitFlags`), and the commit completes at the
next step boundary, where rank 0 queues the record write on its background thread and tells (in its next commit's
flags) which records are durable; records that queue up are written as one group commit
(:mod:`~torch_batch_process.engine.commit.group_commit`). Queued (``schedule="dynamic"``,
:mod:`~torch_batch_process.engine.commit.queued`): every rank commits on its own, after each ``checkpoint_interval``
of *its* batches: votes go into a queue in the rendezvous store, rank 0's collector thread merges and writes
records as votes arrive and acknowledges them per rank through the store; no rank ever waits for another at a
commit. A single process takes the gathered path, whose exchanges are then local.

**Participants** (DESIGN §20, :mod:`~torch_batch_process.engine.commit.participants`): what each capability stores
with a commit (record rows, a table's files, memory limits, failing examples, batch-time histograms, the reducers'
summaries) travels in the votes as typed payloads, and rank 0's keeper merges them into the records; the committer
iterates the call's participants and knows none of them. What rank 0 merged and every rank must learn (memory limits,
``on_oom="split"``) goes back to every rank: gathered, rank 0 flags it in a commit's flags and every rank takes it by
one broadcast at that step boundary; queued, through the store (:meth:`VoteTransport.shared`).

**Closing commit**: when a rank has no batch left, or the ranks stop (preemption) or fail, every rank makes
one synchronous commit together (:meth:`Committer.close`): the votes (with failures, preemption requests and
the reducers' summaries) are gathered, rank 0 first writes every record it still owes, then the closing one,
and tells every rank the outcome; every rank then publishes all it committed. A failure anywhere (a hook, a
state write, a background record write or publication on any rank) travels in the votes, so every rank
raises, the failing rank its own exception and the others :class:`WorkerFailedError` with its traceback;
what was committed before stays committed and published.

**Crash anywhere**: every step is idempotent and the next start repairs storage under the job lock before
any work (:meth:`~torch_batch_process.jobstore.store.JobStore.repair`): stages the latest record commits are
published, others deleted (their batches were not committed and are processed again). So every example's
output is committed exactly once, whatever is killed when.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from torch_batch_process.engine.commit.call_summary import Summary
from torch_batch_process.engine.commit.participants import Participants
from torch_batch_process.engine.commit.payloads import Payloads
from torch_batch_process.engine.commit.publisher import Publisher
from torch_batch_process.engine.commit.reducer_summaries import ReducerSummaries
from torch_batch_process.engine.commit.transport import VoteTransport
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.engine.rank_failure import FailureInfo, RankFailure
from torch_batch_process.engine.work import RankWork
from torch_batch_process.errors import InvalidArgumentError, WorkerFailedError
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.observe.stragglers import RankInterval
from torch_batch_process.outputs.stager import OutputStager
from torch_batch_process.processor import TorchBatchProcessor

__all__ = ["Committer", "Outcome"]

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    """The result of a closing commit, the same on every rank."""

    preempted: bool
    metrics: dict[str, Any] | None
    summary: Summary


@dataclass(frozen=True)
class RankState:
    """What a rank's commit saves besides its outputs: its state file (the reducers' summaries and the processor's
    ``state_dict()``), in the job's store."""

    store: JobStore
    summaries: ReducerSummaries


class Committer:
    """This rank's side of the commit protocol (see the module docstring).

    Args:
        collectives: the library's collectives (closing commits, static votes).
        transport: how this rank's regular votes travel (gathered: static schedule; queued: dynamic); on rank 0 it
            holds the record keeper.
        state: where this rank's state files go, and the reducers' summaries they hold.
        stager: this rank's ``upload_path()`` files (and record outputs, attached to it).
        work: this rank's work since its previous commit (its votes carry it).
        participants: what the call's capabilities add to each vote.
        observer: told about every commit this rank sees complete (progress, stragglers, TensorBoard).
        rank_failure: this rank's failure (errors of background work are recorded there).
    """

    def __init__(
        self,
        *,
        collectives: Collectives,
        transport: VoteTransport,
        state: RankState,
        stager: OutputStager,
        work: RankWork,
        participants: Participants,
        observer: Any,
        rank_failure: RankFailure,
    ) -> None:
        self.rank = collectives.rank
        self._coll = collectives
        self._transport = transport
        self._state = state
        self._stager = stager
        self._work = work
        self._participants = participants
        self._observer = observer
        self._rank_failure = rank_failure
        self._news: Payloads | None = None  # rank 0, gathered: what its participants share, not sent yet
        self.stage = transport.first_stage
        self._stager.advance(self.stage)
        self._published = Publisher(state.store, self.rank, sole=collectives.world_size == 1,
                                     on_published=stager.published)

    # ------------------------------------------------------------ regular commits

    def commit(self, processor: TorchBatchProcessor, *, preempt: bool = False) -> None:
        """Commits this rank's part (after ``on_checkpoint_start()``): saves it and sends its vote, which
        carries this rank's preemption request (gathered votes: :meth:`poll` tells every rank to stop)."""
        t0 = time.perf_counter()
        if self._rank_failure.failed and not self._transport.every_rank_votes:
            return  # a failed rank's part is never committed: the closing exchange makes every rank raise
        vote = self._vote(processor, final=False)
        vote.preempt = preempt
        news = self._news is not None and self._coll.world_size > 1
        if self._transport.send(vote, news=news):
            self._complete()  # complete now (queued, or one process): no step to wait for the votes
        shared = self._transport.shared()  # queued votes: what rank 0's participants shared since the last read
        if shared is not None:
            self._participants.learn(shared)
        self._work.part.timings["commit"] += time.perf_counter() - t0

    def poll(self) -> bool:
        """At a step boundary: completes a commit whose votes have arrived (gathered votes); returns True
        when some rank asked to stop. Raises on every rank when a rank failed."""
        if not self._transport.pending:
            return False
        t0 = time.perf_counter()
        stop = self._complete()
        self._work.part.timings["commit"] += time.perf_counter() - t0
        return stop

    def _complete(self) -> bool:
        """Completes the regular commit sent last, once its votes arrived: publishes what durable records cover,
        has rank 0 record the votes, tells the observer; returns whether some rank asked to stop."""
        arrival = self._transport.arrived()  # gathered, rank 0: every rank's vote; otherwise this rank's own
        if arrival is None:
            return False
        votes, flags = arrival.votes, arrival.flags
        if flags.failed:  # every rank knows: the failures themselves, then every rank raises
            self._raise_failures(self._coll.all_gather(self._rank_failure.info))
        if flags.shared:  # rank 0 flagged what its participants share: every rank takes it now
            shared = self._coll.broadcast(self._news if self.rank == 0 else None)
            self._news = None
            if self.rank != 0:
                self._participants.learn(shared)
        own = next(v for v in votes if v.rank == self.rank)
        self._published.voted(own.stage, own.has_files)
        self._published.publish(self._transport.durable_votes(flags.durable, self._published))
        metrics = None
        try:
            metrics = self._transport.record(votes)
        except InvalidArgumentError as exc:  # a participant refused the votes (SchemaConflictError, MeshOutputError):
            # never committed: travels in rank 0's next vote, all ranks raise
            self._rank_failure.record(exc, f"commit of stage {own.stage} (checking the ranks' outputs)")
        news = self._transport.news()  # gathered, rank 0: what the votes it merged taught
        if news is not None:
            self._participants.learn(news)  # rank 0 learns at once; the others with its next commit's flags
            self._news = news
        self._observe(votes, metrics, self._transport.committed_counts(arrival))
        return flags.preempt

    def _observe(self, votes: list[Vote], metrics: dict[str, Any] | None, counts: tuple[int, int]) -> None:
        """Tells the observer about a completed commit (all ranks' votes, or this rank's own; ``counts``: the
        committed batches and examples as this rank knows them)."""
        intervals = [RankInterval(0, 0, {}) for _ in range(self._coll.world_size)]
        for vote in votes:
            intervals[vote.rank] = RankInterval(sum(b - a for a, b in vote.batches), vote.examples, vote.timings)
        own = next((vote.lines for vote in votes if vote.rank == self.rank), [])
        self._observer.on_commit(
            intervals=intervals,
            own_records=own,
            batches_committed=counts[0],
            examples_committed=counts[1],
            metrics=metrics,
            all_ranks=len(votes) == self._coll.world_size,
        )

    def _vote(self, processor: TorchBatchProcessor, *, final: bool, closing: bool = False) -> Vote:
        """Settles this rank's part (earlier background work, uploads, state file) into a vote, and starts
        the next stage."""
        state_file = None
        if not self._rank_failure.failed:
            try:
                self._check_background()
                self._stager.seal(closing)  # record rows: the stage's segment; shards roll over (records.py)
                self._participants.seal(closing)
                self._stager.flush()
                processor_state = processor.state_dict()
                summaries = self._state.summaries
                if summaries.wrapped or processor_state is not None:
                    state_file = self._state.store.write_state(
                        self.stage, self.rank, summaries.take_slots(), processor_state
                    )
            except Exception as exc:  # noqa: BLE001 - travels in the vote
                self._rank_failure.record(exc, f"commit of stage {self.stage} (saving outputs and state)")
        has_files, outputs = self._stager.has_files, self._stager.has_outputs
        if self._stager.has_failures:
            self._published.mark_failures(self.stage)
        part = self._work.take()
        vote = Vote(
            rank=self.rank,
            stage=self.stage,
            has_files=has_files,
            batches=part.batches.to_json(),
            examples=part.examples,
            state_file=state_file,
            lines=part.lines,
            timings=part.timings,
            failure=self._rank_failure.info,
            outputs=outputs,
            payloads=self._participants.contribute(part, closing),
        )
        self._transport.stamp(vote)
        if not final:  # after a closing commit, on_finish() may still write files: a final commit follows
            self.stage = self._transport.next_stage(self.stage)
            self._stager.advance(self.stage)
        return vote

    # ------------------------------------------------------------ closing commits

    def close(self, processor: TorchBatchProcessor, *, preempt: bool, final: bool = False) -> Outcome:
        """The synchronous commit every rank makes together at the end of its batches, when the ranks stop,
        or when one failed (see the module docstring). Raises on every rank when any rank failed."""
        t0 = time.perf_counter()
        stop = self.poll()  # a gathered commit still on its way completes first
        vote = self._vote(processor, final=final, closing=True)
        vote.preempt = preempt or stop
        votes: list[Vote] = self._coll.all_gather(vote)
        self._raise_failures([v.failure for v in votes])
        preempted = any(v.preempt for v in votes)
        own_error: BaseException | None = None
        answer: Any = None
        try:
            answer = self._transport.close_record(votes, final=final, preempted=preempted,
                                                  settle=self._published.settle)
        except Exception as exc:  # noqa: BLE001 - sent to every rank
            own_error = exc
            answer = FailureInfo(0, "writing the closing commit record", type(exc).__name__, str(exc), "")
            answer = (answer, self._transport.newest_durable())
        answer = self._coll.broadcast(answer)
        if isinstance(answer[0], FailureInfo):
            self._publish_committed(answer[1])  # what earlier records made durable
            if own_error is not None:
                raise own_error
            raise WorkerFailedError(f"{answer[0].describe()}; the commit did not happen. Run the job again to resume.")
        metrics, summary = answer
        self._published.voted(vote.stage, vote.has_files)
        self._published.publish(len(self._published), wait=True)  # every vote of this rank is durable now
        self._observe(votes, metrics, (summary.batches_committed, summary.examples_committed))
        self._work.part.timings["commit"] += time.perf_counter() - t0
        return Outcome(preempted=preempted, metrics=metrics, summary=summary)

    # ------------------------------------------------------------ failures

    def _raise_failures(self, infos: list[FailureInfo | None]) -> None:
        """If a rank failed: finish what is already durable on every rank, then raise on every rank.

        Each rank completes its background work (rank 0: the records it queued) and rank 0 tells which
        record is the newest durable one (a queued record write may have failed: that is often the failure);
        each rank then publishes the stages that record covers, so that ``outputs/`` shows everything
        committed and nothing else. Then the failing rank raises its own error, the others
        :class:`WorkerFailedError`.
        """
        if not any(infos):
            return
        try:
            self._transport.stop_for_failure(self._rank_failure.failed)
            self._published.settle()
            settled = True
        except Exception as exc:  # noqa: BLE001 - the job fails anyway; the next start repairs
            logger.warning("rank %d: completing earlier commits failed: %s", self.rank, exc)
            settled = False
        marks = self._coll.all_gather((settled, self._transport.newest_durable()))
        if all(done for done, _ in marks):  # every record write rank 0 queued or took has ended
            self._publish_committed(marks[0][1])
        self._rank_failure.raise_for(infos)

    def _publish_committed(self, newest_durable: int) -> None:
        """When the job fails: publishes this rank's stages that durable records cover (gathered: up to record
        ``newest_durable``; queued: those acknowledged), and waits; a failure is left to the next start."""
        self._published.publish_committed(self._transport.durable_votes(newest_durable, self._published))

    def check(self) -> None:
        """Records a failure of this rank's background work (never waits), so that it travels in its votes."""
        if self._rank_failure.failed:
            return
        try:
            self._check_background()
        except Exception as exc:  # noqa: BLE001
            self._rank_failure.record(exc, "completing an earlier commit (record or publication)")

    def _check_background(self) -> None:
        self._published.check()
        self._transport.check()

    # ------------------------------------------------------------ end

    def shutdown(self) -> None:
        """Always, when the call ends: lets queued background work finish (record writes, publications), stops
        rank 0's vote collector."""
        self._transport.close()
        self._published.close()
