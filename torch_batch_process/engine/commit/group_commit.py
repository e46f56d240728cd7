"""Rank 0's record writes under the static schedule: on a thread of their own, as group commits.

A commit's record is prepared on the main thread at the step boundary where its votes arrived and written by
a writer thread. When commits come faster than records can usefully be written (sub-millisecond batches, slow
object stores), the records that wait are written as one: records are cumulative, so the newest of them
commits everything the others would, and writing it alone makes them all durable (a *group commit*, as
databases do with their logs). Two writes start at least :data:`RECORD_SPACING_S` apart: on local disks a
record costs a few milliseconds of ``fsync`` and journal work, which at hundreds of commits per second would
be most of a job's time. The price is that a record may become durable up to that long after its commit; a
``kill -9`` then loses that much more work, which the next start does again. Exactly-once output is
unchanged: a stage is published only once a record that covers it is durable, and publications (on the
rank's other background thread) are queued only then.

With one process the writer also prepares the records (:meth:`GroupCommit.put_merged`): the main thread merges a
commit's votes (what refuses them, a schema conflict, still fails that commit there) and the writer builds each
record from the merged state when it takes it, so that its bookkeeping (the record's fields, the observer's stats,
metrics so far) leaves the batch's path; a record then commits every vote merged before it was prepared (records are
cumulative, and a vote is only sent once the rank's part is durable or waited for, see
:meth:`~torch_batch_process.engine.commit.participants.Participant.before_record`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.engine.commit.keeper import PreparedRecord, RecordKeeper
from torch_batch_process.metrics_lines import MetricsLine

__all__ = ["MAX_RECORDS_WAITING", "RECORD_SPACING_S", "GroupCommit"]

logger = logging.getLogger(__name__)

RECORD_SPACING_S = 0.05
"""The least time between the starts of two record writes; commits made meanwhile share the next write."""

MAX_RECORDS_WAITING = 256
"""Rank 0 waits at a commit when this many prepared records wait for a write (storage slower than commits)."""


@dataclass
class _Merged:
    """A commit's votes merged on the main thread, its record to be prepared by the writer (:meth:`put_merged`)."""

    lines: list[MetricsLine]
    merged_at: float = field(default_factory=time.monotonic)


