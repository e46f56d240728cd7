"""Record outputs: ``context.write(rows)`` streams one rank's rows into shard files committed exactly once.

Rows of a batch wait in memory until ``process_batch`` returns (a batch that raises contributes no rows), then
join the rank's open shard: a local file in a scratch folder (``storage.scratch_folder``: inside the storage
for local storage, so that it is later renamed, never copied). Parquet shards get a row group every
:data:`ROW_GROUP_BYTES` of rows (pyarrow's ``ParquetWriter``); JSONL shards a line per row as it comes. So
the library holds at most two row groups' rows per rank (one being filled, one being encoded on a
background thread, off the batch's path), whatever the job's size. CUDA tensors are copied back
asynchronously into pinned memory (:mod:`torch_batch_process.outputs.copyback`); the encoder thread waits for
those copies just before it encodes their row group, so the batch's thread does not wait for the GPU.

At each commit of the rank (:meth:`RecordWriter.seal`, called by the committer before its vote) the open
shard is closed and handed to the :class:`~torch_batch_process.outputs.files.OutputStager` like an
``upload_path()`` file: it joins the rank's stage and is published exactly once with the batches it came from,
at ``outputs/commit_<s>/rank_<r>/records/part-<s>-rank<r>-<k>.<ext>`` (see
:mod:`torch_batch_process.jobstore.layout`). A shard also rolls over to a new file every
:data:`SHARD_BYTES`. Rows of a stage that is never committed (a killed attempt) are never published.

With a table target (``table=``), shards are the table's data files instead, opened and closed through the rank's
:class:`~torch_batch_process.outputs.tables.sink.TableSink`, which also fixes the rows' types to the table's; their
descriptors travel in the rank's vote (:meth:`RecordWriter.take_table_files`), and rank 0 adds them to the table
after the record (:mod:`torch_batch_process.outputs.tables.commits`).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_batch_process.errors import InvalidArgumentError, SchemaConflictError
from torch_batch_process.jobstore.layout import number_name
from torch_batch_process.jobstore.schema import FIX_HINT, RecordSchema, unify
from torch_batch_process.outputs.columns import rows_to_table
from torch_batch_process.outputs.copyback import CopiesDone, DeviceCopies
from torch_batch_process.outputs.files import OutputStager

if TYPE_CHECKING:
    from torch_batch_process.context import CurrentBatch
    from torch_batch_process.outputs.tables.sink import TableSink

__all__ = ["OUTPUT_FORMATS", "RECORDS_DIR", "RecordWriter", "check_output_format", "shard_name"]

OUTPUT_FORMATS = {"parquet": "parquet", "jsonl": "jsonl"}
"""``output_format`` -> the shards' file extension."""

RECORDS_DIR = "records"
"""The folder of record shards inside each ``outputs/commit_<s>/rank_<r>/``."""

ROW_GROUP_BYTES = 32 << 20
"""Parquet: a row group is written when this many bytes of rows are buffered."""

SHARD_BYTES = 512 << 20
"""A shard is closed (and a new one opened) after this many bytes of rows."""


def shard_name(stage: int, rank: int, part: int, output_format: str) -> str:
    """Name of a shard inside its ``outputs/commit_<s>/rank_<r>/`` folder (unique across ranks and stages)."""
    return f"{RECORDS_DIR}/part-{number_name(stage)}-rank{rank}-{part:05d}.{OUTPUT_FORMATS[output_format]}"


def _not_json(arrow_type: Any) -> bool:
    """Whether JSON lines cannot keep values of ``arrow_type`` (or of a type nested in it) as they are."""
    import pyarrow as pa

    t = pa.types
    if t.is_binary(arrow_type) or t.is_large_binary(arrow_type) or t.is_fixed_size_binary(arrow_type):
        return True
    if t.is_temporal(arrow_type) or t.is_decimal(arrow_type):
        return True
    return any(_not_json(arrow_type.field(i).type) for i in range(arrow_type.num_fields))


def _check_json_storable(schema: RecordSchema) -> None:
    """``output_format="jsonl"``: refuses columns that JSON cannot keep (bytes, dates and times, decimals).

    A :class:`SchemaConflictError`: the code is at fault, not an example, so it fails the job even with
    ``on_error="skip"``."""
    for field in schema.schema:
        if _not_json(field.type):
            raise SchemaConflictError(
                f"context.write(): {schema.origin} wrote column {field.name!r} as {field.type}, which "
                "output_format='jsonl' cannot store (JSON has no bytes, dates, times or decimals); use "
                "output_format='parquet', or write it as str (base64 for bytes, ISO 8601 for times)"
            )


