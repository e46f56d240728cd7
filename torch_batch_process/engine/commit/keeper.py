"""Rank 0's record keeper: merges the ranks' votes into commit records and writes them.

The keeper holds the job's cumulative state as the records will say it (committed batches, committed stages,
each rank's latest state file, provenance) and the counts of this call (batches and examples processed,
seconds per phase, per rank). A record is prepared on the thread that merged its votes and written there or
in the background; :meth:`RecordKeeper.persist` is the commit point, followed by the conveniences
(``metrics.jsonl``, ``result.json``, deleting what the new record supersedes). With a table target, the table
transaction of the record's rows follows the record (:mod:`torch_batch_process.outputs.tables.commits`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.memory_limits import MemoryLimits
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.jobstore.schema import RecordSchema, unify
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.observe.metrics import MetricsLog
from torch_batch_process.observe.timeline import RankActivity
from torch_batch_process.outputs.tables.commits import TableCommits
from torch_batch_process.provenance import merge_entries
from torch_batch_process.reducers import ReducerRegistry
from torch_batch_process.result import to_jsonable
from torch_batch_process.storage.base import JobLock

__all__ = ["PreparedRecord", "RecordKeeper", "Summary"]

logger = logging.getLogger(__name__)


@dataclass
class Summary:
    """What a call did, as rank 0 counted it from the votes (the same result on every rank comes from it)."""

    batches_committed: int = 0
    examples_committed: int = 0
    batches_processed: int = 0
    examples_processed: int = 0
    commits: int = 0
    failed_examples: int = 0
    """Examples recorded as failed (``on_error="skip"``), committed, over all attempts."""
    ooms: int = 0
    """Out-of-memory errors the call's ranks met (``on_oom="split"``)."""
    split_batches: int = 0
    """Batches the call's ranks ran in parts to fit in the device's memory."""
    memory_limits: dict[str, Any] | None = None
    """What the job learned about the device's memory, over all attempts
    (:meth:`~torch_batch_process.jobstore.memory_limits.MemoryLimits.summary`); ``None``: nothing."""
    timings: dict[str, float] = field(default_factory=dict)
    timings_per_rank: list[dict[str, float]] = field(default_factory=list)
    elapsed_s: float = 0.0


@dataclass
class PreparedRecord:
    """A commit record ready to be written, with its ``metrics.jsonl`` lines and ``result.json``."""

    record: CommitRecord
    lines: list[dict[str, Any]]
    result: dict[str, Any] | None
    metrics: dict[str, Any] | None
    prepared_at: float = field(default_factory=time.monotonic)
    """When its votes were merged into it: commit latency counts from there to its record being durable."""


@dataclass
class KeeperStart:
    """What the keeper continues from: the latest record of earlier attempts (``None``: a fresh job)."""

    attempt: int
    next_number: int
    latest: CommitRecord | None
    frozen_state_files: list[str]


