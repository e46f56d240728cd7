"""Table outputs exactly once: the protocol, and rank 0's side of it (:class:`TableCommits`).

The job's commit records (``_tbp/commits/<n>.json``, :mod:`torch_batch_process.engine.commit.committer`) stay the source
of truth; the table follows them. Names: *the job id* is unique to the job (its name and the time its job file was
written, :attr:`~torch_batch_process.jobstore.formats.JobInfo.uid`; a job erased with ``resume=False`` gets a new
one); *the key* of a table transaction is the number ``n`` of the commit record that made its rows committed.

1. **Stage (every rank).** Rows are written once, during the stage, straight into data files of the table that
   no version of the table references yet (:mod:`torch_batch_process.outputs.tables.sink`). Parquet-based formats
   name them ``tbp-<job id>-s<stage>-r<rank>-a<attempt>-<k>.parquet``. At the rank's commit the open file is
   closed; the descriptors of the stage's files (path, size, rows, ``index`` bounds; Lance: fragment metadata)
   travel in the rank's vote.
2. **Record (rank 0).** Merging the votes, rank 0 collects their files; the next record ``n`` lists them as a
   *pending group* ``n`` (``table.pending`` in the record) with every earlier group whose table transaction has not
   been seen to succeed. Writing the record is the commit point, as for every output.
3. **Table transaction (rank 0, after the record is durable).** One transaction adds the files of every pending
   group newer than the key the table holds, with key = the newest group's ``n``, written in the table's own
   metadata atomically with the files: a Delta application transaction (``txn``: app id ``tbp-<job id>``, version
   ``n``) and commit info, Iceberg snapshot summary properties and the table property ``tbp.commit.<job id>``,
   Lance transaction properties. At most one transaction per commit, fewer: records written as one group commit
   (:mod:`torch_batch_process.engine.commit.group_commit`) make one transaction, and a transaction waits until
   ``commit_interval_s`` (an option of the target, default 1 s) has passed since the previous one, so that
   frequent job commits do not flood the table with versions (the groups stay pending in the records meanwhile;
   the closing commit and the final record never wait). Once a transaction succeeded, the groups it added leave
   the next record.
4. **Start (rank 0, under the job lock, before any rank writes).** :meth:`TableCommits.reconcile`: the key the
   table holds (``k``) says which pending groups of the latest record are in it: groups ``n <= k`` are, the others
   are added now in one transaction (key = the newest). Then the data files of this job whose stage the latest
   record does not commit are deleted: a killed attempt wrote them and no table version references them (Delta,
   Iceberg; Lance names its files itself and leaves them to its own clean-up, see
   :mod:`torch_batch_process.outputs.tables.lance`).

**Crash anywhere.** Killed before the record: the stage is not committed; its data files are in no table version
(invisible to readers) and the next start deletes them (Lance: its clean-up); its batches run again. Killed after the record and before
the table transaction: the next start finds ``k < n`` and adds the group. Killed after the table transaction and
before the next record says so: the next start finds ``k >= n`` and adds nothing. A transaction is atomic, and its
key rises with ``n``, so every committed row is in the table once. The job reports success only after the final
record's transaction; a failed transaction fails the job (resumable: the next start adds what is missing).

5. **Finish.** After the final record's transaction, rank 0 compacts the table's small files with the format's own
   tool (unless the target says ``compact=False``): a transaction of its own that keeps every row once.

   Killed before the compaction is done (its own transaction, atomic too): the final record is durable, the result
   file is not written yet (it follows the compaction), so the next run of the finished job repairs it and compacts
   the table again, before it writes the result.

Fault tests reach the moments between a record and the table's commit by killing rank 0 around its ``k``-th call of
:meth:`TableCommits._transact` or :meth:`TableCommits._compact` (tests/jobs/table_job.py wraps them; nothing of it
ships here).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from torch_batch_process.errors import StorageError
from torch_batch_process.outputs.tables.base import Table

__all__ = ["TableCommits"]

logger = logging.getLogger(__name__)

class TableCommits:
    """Rank 0's table transactions (see the module docstring).

    Args:
        table: the opened table.
    """

    def __init__(self, table: Table) -> None:
        self.table = table
        self.job_id = ""
        self._mutex = threading.Lock()
        self._merged: list[dict[str, Any]] = []  # files of merged votes, not yet in a prepared record
        self._pending: list[dict[str, Any]] = []  # groups {"n", "files"} not yet seen in the table
        self._key = 0  # the newest key the table holds for this job, as far as this process knows
        self._last = float("-inf")  # when the previous transaction started (time.monotonic())
        self.commit_s = 0.0
        """Seconds spent in table transactions (for the benchmark)."""

    # ---------------------------------------------------------------- start

    def reconcile(
        self, latest: Any, job_id: str, *, committed_stages: Callable[[int], bool], finishing: bool = False
    ) -> bool:
        """At the start of an attempt (rank 0, under the job lock): adds the pending groups of ``latest`` (the
        latest commit record, ``None``: none) that the table lacks, deletes the data files of stages never
        committed. A finished ``latest`` is compacted when this made a transaction or when ``finishing`` (the last
        run ended between its final record and its result, where the compaction runs: a kill may have stopped it).
        Returns whether a transaction was made."""
        self.job_id = job_id
        try:
            self._key = self.table.committed_key(job_id)
        except Exception as exc:  # the format's own error (delta-rs: "Kernel error: Json error...") names no table
            raise StorageError(
                f"cannot read {self.table.target.describe_short()} at the job's start ({type(exc).__name__}: "
                f"{_first_line(exc)}); if the table's metadata is damaged, restore it from a backup, or start the "
                "job afresh into a new table (resume=False, or a new storage_path)"
            ) from exc
        _check_not_lost(self.table, latest, self._key)
        groups = [g for g in _pending_of(latest) if g["n"] > self._key]
        made = False
        if groups:
            logger.info(
                "adding the rows of commit(s) %s to %s (committed, not yet in the table)",
                [g["n"] for g in groups], self.table.target.describe_short(),
            )
            self._transact(groups, latest.record_schema.schema if latest.record_schema else None)
            made = True
        removed = self.table.remove_orphans(job_id, committed_stages)
        if removed:
            logger.info("deleted %d data file(s) of uncommitted stages from %s", removed,
                        self.table.target.describe_short())
        if (made or finishing) and latest is not None and latest.finished:
            self._compact()
        return made

    def due(self, latest: Any, job_id: str) -> bool:
        """Whether :meth:`reconcile` has a transaction to make for the finished record ``latest``."""
        groups = _pending_of(latest)
        return bool(groups) and max(g["n"] for g in groups) > self.table.committed_key(job_id)

    # ---------------------------------------------------------------- commits

    def add(self, files: list[dict[str, Any]]) -> None:
        """Collects the data files a vote carries (under the record keeper's merge)."""
        if files:
            with self._mutex:
                self._merged.extend(files)

    def prepare(self, number: int) -> dict[str, Any] | None:
        """The ``table`` entry of record ``number``: its pending groups (the files merged since the last record form
        group ``number``)."""
        with self._mutex:
            if self._merged:
                self._pending.append({"n": number, "files": self._merged})
                self._merged = []
            if not self._pending:
                return None
            return {"pending": list(self._pending)}

    def after_record(self, record: Any, *, closing: bool = False) -> None:
        """Rank 0, right after ``record`` is durable: the table transaction of its pending groups that the table lacks
        (one, whatever their number; postponed while ``commit_interval_s`` has not passed since the previous one,
        unless ``closing`` or final), then, for the final record, compaction."""
        with self._mutex:
            key = self._key
        groups = [g for g in _pending_of(record) if g["n"] > key]
        due = closing or record.finished or time.monotonic() - self._last >= self.table.target.commit_interval_s
        if groups and due:
            self._transact(groups, record.record_schema.schema if record.record_schema else None)
        if record.finished:
            self._compact()

    def _transact(self, groups: list[dict[str, Any]], schema: Any) -> None:
        key = max(g["n"] for g in groups)
        files = [f for g in groups for f in g["files"]]
        self._last = time.monotonic()
        started = time.perf_counter()
        try:
            self.table.commit(files, schema, self.job_id, key)
        except Exception as exc:
            raise StorageError(
                f"commit {key} is durable, but adding its rows to {self.table.target.describe_short()} failed "
                f"({type(exc).__name__}: {exc}); run the job again: its start adds them"
            ) from exc
        self.commit_s += time.perf_counter() - started
        with self._mutex:
            self._key = max(self._key, key)
            self._pending = [g for g in self._pending if g["n"] > self._key]

    def _compact(self) -> None:
        if not self.table.target.compact:
            return
        try:
            self.table.compact()
        except Exception as exc:  # noqa: BLE001 - every row is in the table; only the file count is not reduced
            logger.warning("compacting %s failed (its rows are complete): %s", self.table.target.describe_short(), exc)


def _check_not_lost(table: Table, latest: Any, key: int) -> None:
    """Raises :class:`~torch_batch_process.errors.CheckpointCorruptError` when the table holds no transaction of the
    job (``key`` 0) although ``latest`` says some of its committed rows are in it (more rows committed than its
    pending groups hold): the table was deleted or replaced. Adding the pending groups would then make a table that
    silently lacks those rows and references data files that may be gone with it."""
    from torch_batch_process.errors import CORRUPT_HINT, CheckpointCorruptError

    rows = latest.stats.get("record_rows") if latest is not None else None
    if key or not isinstance(rows, int):
        return
    pending = sum(int(f.get("rows", 0)) for g in _pending_of(latest) for f in g["files"])
    if rows > pending:
        raise CheckpointCorruptError(
            f"{table.target.describe_short()} holds no transaction of this job, but its commit record says "
            f"{rows - pending} of its {rows} committed record rows are in it: the table was deleted or replaced "
            f"since. Nothing was changed. {CORRUPT_HINT}."
        )


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (delta-rs appends a backtrace)."""
    return (str(exc).strip().splitlines() or [""])[0]


def _pending_of(record: Any) -> list[dict[str, Any]]:
    table = getattr(record, "table", None) if record is not None else None
    return list((table or {}).get("pending", ()))