class GroupCommit:
    """Rank 0's prepared records (static schedule), written by a thread of their own as group commits.

    Errors never leave the writer thread on their own: :meth:`advance` (called before every vote) raises the
    error of a failed write on the main thread, so it travels in the votes like any other failure.

    Args:
        keeper: rank 0's record keeper (writes a group of records).
        spacing_s: the least time between the starts of two writes.
    """

    def __init__(self, keeper: RecordKeeper, spacing_s: float = RECORD_SPACING_S) -> None:
        self._keeper = keeper
        self._spacing_s = spacing_s
        self._cond = threading.Condition()
        self._unwritten: list[PreparedRecord | _Merged] = []  # not taken by a write yet
        self._metrics: dict[str, Any] | None = None  # the newest metrics of a record the writer prepared, not taken
        self._writing = False
        self._idle = True  # the writer waits for a first record, with no deadline: put() must wake it
        self._hurry = False  # settle() waits: write without spacing
        self._closed = False
        self._error: BaseException | None = None
        self._written = keeper.number  # the newest record written
        self._thread: threading.Thread | None = None
        self.durable = keeper.number
        """The newest record known durable on the main thread (it covers every stage up to its number)."""

    def put(self, prepared: PreparedRecord | _Merged) -> None:
        """Queues a record for the writer; waits only when :data:`MAX_RECORDS_WAITING` records wait already.
        Never raises for a failed write (see :meth:`advance`)."""
        with self._cond:
            while len(self._unwritten) >= MAX_RECORDS_WAITING and self._error is None:
                self._cond.wait(1.0)
            if self._error is not None:
                return  # the job fails at the next check; this record is never written
            self._unwritten.append(prepared)
            if self._idle:  # else the writer wakes at its deadline and takes this record with the others; waking it
                self._cond.notify_all()  # for each record costs two thread switches per commit
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tbp-records", daemon=True)
            self._thread.start()

    def put_merged(self, lines: list[MetricsLine]) -> None:
        """Queues the record of votes the keeper merged (``lines``: their ``metrics.jsonl`` lines): the writer prepares
        it when it takes it (see the module docstring). Never raises for a failed write (see :meth:`advance`)."""
        self.put(_Merged(lines))

    def take_metrics(self) -> dict[str, Any] | None:
        """The metrics of the newest record the writer prepared since the last call (``None``: none)."""
        with self._cond:
            metrics, self._metrics = self._metrics, None
        return metrics

    def _prepare(self, group: list[PreparedRecord | _Merged]) -> list[PreparedRecord]:
        """On the writer: the group's records, those merged on the main thread prepared now, in order; only the
        newest is written (:meth:`RecordKeeper.persist`), so the others of the group are prepared as skipped records
        (:meth:`RecordKeeper.skip`: their numbers and lines)."""
        prepared = []
        last = len(group) - 1
        for i, each in enumerate(group):
            if isinstance(each, _Merged) and i < last:
                record = self._keeper.skip(each.lines)
                record.prepared_at = each.merged_at
                each = record
            elif isinstance(each, _Merged):
                record = self._keeper.prepare(each.lines)
                record.prepared_at = each.merged_at
                if record.metrics is not None:
                    with self._cond:
                        self._metrics = record.metrics
                each = record
            prepared.append(each)
        return prepared

    def _run(self) -> None:
        """The writer: waits for records, keeps the spacing, writes everything waiting as one record."""
        last_start = float("-inf")
        while True:
            with self._cond:
                deadline = last_start + self._spacing_s
                while not self._unwritten and not self._closed:
                    # until the next write may start, it sleeps on that deadline, not idle: the commits made meanwhile
                    # do not wake it (each wake-up is two thread switches on the batch's path, and the woken writer
                    # would only wait for the deadline again); idle, with no deadline, the next put() wakes it
                    pause = deadline - time.monotonic()
                    self._idle = self._hurry or pause <= 0
                    self._cond.wait(None if self._idle else pause)
                self._idle = False
                if not self._unwritten:
                    return
                while not self._hurry and not self._closed and time.monotonic() < deadline:
                    self._cond.wait(deadline - time.monotonic())
                group, self._unwritten = self._unwritten, []
                self._writing = True
            last_start = time.monotonic()
            try:
                records = self._prepare(group)
                self._keeper.persist(*records)
            except BaseException as exc:  # noqa: BLE001 - raised on the main thread by advance()
                with self._cond:
                    self._error, self._writing = exc, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._written, self._writing = records[-1].record.commit, False
                self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """The error of a failed write (no record is written after it), or None."""
        return self._error

    def advance(self) -> None:
        """Advances :attr:`durable` over the records written; raises the error of a failed write. Never waits."""
        if self._error is not None:
            raise self._error
        self.newest_durable()

    def newest_durable(self) -> int:
        """The newest record written so far, whatever happened to later writes (records are cumulative: it
        covers every stage up to its number). Never waits, never raises."""
        self.durable = max(self.durable, self._written)
        return self.durable

    def settle(self, timeout: float = 600.0, *, check: bool = True) -> None:
        """Writes every queued record now (no spacing) and waits for it; raises the error of a failed write
        unless ``check`` is False (the job is failing already: a failed write has ended too)."""
        with self._cond:
            self._hurry = True
            self._cond.notify_all()
            ended = self._cond.wait_for(
                lambda: self._error is not None or not (self._unwritten or self._writing), timeout
            )
            self._hurry = False
        if not ended:
            raise TimeoutError(f"writing commit records took more than {timeout:.0f} s")
        if check:
            self.advance()
        else:
            self.newest_durable()

    def close(self) -> None:
        """Writes what is queued (logging an error: the caller is leaving and the next start repairs), then
        stops the thread."""
        try:
            self.settle()
        except Exception as exc:  # noqa: BLE001
            logger.warning("rank 0: writing the last commit records failed: %s", exc)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
