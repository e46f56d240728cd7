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

**Memory limits** (``on_oom="split"``, DESIGN §15): each vote carries what its rank's
:class:`~torch_batch_process.engine.feed.fitting.BatchFitter` learned; every rank learns the others' from rank 0
(gathered: rank 0 reads the votes and, when it holds news, flags it in a commit's flags and every rank takes its
limits by one broadcast at that step boundary; queued: through the store, :meth:`VoteTransport.shared_limits`).

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

from torch_batch_process.engine.commit.keeper import RecordKeeper, Summary
from torch_batch_process.engine.commit.publisher import Publisher
from torch_batch_process.engine.commit.rank_failure import FailureInfo, RankFailure
from torch_batch_process.engine.commit.votes import Part, Vote, VoteTransport
from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.errors import SchemaConflictError, WorkerFailedError
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.observe.stragglers import RankInterval
from torch_batch_process.outputs.files import OutputStager
from torch_batch_process.outputs.records import RecordWriter
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.reducers import ReducerRegistry

__all__ = ["Committer", "Outcome"]

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    """The result of a closing commit, the same on every rank."""

    preempted: bool
    metrics: dict[str, Any] | None
    summary: Summary


class Committer:
    """This rank's side of the commit protocol (see the module docstring).

    Args:
        rank: this rank.
        collectives: the library's collectives (closing commits, static votes).
        store: the job's stored state.
        stager: this rank's ``upload_path()`` files.
        reducers: this rank's reducers.
        rank_failure: this rank's failure (errors of background work are recorded there).
        keeper: rank 0's record keeper (``None`` elsewhere).
        observer: told about every commit this rank sees complete (progress, stragglers, TensorBoard).
        committed: batches and examples committed before this attempt.
        first_stage: the stage this rank's first commit fills.
        transport: how this rank's regular votes travel (gathered: static schedule; queued: dynamic).
        records: this rank's record writer (``context.write()``): its votes carry its schema.
        fitter: this rank's memory limits (``on_oom="split"``): its votes carry what it learned, and it learns
            what the other ranks did (from their votes, or from rank 0 through the store with queued votes).
    """

    def __init__(
        self,
        *,
        rank: int,
        collectives: Collectives,
        store: JobStore,
        stager: OutputStager,
        reducers: ReducerRegistry,
        rank_failure: RankFailure,
        keeper: RecordKeeper | None,
        observer: Any,
        committed: tuple[int, int],
        first_stage: int,
        transport: VoteTransport,
        records: RecordWriter | None = None,
        fitter: BatchFitter | None = None,
    ) -> None:
        self.rank = rank
        self._fitter = fitter
        self._unshared = False  # rank 0, static schedule: it holds memory limits the other ranks have not seen
        self._records = records
        self._sent_schema: Any = None  # the record schema this rank's votes carried last
        self._coll = collectives
        self._store = store
        self._stager = stager
        self._reducers = reducers
        self._rank_failure = rank_failure
        self._keeper = keeper
        self._observer = observer
        self._committed_batches, self._committed_examples = committed
        self._transport = transport
        self.part = Part()
        self.stage = first_stage
        self._stager.advance(first_stage)
        self._published = Publisher(store, rank, sole=collectives.world_size == 1, on_published=stager.published)

    # ------------------------------------------------------------ regular commits

    def commit(self, processor: TorchBatchProcessor, *, preempt: bool = False) -> None:
        """Commits this rank's part (after ``on_checkpoint_start()``): saves it and sends its vote, which
        carries this rank's preemption request (gathered votes: :meth:`poll` tells every rank to stop)."""
        t0 = time.perf_counter()
        if self._rank_failure.failed and not self._transport.every_rank_votes:
            return  # a failed rank's part is never committed: the closing exchange makes every rank raise
        vote = self._vote(processor, final=False)
        vote.preempt = preempt
        if self._transport.send(vote, limits_news=self._unshared and self.rank == 0 and self._coll.world_size > 1):
            self._complete()  # complete now (queued, or one process): no step to wait for the votes
        if self._fitter is not None:
            shared = self._transport.shared_limits()  # queued votes: rank 0's merge of every rank's votes so far
            if shared is not None:
                self._fitter.merge(shared)
        self.part.timings["commit"] += time.perf_counter() - t0

    def poll(self) -> bool:
        """At a step boundary: completes a commit whose votes have arrived (gathered votes); returns True
        when some rank asked to stop. Raises on every rank when a rank failed."""
        if not self._transport.pending:
            return False
        t0 = time.perf_counter()
        stop = self._complete()
        self.part.timings["commit"] += time.perf_counter() - t0
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
        self._learn(votes, flags.limits)
        own = next(v for v in votes if v.rank == self.rank)
        self._published.voted(own.stage, own.has_files)
        self._published.publish(self._transport.durable_votes(flags.durable, self._published))
        metrics = None
        try:
            metrics = self._transport.record(votes)
        except SchemaConflictError as exc:  # never committed: travels in rank 0's next vote, all ranks raise
            self._rank_failure.record(exc, f"commit of stage {own.stage} (checking the ranks' record outputs)")
        self._observe(votes, metrics, arrival.counts)
        return flags.preempt

    def _learn(self, votes: list[Vote], broadcast: int = 0) -> None:
        """What the other ranks learned about the device's memory: from their votes (every rank's at a closing
        commit; rank 0's alone at a static commit), and at a static commit where rank 0 flagged news (``broadcast``),
        the limits rank 0 merged, sent to every rank."""
        if self._fitter is None:
            return
        for vote in votes:
            if vote.limits is not None and vote.rank != self.rank:
                self._fitter.merge(vote.limits)
                self._unshared = True  # the other ranks have not seen it yet
        if broadcast:
            shared = self._coll.broadcast(self._fitter.limits.to_json() if self.rank == 0 else None)
            if self.rank != 0:
                self._fitter.merge(shared)
            self._unshared = False

    def _observe(
        self, votes: list[Vote], metrics: dict[str, Any] | None, counts: tuple[int, int] | None = None
    ) -> None:
        """Tells the observer about a completed commit (all ranks' votes, or this rank's own; ``counts``: the
        committed batches and examples rank 0 told, when the votes are only this rank's own)."""
        if self._keeper is not None:
            self._committed_batches, self._committed_examples = self._keeper.committed_counts()
        elif counts is not None:
            self._committed_batches = max(self._committed_batches, counts[0])
            self._committed_examples = max(self._committed_examples, counts[1])
        else:
            for vote in votes:
                self._committed_batches += sum(b - a for a, b in vote.batches)
                self._committed_examples += vote.examples
        intervals = [RankInterval(0, 0, {}) for _ in range(self._coll.world_size)]
        for vote in votes:
            intervals[vote.rank] = RankInterval(sum(b - a for a, b in vote.batches), vote.examples, vote.timings)
        own = next((vote.lines for vote in votes if vote.rank == self.rank), [])
        self._observer.on_commit(
            intervals=intervals,
            own_records=own,
            batches_committed=self._committed_batches,
            examples_committed=self._committed_examples,
            metrics=metrics,
            all_ranks=len(votes) == self._coll.world_size,
        )

    def _vote(self, processor: TorchBatchProcessor, *, final: bool, closing: bool = False) -> Vote:
        """Settles this rank's part (earlier background work, uploads, state file) into a vote, and starts
        the next stage."""
        state_file, slots = None, None
        if not self._rank_failure.failed:
            try:
                self._check_background()
                self._stager.seal(closing)  # record rows: the stage's segment; shards roll over (records.py)
                self._stager.flush()
                processor_state = processor.state_dict()
                if self._reducers.wrapped or processor_state is not None:
                    slots = self._reducers.per_slot_states()
                    state_file = self._store.write_state(self.stage, self.rank, slots, processor_state)
            except Exception as exc:  # noqa: BLE001 - travels in the vote
                self._rank_failure.record(exc, f"commit of stage {self.stage} (saving outputs and state)")
        has_files, outputs = self._stager.has_files, self._stager.has_outputs
        if self._stager.has_failures:
            self._published.mark_failures(self.stage)
        part, self.part = self.part, Part()
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
            slots=slots if closing else None,
            extra={"failed": part.failed} if part.failed else {},
            outputs=outputs,
            schema=self._new_schema(),
        )
        self._transport.stamp(vote)
        if self._fitter is not None:
            vote.limits = self._fitter.take_news()
            self._unshared = self._unshared or vote.limits is not None
            ooms, split = self._fitter.take_counts()
            if ooms:
                vote.extra["ooms"] = ooms
            if split:
                vote.extra["split"] = split
        if part.batch_times:  # the histogram of its batches' seconds: rank 0 keeps it for the job's timeline
            vote.extra["batch_times"] = dict(part.batch_times)
        rows = self._records.take_rows() if self._records is not None else 0
        if rows:  # rank 0 adds them up in the record; read-back checks the shards against the sum
            vote.extra["rows"] = rows
        open_rows = self._records.segment_rows() if self._records is not None else None
        if open_rows is not None:  # the record keeps them: the next start checks the leftover segments against them
            vote.extra["segment_rows"] = open_rows
        files = self._records.take_table_files() if self._records is not None else []
        if files:  # a table target's data files of this stage: rank 0 adds them to the table after the record
            vote.extra["table_files"] = files
        if not final:  # after a closing commit, on_finish() may still write files: a final commit follows
            self.stage = self._transport.next_stage(self.stage)
            self._stager.advance(self.stage)
        return vote

    def _new_schema(self) -> Any:
        """This rank's record schema if its votes have not carried it yet (an Arrow schema pickles in ~45 us:
        a commit every few milliseconds should not pay it every time), else ``None``."""
        schema = self._records.schema if self._records is not None else None
        if schema is self._sent_schema:
            return None
        self._sent_schema = schema
        return schema

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
        self._learn(votes)
        preempted = any(v.preempt for v in votes)
        own_error: BaseException | None = None
        answer: Any = None
        if self._keeper is not None:
            try:
                answer = self._close_records(votes, final=final, preempted=preempted)
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
        self._published.voted(vote.stage, vote.has_files)
        self._published.publish(len(self._published), wait=True)  # every vote of this rank is durable now
        self._observe(votes, answer[0], (answer[1].batches_committed, answer[1].examples_committed))
        self.part.timings["commit"] += time.perf_counter() - t0
        return Outcome(preempted=preempted, metrics=answer[0], summary=answer[1])

    def _close_records(
        self, votes: list[Vote], *, final: bool, preempted: bool
    ) -> tuple[dict[str, Any] | None, Summary]:
        """Rank 0: every record still owed, then the closing one, written now."""
        keeper = self._keeper
        assert keeper is not None
        self._transport.drain(votes)
        self._published.settle()
        slots = [v.slots for v in votes]
        prepared = keeper.prepare(keeper.merge(votes), final=final, preempting=preempted, slots=slots)
        keeper.persist(prepared, closing=True)
        self._transport.written(prepared.record.commit)
        return prepared.metrics, keeper.summary

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