class RecordKeeper:
    """Rank 0's view of the job's durable state, and the writer of its commit records.

    Args:
        store: the job's stored state.
        plan: the job's batches (to count examples).
        start: where the earlier attempts left the job.
        world_size: ranks of this attempt.
        reducers: rank 0's reducers (their ``cross_slot_reduce`` gives the metrics).
        observer: rank 0's observer: ``on_record`` adds throughput stats and progress lines to records, and
            ``interim_metrics`` decides when "metrics so far" are due.
        metrics_log: ``metrics.jsonl``.
        lock: the job lock, checked before every record (a job never commits after losing it).
        result_of: builds the ``result.json`` of a finished job from the metrics and the summary.
        started: when the call started (``time.monotonic()``), for its elapsed time.
        table: the table transactions of a table target (``None``: record shards only).
    """

    def __init__(
        self,
        *,
        store: JobStore,
        plan: Plan,
        start: KeeperStart,
        world_size: int,
        reducers: ReducerRegistry,
        observer: Any,
        metrics_log: MetricsLog,
        lock: JobLock | None,
        result_of: Callable[[dict[str, Any], Summary], dict[str, Any]],
        started: float,
        table: TableCommits | None = None,
    ) -> None:
        latest = start.latest
        self._table = table
        self._store = store
        self._plan = plan
        self._attempt = start.attempt
        self._reducers = reducers
        self._observer = observer
        self._metrics_log = metrics_log
        self._lock = lock
        self._result_of = result_of
        self.committed = RangeSet(latest.committed.ranges()) if latest else RangeSet()
        self.stages = RangeSet()
        if latest is not None:
            self.stages = latest.stages if latest.stages is not None else RangeSet([(1, latest.commit + 1)])
        # stages with output files: unknown for good when resuming from a record that does not say
        self.output_stages: RangeSet | None = RangeSet() if latest is None else latest.output_stages
        self.state_files: list[str | None] = [None] * world_size
        self.frozen = list(start.frozen_state_files)
        self.provenance = list(latest.provenance) if latest else []
        self.number = start.next_number - 1
        self.last_stage = start.next_number - 1
        self.last_record = latest
        self.summary = Summary(timings_per_rank=[{} for _ in range(world_size)])
        self.activity = RankActivity(world_size)  # the votes since the last timeline point (observe/timeline.py)
        self.summary.failed_examples = int(latest.stats.get("failed_examples", 0)) if latest else 0
        # record rows committed over all attempts; None: an earlier attempt's records did not count them
        rows = latest.stats.get("record_rows") if latest else 0
        self.record_rows: int | None = rows if isinstance(rows, int) else None
        # rank -> [rows in its segments only, newest stage with rows] (this attempt's: the start rolled earlier ones)
        self.segment_rows: dict[int, list[int]] = {}
        # the committed rows' columns: every vote's must unify with them
        self.record_schema: RecordSchema | None = latest.record_schema if latest else None
        # what the job learned about the device's memory, over all attempts (DESIGN §15)
        self.limits = MemoryLimits.from_json(latest.memory_limits) if latest and latest.memory_limits else None
        self._limits_changed = False
        self._limits_voted = False  # merged from this attempt's votes (a rank on another kind of device: ignored)
        self.ooms_before = int(latest.stats.get("ooms", 0)) if latest else 0
        self.split_before = int(latest.stats.get("split_batches", 0)) if latest else 0
        if self.limits is not None:
            self.summary.memory_limits = self.limits.summary()
        self.started = started
        self._mutex = threading.Lock()  # dynamic schedules merge votes on a thread of their own

    # ---------------------------------------------------------------- merging

    def merge(self, votes: list[Vote]) -> list[dict[str, Any]]:
        """Adds votes to the durable-to-be state and the counts; returns their ``metrics.jsonl`` lines.

        Raises:
            SchemaConflictError: a vote's record outputs do not unify with the job's (then no vote is merged:
                their stages are never committed, see :mod:`torch_batch_process.jobstore.schema`).
        """
        lines: list[dict[str, Any]] = []
        with self._mutex:
            schema = self.record_schema
            for vote in votes:
                if vote.schema is not None:
                    schema = unify(schema, vote.schema)
            self.record_schema = schema
            if self._table is not None:
                self._table.merge(votes)
            for vote in votes:
                batches = RangeSet.from_json(vote.batches)
                count = len(batches)
                self.committed.update(batches)
                self.stages.add(vote.stage)
                if vote.outputs and self.output_stages is not None:
                    self.output_stages.add(vote.stage)
                self.last_stage = max(self.last_stage, vote.stage)
                if vote.state_file is not None:
                    self.state_files[vote.rank] = vote.state_file
                summary = self.summary
                summary.batches_processed += count
                summary.examples_processed += vote.examples
                summary.failed_examples += int(vote.extra.get("failed", 0))
                summary.ooms += int(vote.extra.get("ooms", 0))
                summary.split_batches += int(vote.extra.get("split", 0))
                if vote.limits is not None:
                    if self.limits is None or not (self._limits_voted or self.limits.same_kind(vote.limits)):
                        # earlier attempts' limits were learned on another kind of device: this attempt's replace them
                        self.limits = MemoryLimits(vote.limits["unit"], device=vote.limits.get("device", ""))
                    self._limits_voted = True
                    if self.limits.same_kind(vote.limits) and self.limits.merge(vote.limits):
                        self._limits_changed = True
                        summary.memory_limits = self.limits.summary()
                if self.record_rows is not None:
                    self.record_rows += int(vote.extra.get("rows", 0))
                if "segment_rows" in vote.extra:
                    self.segment_rows[vote.rank] = list(vote.extra["segment_rows"])
                for key, value in vote.timings.items():
                    summary.timings[key] = summary.timings.get(key, 0.0) + value
                    per_rank = summary.timings_per_rank[vote.rank]
                    per_rank[key] = per_rank.get(key, 0.0) + value
                self.activity.add_vote(vote.rank, count, vote.examples, vote.timings, vote.extra.get("batch_times"))
                lines.extend(vote.lines)
            entries = [line["metrics"] for line in lines if line.get("group") == "provenance"]
            self.provenance = merge_entries(self.provenance, entries)
        return lines

    def take_changed_limits(self) -> dict[str, Any] | None:
        """The job's memory limits (JSON form) when merged votes changed them since the previous call, else
        ``None`` (rank 0 shares them with the ranks of a dynamic schedule)."""
        with self._mutex:
            if not self._limits_changed or self.limits is None:
                return None
            self._limits_changed = False
            return self.limits.to_json()

    def committed_counts(self) -> tuple[int, int]:
        """Batches and examples committed (or about to be, by the record being prepared)."""
        with self._mutex:
            return len(self.committed), self._plan.count_examples(self.committed)

    # ---------------------------------------------------------------- records

    def prepare(
        self,
        lines: list[dict[str, Any]],
        *,
        final: bool = False,
        preempting: bool = False,
        slots: list[list[Any] | None] | None = None,
    ) -> PreparedRecord:
        """The next record, from everything merged so far.

        Args:
            lines: ``metrics.jsonl`` lines of the merged votes.
            final: the job's last record (``result.json`` and the final metrics go with it).
            preempting: the job stops after this record (its metrics so far are computed).
            slots: the closing votes' reducer summaries, one per rank (saves reading the state files).
        """
        with self._mutex:
            self.number += 1
            self.summary.commits += 1
            committed = RangeSet(self.committed.ranges())  # a snapshot: merging goes on while it is written
            state_files = list(self.state_files)
            stages = RangeSet(self.stages.ranges())
            output_stages = RangeSet(self.output_stages.ranges()) if self.output_stages is not None else None
            provenance = list(self.provenance)
            number, last_stage = self.number, self.last_stage
            record_schema = self.record_schema
            failed = self.summary.failed_examples
            rows = {"record_rows": self.record_rows} if self.record_rows is not None else {}
            segment_rows = {str(rank): value for rank, value in sorted(self.segment_rows.items()) if value[0] > 0}
            if segment_rows:  # the rows a kill or a failure would leave in segments (see outputs/segments.py)
                rows["segment_rows"] = segment_rows
            table = self._table.prepare(number) if self._table is not None else None
            limits = self.limits.to_json() if self.limits is not None else None
            oom_stats = {
                "ooms": self.ooms_before + self.summary.ooms,
                "split_batches": self.split_before + self.summary.split_batches,
            }
            activity = None
            if self._observer.timeline_due(final or preempting):  # a timeline point goes with this record
                activity, self.activity = self.activity, RankActivity(len(state_files))
        examples_committed = self._plan.count_examples(committed)
        metrics: dict[str, Any] | None = None
        if self._reducers.wrapped and (final or preempting):
            metrics = self._reduce(state_files, slots)
        elif final:
            metrics = {}
        elif self._reducers.wrapped:
            metrics = self._observer.interim_metrics(lambda: self._reduce(state_files, None))
        stats, observed_lines = self._observer.on_record(
            batches_committed=len(committed),
            examples_committed=examples_committed,
            batches_processed=self.summary.batches_processed,
            examples_processed=self.summary.examples_processed,
            preempted=preempting,
            last=final or preempting,
            metrics=metrics,
            failed_examples=failed,
            activity=activity,
            finished=final,
        )
        self.summary.batches_committed, self.summary.examples_committed = len(committed), examples_committed
        self.summary.elapsed_s = time.monotonic() - self.started
        result = self._result_of(metrics or {}, self.summary) if final else None
        record = CommitRecord(
            commit=number,
            attempt=self._attempt,
            world_size=len(state_files),
            committed=committed,
            state_files=state_files,
            frozen_state_files=list(self.frozen),
            reducers=self._reducers.signature(),
            finished=final,
            result=result,
            stats={
                "batches_committed": len(committed),
                "examples_committed": examples_committed,
                "planned_batches": self._plan.num_batches,
                "failed_examples": failed,
                **rows,
                **oom_stats,
                **stats,
            },
            provenance=provenance,
            stages=stages,
            output_stages=output_stages,
            last_stage=last_stage,
            record_schema=record_schema,
            table=table,
            memory_limits=limits,
        )
        all_lines = list(lines)
        if metrics is not None:
            reduced = to_jsonable(metrics)
            all_lines.append({"group": "reduced", "steps_completed": len(committed), "rank": 0, "metrics": reduced})
        all_lines.extend(observed_lines)
        return PreparedRecord(record, all_lines, result, metrics)

    def _reduce(self, state_files: list[str | None], slots: list[list[Any] | None] | None) -> dict[str, Any]:
        if slots is not None:
            live = [slot for slot in slots if slot is not None]
        else:
            live = [self._store.load_state(rel)["reducers"] for rel in state_files if rel]
        frozen = [self._store.load_state(rel)["reducers"] for rel in self.frozen]
        return self._reducers.cross_slot_reduce(frozen + live)

    def persist(self, *prepared: PreparedRecord, closing: bool = False) -> None:
        """Writes prepared records as one group commit: only the newest is written (records are cumulative, it
        commits everything the others would), then every record's lines, the result and the clean-up.
        ``closing``: the closing commit's record (a table target's transaction is then never postponed)."""
        record = prepared[-1].record
        if self._lock is not None:
            self._lock.check()
        t0 = time.monotonic()
        self._store.write_record(record)
        if self._table is not None:  # the commit point is passed: the table follows (a failure fails the job)
            self._table.after_record(record, closing=closing)
        durable = time.monotonic()
        with self._mutex:
            self.activity.add_record_write(durable - t0, durable - prepared[0].prepared_at)  # the oldest waited most
        try:
            for each in prepared:
                self._metrics_log.append(each.lines, commit=each.record.commit, attempt=self._attempt)
            if prepared[-1].result is not None:
                self._store.write_result(prepared[-1].result)
            self._store.collect_garbage(record, self.last_record, skipped=[each.record for each in prepared[:-1]])
        except Exception as exc:  # noqa: BLE001 - the commit is durable; these are conveniences
            logger.warning(
                "commit %d is durable, but writing its metrics or cleaning up failed: %s", record.commit, exc
            )
        self.last_record = record