class RecordWriter:
    """One rank's record outputs (see the module docstring).

    Args:
        stager: the rank's output stager (shards join its current stage).
        current: the context's current batch (its indices give the ``index`` column).
        rank: this rank.
        output_format: ``"parquet"`` or ``"jsonl"``.
        schema: the job's record schema committed by earlier attempts (``None``: none yet).
        sink: a table target's data files (``None``: shards in the job's storage).
    """

    def __init__(
        self,
        stager: OutputStager,
        current: CurrentBatch,
        rank: int,
        output_format: str = "parquet",
        schema: RecordSchema | None = None,
        sink: TableSink | None = None,
    ) -> None:
        self._stager = stager
        self._sink = sink
        self._current = current
        self._rank = rank
        self._format = output_format
        self._pending: tuple[Any, CopiesDone, RecordSchema] | None = None  # the batch's rows, until it returns
        self._buffer: list[Any] = []  # parquet: tables waiting for the next row group
        self._landing: list[CopiesDone] = []  # the copies back from the device that the buffered tables wait for
        self._buffered = 0
        self._schema = schema  # the rank's rows so far (seeded with the job's: every shard unifies with it)
        self._folder: Path | None = None
        self._file: Path | None = None
        self._writer: Any = None  # pyarrow.parquet.ParquetWriter or a text file
        self._shard_bytes = 0
        self._part = 0
        self._part_stage = -1
        self._name = ""
        self._encoder: ThreadPoolExecutor | None = None  # parquet: row groups are encoded off the batch's path
        self._encoding: Future[None] | None = None
        self.rows = 0
        self._taken_rows = 0
        current.listeners.append(self._batch_finished)
        stager.attach(self)

    def write(self, rows: Any) -> None:
        """Adds the rows of the current batch (see :meth:`TorchBatchProcessorContext.write`)."""
        if self._current.indices is None:
            raise RuntimeError("context.write() is only available inside process_batch()")
        if self._pending is not None:
            raise InvalidArgumentError(
                f"context.write() was already called for batch {self._current.batch_idx}: write all the rows of a "
                "batch in one call (one row per example of context.batch_indices)"
            )
        copies, ragged = DeviceCopies(), set()
        table = rows_to_table(rows, self._current.indices, copies, ragged)
        schema = RecordSchema(table.schema, frozenset(ragged), f"batch {self._current.batch_idx} (rank {self._rank})")
        self._pending = (table, copies.done(), schema)

    def _batch_finished(self, ok: bool) -> None:
        """The current batch returned (``ok``: its rows join the shard) or raised (they are dropped)."""
        pending, self._pending = self._pending, None
        if not ok or pending is None:
            return
        table, landing, schema = pending
        table = self._conform(table, landing, schema)
        if self._format == "jsonl":
            self._open()
            landing.wait()  # the lines are made now
            self._writer.write("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
        else:
            self._buffer.append(table)
            self._landing.append(landing)
            self._buffered += table.get_total_buffer_size()
            if self._buffered >= ROW_GROUP_BYTES:
                self._write_group()
        self._shard_bytes += table.get_total_buffer_size()
        self.rows += table.num_rows
        if self._shard_bytes >= SHARD_BYTES:
            self._close_shard()

    def _conform(self, table: Any, landing: CopiesDone, schema: RecordSchema) -> Any:
        """``table`` with the shard's schema: the rank's schema so far unified with the batch's (see
        :mod:`torch_batch_process.jobstore.schema`; a wider type starts a new shard). A cast reads values: it waits
        for the copies back first."""
        if self._sink is not None:  # a table's types rule (outputs/tables/sink.py)
            table, self._schema = self._sink.conform(table, schema, landing)
            return table
        known = self._schema
        if known is not None and table.schema.equals(known.schema) and schema.ragged <= known.ragged:
            return table  # the common case: types seen (and checked) before
        if self._format == "jsonl":
            _check_json_storable(schema)
        if known is None:
            self._schema = schema
            return table
        unified = unify(known, schema)  # raises SchemaConflictError naming the column and the batch
        table = table.select(unified.schema.names)
        landing.wait()
        if not table.schema.equals(unified.schema):
            try:
                table = table.cast(unified.schema)
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds
                raise SchemaConflictError(
                    f"context.write(): the rows of {schema.origin} do not fit the types of earlier batches "
                    f"{unified.schema.types[1:]} ({exc}); {FIX_HINT}"
                ) from exc
        if not unified.schema.equals(known.schema):  # e.g. a column that was all None so far
            self._close_shard()
        self._schema = unified
        return table

    def _open(self) -> None:
        if self._writer is not None:
            return
        stage = self._stager.stage
        if stage != self._part_stage:
            self._part, self._part_stage = 0, stage
        if self._sink is not None:
            self._writer = self._sink.open(stage, self._part, self._schema.schema)
            self._part += 1
            return
        if self._folder is None:
            self._folder = self._stager.storage.scratch_folder(f"records-rank_{self._rank}")
        name = shard_name(stage, self._rank, self._part, self._format)
        self._part += 1
        self._file = self._folder / Path(name).name
        if self._format == "jsonl":
            self._writer = open(self._file, "w", encoding="utf-8")  # noqa: SIM115 - closed at the shard's end
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = self._schema.schema
            dictionary = [f.name for f in schema if _is_text(f.type)]
            flat = [f.name for f in schema if not pa.types.is_nested(f.type)]
            self._writer = pq.ParquetWriter(  # statistics of flat columns only: min/max of tensors cost ~15%
                self._file, schema, use_dictionary=dictionary, write_statistics=flat, compression="snappy"
            )
        self._name = name

    def _write_group(self) -> None:
        """Encodes the buffered rows as a row group on the background thread (after the previous group: at most
        two groups' rows in memory)."""
        if not self._buffer:
            return
        import pyarrow as pa

        self._open()
        group = pa.concat_tables(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        landing = self._landing
        self._buffer, self._buffered, self._landing = [], 0, []
        self._wait()
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(1, thread_name_prefix="tbp-records")
        self._encoding = self._encoder.submit(self._encode, self._writer, group, landing)

    @staticmethod
    def _encode(writer: Any, group: Any, landing: list[CopiesDone]) -> None:
        """On the encoder thread: waits for the group's copies back from the device, then writes the row group."""
        for copies in landing:
            copies.wait()
        writer.write_table(group, row_group_size=group.num_rows)

    def _wait(self) -> None:
        """Waits for the row group being encoded; raises its error."""
        encoding, self._encoding = self._encoding, None
        if encoding is not None:
            encoding.result()

    def _close_shard(self) -> None:
        """Closes the open shard and hands it to the stager (it joins the current stage)."""
        self._write_group()
        self._wait()
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        if self._sink is not None:
            self._sink.closed(writer.close())
            self._shard_bytes = 0
            return
        writer.close()
        assert self._file is not None
        self._stager.add_file(self._file, self._name)
        self._shard_bytes = 0

    @property
    def schema(self) -> RecordSchema | None:
        """The rank's record schema so far (``None``: no rows yet); its commit votes carry it."""
        return self._schema

    def take_rows(self) -> int:
        """The rows that joined shards since the last call (after :meth:`seal`: the rows of the stage being
        committed; its vote counts them)."""
        rows, self._taken_rows = self.rows - self._taken_rows, self.rows
        return rows

    def take_table_files(self) -> list[dict[str, Any]]:
        """A table target's data files closed since the last call (after :meth:`seal`: the stage's), for its vote."""
        return self._sink.take() if self._sink is not None else []

    def seal(self) -> None:
        """Before a commit: the open shard joins the stage being committed."""
        self._close_shard()

    def close(self) -> None:
        """When the call ends: drops what was not committed and the scratch folder."""
        try:
            self._wait()
        except Exception:  # noqa: BLE001 - the rows are dropped anyway
            pass
        if self._encoder is not None:
            self._encoder.shutdown()
            self._encoder = None
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - the rows are dropped anyway
                pass
            self._writer = None
        self._buffer, self._landing, self._pending = [], [], None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    types = pa.types
    return bool(types.is_string(arrow_type) or types.is_large_string(arrow_type) or types.is_dictionary(arrow_type))


def check_output_format(output_format: Any) -> None:
    """Raises :class:`InvalidArgumentError` for an unknown ``output_format``."""
    if output_format not in OUTPUT_FORMATS:
        raise InvalidArgumentError(
            f"output_format must be one of {sorted(OUTPUT_FORMATS)}, got {output_format!r}: the format of the "
            "shards context.write() stores"
        )
