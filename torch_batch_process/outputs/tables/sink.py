"""A rank's side of table outputs: its rows conformed to the table's schema and written as the table's data files.

The rank's record writer (:class:`~torch_batch_process.outputs.records.RecordWriter`) hands each batch's rows to
:meth:`TableSink.conform` and opens its shards through :meth:`TableSink.open`: so rows are encoded once, during
the stage, straight into data files of the table (not yet part of it). The descriptors of the files a stage closed
travel in the rank's commit vote (:meth:`TableSink.take`) to rank 0, which adds them to the table once the commit
record is durable (:mod:`torch_batch_process.outputs.tables.commits`).

Schema: the table's column types are fixed by its first rows (or by the existing table). At its first batch a
rank creates the table from the batch's columns (plus ``index``) unless it exists, then every batch is cast to the
table's types: a narrower type is widened (``int32`` rows into an ``int64`` column, ``uint8`` into ``int16``),
fixed-shape tensors become lists (Delta, Iceberg) or stay fixed-size lists (Lance, which indexes vectors). Rows
that do not fit (another column, a wider or different type, a column that is all ``None``) raise
:class:`~torch_batch_process.errors.SchemaConflictError` naming the column, before they are written.
"""

from __future__ import annotations

import threading
from typing import Any

from torch_batch_process.errors import SchemaConflictError, StorageError
from torch_batch_process.jobstore.schema import RecordSchema, unify
from torch_batch_process.outputs.tables.base import DataFileWriter, Table, data_file_name, normalize_schema, tombstone
from torch_batch_process.storage.errors import file_error

__all__ = ["TableSink"]


class TableSink:
    """One rank's data files of a table (see the module docstring).

    Args:
        table: the opened table.
        rank: this rank.
        job_id: the job's unique id (:attr:`~torch_batch_process.jobstore.formats.JobInfo.uid`), in file names.
        attempt: this attempt's number, in file names.
    """

    def __init__(self, table: Table, rank: int, job_id: str, attempt: int) -> None:
        self.table = table
        self._rank = rank
        self._job_id = job_id
        self._attempt = attempt
        self._what = table.target.describe_short()
        self._target: Any = None  # the table's Arrow schema (normalized), known after the first batch
        self._seen: Any = None  # the last batch schema checked against it
        self._schema: RecordSchema | None = None  # the rank's record schema: the table's
        self._lock = threading.Lock()
        self._files: list[dict[str, Any]] = []
        self._failed: list[Any] = []  # a keyed job's keys whose examples failed in the stage (DESIGN §21)

    def conform(self, rows: Any, schema: RecordSchema, landing: Any) -> tuple[Any, RecordSchema]:
        """``rows`` cast to the table's schema, and that schema (the rank's record schema); raises
        :class:`SchemaConflictError` when they do not fit (see the module docstring)."""
        if self._seen is None or not rows.schema.equals(self._seen):
            self._check(rows.schema, schema)
        target = self._target
        if not rows.schema.equals(target):
            landing.wait()  # a cast reads values
            rows = rows.select(target.names).cast(target)
        known = self._schema
        if known is None or not schema.ragged <= known.ragged:  # one object while it holds: votes send it once
            self._schema = RecordSchema(target, schema.ragged | (known.ragged if known else frozenset()), self._what)
        return rows, self._schema

    def _check(self, arrow_schema: Any, schema: RecordSchema) -> None:
        normalized = normalize_schema(arrow_schema, fixed_lists=self.table.fixed_lists, what=self._what,
                                      origin=schema.origin)
        if self._target is None:
            self._check_names(normalized, schema.origin)
            try:
                self._target = self.table.ensure(normalized)  # creates the table from the first rows, else its schema
            except StorageError:
                raise
            except OSError as exc:  # its first files on a full disk: the format's own error names no table
                where = self.table.target.describe()
                shown = str(where.get("uri") or where.get("identifier"))
                raise file_error(shown, f"create the {self.table.target.kind} table", exc) from exc
        table_schema = RecordSchema(self._target, schema.ragged, self._what)
        unified = unify(table_schema, RecordSchema(normalized, schema.ragged, schema.origin))  # names the column
        wider = [
            f"{name!r} ({normalized.field(name).type}, the table has {self._target.field(name).type})"
            for name in self._target.names
            if not unified.schema.field(name).type.equals(self._target.field(name).type)
        ]
        if wider:
            raise SchemaConflictError(
                f"context.write(): {schema.origin} wrote column(s) {', '.join(wider)} with a wider type than "
                f"{self._what}; a table's column types are fixed by its first rows: write them with the table's "
                "types (e.g. cast with .to(torch.int64) / .float() from the first batch on)"
            )
        self._seen = arrow_schema

    def _check_names(self, arrow_schema: Any, origin: str) -> None:
        """Column names the table's format cannot hold raise :class:`SchemaConflictError` naming them, before the
        table is created or a row written (not the format's own error once the rows are encoded)."""
        for name in arrow_schema.names:
            problem = self.table.target.name_problem(name)
            if problem is not None:
                raise SchemaConflictError(
                    f"context.write(): {origin} wrote a column named {name!r}, which {self._what} cannot hold "
                    f"({problem}); rename it"
                )

    def open(self, stage: int, part: int, schema: Any) -> DataFileWriter:
        """A new data file for rows of ``stage`` (the rank's ``part``-th of the stage)."""
        return self.table.open_file(data_file_name(self._job_id, stage, self._rank, self._attempt, part), schema, stage)

    def closed(self, descriptors: list[dict[str, Any]]) -> None:
        """A data file was closed: its descriptors join the stage being committed."""
        with self._lock:
            self._files.extend(descriptors)

    def remove_key(self, key: Any) -> None:
        """A keyed job's example of ``key`` failed (its failure record is in the stage), or the key left the dataset
        of a ``prune_missing=True`` run: the stage's MERGE removes the key's row from the table, as a tombstone hides
        the key's older rows in shards (DESIGN §21)."""
        with self._lock:
            self._failed.append(key)

    def take(self) -> list[dict[str, Any]]:
        """The descriptors of the files closed since the last call (the stage being committed), with the stage's
        failed keys (:func:`~torch_batch_process.outputs.tables.base.tombstone`)."""
        with self._lock:
            files, self._files = self._files, []
            failed, self._failed = self._failed, []
        return files + [tombstone(failed)] if failed else files
