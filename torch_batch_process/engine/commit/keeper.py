"""Rank 0's record keeper: merges the ranks' votes into commit records and writes them.

The keeper holds the job's cumulative state as the records will say it (committed batches, committed stages,
each rank's latest state file, provenance) and the counts of this call (batches and examples processed,
seconds per phase, per rank); what each capability stores with a commit, its participants keep and add
(:mod:`~torch_batch_process.engine.commit.participants`). A record is prepared on the thread that merged its votes
and written there or in the background; :meth:`RecordKeeper.persist` is the commit point, followed by what the
participants do once it is durable (a table target's transaction) and the conveniences (``metrics.jsonl``,
``result.json``, deleting what the new record supersedes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.engine.commit.call_summary import Summary
from torch_batch_process.engine.commit.participants import Durable, Participants, RecordDraft
from torch_batch_process.engine.commit.payloads import Payloads
from torch_batch_process.engine.commit.reducer_summaries import ReducerSummaries
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.metrics_lines import MetricsLine
from torch_batch_process.observe.metrics import MetricsLog
from torch_batch_process.provenance import merge_entries
from torch_batch_process.result import to_jsonable

__all__ = ["KeeperStart", "PreparedRecord", "RecordKeeper", "Summary"]

logger = logging.getLogger(__name__)


@dataclass
class PreparedRecord:
    """A commit record ready to be written, with its ``metrics.jsonl`` lines and ``result.json``."""

    record: CommitRecord
    lines: list[MetricsLine]
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
    started: float
    """When the call started (``time.monotonic()``), for its elapsed time."""


class RecordKeeper:
    """Rank 0's view of the job's durable state, and the writer of its commit records.

    Args:
        store: the job's stored state (its lock is checked before every record: a job never commits after losing
            it; ``metrics.jsonl`` is appended after each).
        start: where the earlier attempts left the job.
        plan: the job's batches (to count examples).
        world_size: ranks of this attempt.
        summaries: the reducers' summaries (their reduction gives the metrics).
        participants: what the call's capabilities store with each record.
        observer: rank 0's observer: ``on_record`` adds throughput stats and progress lines to records, and
            ``interim_metrics`` decides when "metrics so far" are due.
        result_of: builds the ``result.json`` of a finished job from the metrics and the summary.
    """

    def __init__(
        self,
        *,
        store: JobStore,
        start: KeeperStart,
        plan: Plan,
        world_size: int,
        summaries: ReducerSummaries,
        participants: Participants,
        observer: Any,
        result_of: Callable[[dict[str, Any], Summary], dict[str, Any]],
    ) -> None:
        latest = start.latest
        self._store = store
        self._metrics_log = MetricsLog(store.storage)
        self._plan = plan
        self._attempt = start.attempt
        self._summaries = summaries
        self._participants = participants
        self._observer = observer
        self._result_of = result_of
        self.committed = RangeSet(latest.committed.ranges()) if latest else RangeSet()
        self.stages = RangeSet()
        if latest is not None:
            self.stages = latest.stages if latest.stages is not None else RangeSet([(1, latest.commit + 1)])
        # stages with output files: unknown for good when resuming from a record that does not say
        self.output_stages: RangeSet | None = RangeSet() if latest is None else latest.output_stages
        self.state_files: list[str | None] = [None] * world_size
        self.provenance = list(latest.provenance) if latest else []
        self.number = start.next_number - 1
        self.last_stage = start.next_number - 1
        self.last_record = latest
        self.summary = Summary(timings_per_rank=[{} for _ in range(world_size)])
        self.started = start.started
        self._mutex = threading.Lock()  # dynamic schedules merge votes on a thread of their own

    # ---------------------------------------------------------------- merging

    def merge(self, votes: list[Vote]) -> list[MetricsLine]:
        """Adds votes to the durable-to-be state and the counts; returns their ``metrics.jsonl`` lines.

        Raises:
            SchemaConflictError: a participant refused the votes (their record outputs do not unify with the job's):
                then no vote is merged and their stages are never committed (see
                :mod:`torch_batch_process.jobstore.schema`).
        """
        lines: list[MetricsLine] = []
        with self._mutex:
            self._participants.merge(votes)
            summary = self.summary
            for vote in votes:
                batches = RangeSet.from_json(vote.batches)
                self.committed.update(batches)
                self.stages.add(vote.stage)
                if vote.outputs and self.output_stages is not None:
                    self.output_stages.add(vote.stage)
                self.last_stage = max(self.last_stage, vote.stage)
                if vote.state_file is not None:
                    self.state_files[vote.rank] = vote.state_file
                summary.batches_processed += len(batches)
                summary.examples_processed += vote.examples
                per_rank = summary.timings_per_rank[vote.rank]
                for key, value in vote.timings.items():
                    summary.timings[key] = summary.timings.get(key, 0.0) + value
                    per_rank[key] = per_rank.get(key, 0.0) + value
                lines.extend(vote.lines)
            entries = [line["metrics"] for line in lines if line.get("group") == "provenance"]
            self.provenance = merge_entries(self.provenance, entries)
        return lines

    def share(self) -> Payloads:
        """What the participants share with every rank since the previous call (see
        :meth:`~torch_batch_process.engine.commit.participants.Participant.share`); empty: nothing new."""
        with self._mutex:
            return self._participants.share()

    def committed_counts(self) -> tuple[int, int]:
        """Batches and examples committed (or about to be, by the record being prepared)."""
        with self._mutex:
            return len(self.committed), self._plan.count_examples(self.committed)

    # ---------------------------------------------------------------- records

    def prepare(self, lines: list[MetricsLine], *, final: bool = False, preempting: bool = False) -> PreparedRecord:
        """The next record, from everything merged so far.

        Args:
            lines: ``metrics.jsonl`` lines of the merged votes.
            final: the job's last record (``result.json`` and the final metrics go with it; it is a closing commit's,
                whose votes carried the reducers' summaries).
            preempting: the job stops after this record (its metrics so far are computed; a closing commit's too).
        """
        with self._mutex:
            self.number += 1
            self.summary.commits += 1
            committed = RangeSet(self.committed.ranges())  # a snapshot: merging goes on while it is written
            state_files = list(self.state_files)
            record = CommitRecord(
                commit=self.number,
                attempt=self._attempt,
                world_size=len(state_files),
                committed=committed,
                state_files=state_files,
                frozen_state_files=list(self._summaries.frozen),
                reducers=self._summaries.signature(),
                finished=final,
                provenance=list(self.provenance),
                stages=RangeSet(self.stages.ranges()),
                output_stages=RangeSet(self.output_stages.ranges()) if self.output_stages is not None else None,
                last_stage=self.last_stage,
            )
            draft = RecordDraft(record, self.summary, last=final or preempting)
            self._participants.draft(draft)  # their fields and counts, as merged so far
        examples_committed = self._plan.count_examples(committed)
        metrics = self._summaries.metrics(
            state_files, final=final, preempting=preempting, interim=self._observer.interim_metrics
        )
        stats, observed_lines = self._observer.on_record(
            batches_committed=len(committed),
            examples_committed=examples_committed,
            batches_processed=self.summary.batches_processed,
            examples_processed=self.summary.examples_processed,
            preempted=preempting,
            last=final or preempting,
            metrics=metrics,
            failed_examples=self.summary.failed_examples,
            activity=draft.activity,
            finished=final,
        )
        self.summary.batches_committed, self.summary.examples_committed = len(committed), examples_committed
        self.summary.elapsed_s = time.monotonic() - self.started
        record.result = self._result_of(metrics or {}, self.summary) if final else None
        record.stats.update(
            batches_committed=len(committed),
            examples_committed=examples_committed,
            planned_batches=self._plan.num_batches,
            **stats,
        )
        all_lines = list(lines)
        if metrics is not None:
            reduced = to_jsonable(metrics)
            all_lines.append({"group": "reduced", "steps_completed": len(committed), "rank": 0, "metrics": reduced})
        all_lines.extend(observed_lines)
        return PreparedRecord(record, all_lines, record.result, metrics)

    def skip(self, lines: list[MetricsLine]) -> PreparedRecord:
        """A record of a group commit that is never written, because a newer record of its group is (records are
        cumulative: :mod:`~torch_batch_process.engine.commit.group_commit`): its number, its votes' ``metrics.jsonl``
        lines and the state files it would name (the written record's garbage collection deletes those it no longer
        needs), without what only a written record carries (the participants' fields, stats, metrics so far, the
        observer's progress and timeline records: those due go with the group's written record, :meth:`prepare`).

        With one process the record writer prepares a group's records when it takes them, all from the same merged
        state, so that only the newest differs from the others by more than its number (see
        :meth:`~torch_batch_process.engine.commit.group_commit.GroupCommit.put_merged`); preparing each in full cost
        ~50-150 us of Python a commit on the writer, which holds the interpreter's lock against the batch's thread."""
        with self._mutex:
            self.number += 1
            self.summary.commits += 1
            record = CommitRecord(
                commit=self.number,
                attempt=self._attempt,
                world_size=len(self.state_files),
                committed=self.committed,  # never written nor read: no snapshot
                state_files=list(self.state_files),
                frozen_state_files=list(self._summaries.frozen),
                reducers=[],
            )
        self._observer.on_skipped_record()
        return PreparedRecord(record, list(lines), None, None)

    def persist(self, *prepared: PreparedRecord, closing: bool = False) -> None:
        """Writes prepared records as one group commit: only the newest is written (records are cumulative, it
        commits everything the others would), then what the participants do once it is durable (a table target's
        transaction: never postponed for the ``closing`` commit's record), then every record's lines, the result and
        the clean-up."""
        record = prepared[-1].record
        self._participants.before_record(record)  # what the record commits is durable first (one process's rows)
        self._store.check_lock()
        durable = Durable(record, closing, prepared_at=prepared[0].prepared_at)
        self._store.write_record(record)
        self._participants.after_record(durable)  # the commit point is passed: a failure here fails the job
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
