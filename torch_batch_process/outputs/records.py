"""Record outputs: ``context.write(rows)`` streams one rank's rows into shard files committed exactly once.

Rows of a batch wait in memory until ``process_batch`` returns (a batch that raises contributes no rows), then
join the rank's buffer. Every :data:`ROW_GROUP_BYTES` of rows, the buffer goes to the rank's encoder thread (off
the batch's path), which appends it to the rank's open *segment* (an Arrow IPC file: no encoding) and to its open
*shard* (a Parquet row group, pyarrow's ``ParquetWriter``, or JSON lines). So the library holds at most two row
groups' rows per rank, whatever the job's size. CUDA tensors are copied back asynchronously into pinned memory
(:mod:`torch_batch_process.outputs.copyback`); the encoder thread waits for those copies just before it writes
their rows, so the batch's thread does not wait for the GPU.

At each commit of the rank (:meth:`RecordWriter.seal`, called by the committer before its vote) the rows since
the previous commit are made durable before the vote (one process on local storage: before the record that commits
them, see ``sole``): on object stores as the stage's segment,
``_tbp/segments/<s>-rank_<r>-<k>.arrow``, uploaded through the stager's file sink; on local storage appended to the
rank's segment log, ``_tbp/segments/<s>-rank_<r>-<k>.arrows``, one file per shard instead of one per commit
(:mod:`torch_batch_process.outputs.segment_log`). The shard stays open across commits (row groups by bytes, not by
commit). The shard is *rolled over* (closed and handed to the
:class:`~torch_batch_process.outputs.stager.OutputStager` like an ``upload_path()`` file, so it is published once
with the stage it is sealed in) at a commit once it holds ``TBP_SHARD_BYTES`` of rows (default 128 MiB), and at
every closing commit; its name is ``outputs/commit_<t>/rank_<r>/records/part-<t>-rank<r>-00000.<ext>`` (see
:mod:`torch_batch_process.jobstore.layout`). Once it is published, the segments it holds are deleted. The
protocol, and why readers see each committed row exactly once, is in :mod:`torch_batch_process.outputs.segments`.

With a table target (``table=``), shards are the table's data files instead, opened and closed through the rank's
:class:`~torch_batch_process.outputs.tables.sink.TableSink` at every commit (no segments: the table's own
transactions commit them), which also fixes the rows' types to the table's; their descriptors travel in the rank's
vote (:meth:`RecordWriter.take_table_files`), and rank 0 adds them to the table after the record
(:mod:`torch_batch_process.outputs.tables.commits`).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_batch_process.errors import InvalidArgumentError, SchemaConflictError
from torch_batch_process.jobstore.layout import SCRATCH_DIR, SEGMENTS_DIR, segment_file, segment_log_file
from torch_batch_process.jobstore.schema import FIX_HINT, RecordSchema, unify
from torch_batch_process.outputs.columns import rows_to_table
from torch_batch_process.outputs.copyback import CopiesDone, DeviceCopies
from torch_batch_process.outputs.plain_columns import PlainColumns
from torch_batch_process.outputs.segment_log import SegmentLog
from torch_batch_process.outputs.segments import shard_bytes
from torch_batch_process.outputs.shard_file import ShardFile
from torch_batch_process.outputs.shard_names import OUTPUT_FORMATS, RECORDS_DIR, shard_name
from torch_batch_process.outputs.stager import OutputStager
from torch_batch_process.storage.errors import file_error

if TYPE_CHECKING:
    from torch_batch_process.context import CurrentBatch
    from torch_batch_process.outputs.tables.sink import TableSink

__all__ = ["OUTPUT_FORMATS", "RECORDS_DIR", "RecordWriter", "check_output_format", "shard_name"]

ROW_GROUP_BYTES = 32 << 20
"""Parquet: a row group is written when this many bytes of rows are buffered."""

SHARD_BYTES = 512 << 20
"""A table target's data file is closed (and a new one opened) after this many bytes of rows (record shards roll
over at commits, by ``TBP_SHARD_BYTES``: :func:`~torch_batch_process.outputs.segments.shard_bytes`)."""


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
        stager: the rank's output stager (shards join its current stage; segments go through its file sink).
        current: the context's current batch (its indices give the ``index`` column).
        rank: this rank.
        output_format: ``"parquet"`` or ``"jsonl"``.
        schema: the job's record schema committed by earlier attempts (``None``: none yet).
        sink: a table target's data files (``None``: shards in the job's storage).
        sole: the job has one process, which also writes the commit records: on local storage a seal's rows are
            queued for the segment log, and appended in order by the first thread that needs them (the record writer
            before the commit point, :meth:`appended`; the encoder thread before a row group; the batch's thread when
            the log closes), so a commit wakes no thread (with several processes the vote itself must follow the
            append: rank 0 cannot wait for another rank's thread).
        stamp: a keyed job's columns added to each batch's rows (``key=``: :class:`~torch_batch_process.outputs.keyed.
            options.RowStamp`; ``None``: no key).
        keeps_rows: ``False`` on a replica's members other than its writer (``mesh=``): rows are checked, then
            dropped.
    """

    def __init__(
        self,
        stager: OutputStager,
        current: CurrentBatch,
        rank: int,
        output_format: str = "parquet",
        schema: RecordSchema | None = None,
        sink: TableSink | None = None,
        sole: bool = False,
        stamp: Callable[[Any, Sequence[int]], Any] | None = None,
        keeps_rows: bool = True,
    ) -> None:
        self._stager = stager
        self._sink = sink
        self._current = current
        self._rank = rank
        self._format = output_format
        # the batch's rows, until it returns: (table, its copies back, its ragged columns, batch_idx, and the rows'
        # signature when they are plain; True: a plain batch of ``_plain``'s signature, its numpy arrays for a table)
        self._pending: tuple[Any, CopiesDone, frozenset[str], int, Any] | None = None
        self._plain: PlainColumns | None = None  # the rank's plain batches' signature (outputs/plain_columns.py)
        self._plain_rows: list[list[Any]] = []  # plain batches' arrays since the last table (see _join_plain)
        self._stamp = stamp
        self._buffer: list[tuple[Any, CopiesDone]] = []  # rows not in the shard yet (with their copies back)
        self._buffered = 0
        self._unsaved: list[tuple[Any, CopiesDone]] = []  # rows not in a segment yet
        self._schema = schema  # the rank's rows so far (seeded with the job's: every shard unifies with it)
        self._folder: Path | None = None
        self._files = 0  # local files made in the scratch folder
        self._shard: ShardFile | None = None  # the open shard, kept across commits
        self._table_file: Any = None  # a table target's open data file
        self._shard_bytes = 0
        self._limit = SHARD_BYTES if sink is not None else shard_bytes()
        # local storage: segments are logs appended in place, one per shard (else a file per commit, uploaded)
        self._logs = sink is None and stager.storage.local_path(SEGMENTS_DIR) is not None
        self._late = _LateAppends() if sole and self._logs else None  # a seal's append is queued (see ``sole``)
        self._log_name = (-1, -1)  # the (first stage, part) of the newest log opened
        self._segment: _SegmentFile | SegmentLog | None = None  # the stage's open segment part, or the open log
        self._parts: list[_SegmentFile] = []  # the stage's closed segment parts (segment files)
        self._live: list[str] = []  # segments stored since the last roll-over (their rows are in the open shard)
        self._doomed: dict[int, list[str]] = {}  # stage of a rolled shard -> its segments, deleted once it is published
        self._doomed_lock = threading.Lock()
        self._part = 0
        self._part_stage = -1
        self._encoder: ThreadPoolExecutor | None = None  # rows are written off the batch's path
        self._encoding: Future[None] | None = None
        self.rows = 0
        self._taken_rows = 0
        self._rolled_rows = 0  # self.rows at the last roll-over: the rows since then are in segments only
        self._sealed_rows = 0  # self.rows at the last seal
        self._row_stage = -1  # the newest stage sealed with rows
        self._keeps_rows = keeps_rows
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
        indices = self._current.indices
        plain = self._plain
        if plain is not None and plain.schema is self._schema.schema:  # (the rank's types since: none widened)
            arrays = plain.arrays(rows, indices)
            if arrays is not None:  # the rank's signature: checked, in the rank's schema
                self._pending = (arrays, _NO_COPIES, _NONE_RAGGED, self._current.batch_idx, True)
                return
        signature = None
        if self._stamp is None and self._sink is None:  # a plain batch may start the short way (after its checks)
            signature = PlainColumns.signature(rows, len(indices))
        copies, ragged = DeviceCopies(), set()
        table = rows_to_table(rows, indices, copies, ragged)
        if self._stamp is not None:
            table = self._stamp(table, indices)
        self._pending = (table, copies.done(), frozenset(ragged), self._current.batch_idx, signature)

    def _batch_finished(self, ok: bool) -> None:
        """The current batch returned (``ok``: its rows join the buffer) or raised (they are dropped)."""
        pending, self._pending = self._pending, None
        if not ok or pending is None or not self._keeps_rows:
            return
        table, landing, ragged, batch_idx, plain = pending
        if plain is True:  # a plain batch: its arrays join the next table of plain rows (_join_plain)
            self._plain_rows.append(table)
            size, rows = PlainColumns.nbytes(table), len(table[0])
        else:
            self._join_plain()  # the plain rows before it first: the buffer keeps the rows' order
            checked = table
            table = self._conform(table, landing, ragged, batch_idx)
            if plain is not None and table is checked:  # kept as it was: later batches like it take the short way
                candidate = PlainColumns(*plain, self._schema.schema)
                self._plain = candidate if candidate.fits(table) else None
            size, rows = table.get_total_buffer_size(), table.num_rows
            self._buffer.append((table, landing))
            if self._sink is None:
                self._unsaved.append((table, landing))
        self._buffered += size
        self._shard_bytes += size
        self.rows += rows
        if self._buffered >= ROW_GROUP_BYTES:
            self._flush(shard=True)
        if self._sink is not None and self._shard_bytes >= self._limit:
            self._close_table_file()

    def _join_plain(self) -> None:
        """The plain batches' rows since the last call, as one table (one Arrow table per few batches instead of one
        per batch: building Arrow objects is most of a tiny batch's ``write``), for the shard and the segment (one
        record batch in a segment log: a stage's rows may be one or more record batches)."""
        if not self._plain_rows:
            return
        batches, self._plain_rows = self._plain_rows, []
        assert self._plain is not None  # the signature they were taken with (a new one starts after a join)
        table = self._plain.join(batches)
        self._buffer.append((table, _NO_COPIES))
        self._unsaved.append((table, _NO_COPIES))

    def _conform(self, table: Any, landing: CopiesDone, ragged: frozenset[str], batch_idx: int) -> Any:
        """``table`` with the shard's schema: the rank's schema so far unified with the batch's (see
        :mod:`torch_batch_process.jobstore.schema`; a wider type rewrites the open shard). A cast reads values: it
        waits for the copies back first. The batch's :class:`RecordSchema` is made only when its types are new (the
        common case compares the table's schema with the rank's: no object per batch)."""
        known = self._schema
        if self._sink is None and known is not None and ragged <= known.ragged and table.schema.equals(known.schema):
            return table  # the common case: types seen (and checked) before
        schema = RecordSchema(table.schema, ragged, f"batch {batch_idx} (rank {self._rank})")
        if self._sink is not None:  # a table's types rule (outputs/tables/sink.py)
            table, self._schema = self._sink.conform(table, schema, landing)
            return table
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
            self._widen(unified.schema)
            self._plain = None  # its tables have the old types
        self._schema = unified
        return table

    def _widen(self, schema: Any) -> None:
        """The rows' types widened: the buffered rows are written with the old types, the stage's segment part is
        closed (the next part has the new types), and an open Parquet shard is rewritten with the new types (rare:
        e.g. a column that was all ``None`` so far; this keeps one shard per roll-over)."""
        if self._sink is not None:
            self._close_table_file()
            return
        self._flush(shard=True)
        self._wait()
        self._end_segment()
        shard = self._shard
        if shard is None or self._format == "jsonl":  # JSON lines have no schema to change
            return
        import pyarrow.parquet as pq

        shard.close()
        old = pq.read_table(shard.path, page_checksum_verification=True)
        self._shard = ShardFile(self._local(".parquet"), schema, self._format)
        self._shard.write(old.select(schema.names).cast(schema))
        os.unlink(shard.path)

    def _local(self, suffix: str) -> Path:
        """A new file name in the rank's scratch folder."""
        if self._folder is None:
            self._folder = self._stager.storage.scratch_folder(SCRATCH_DIR, f"records-rank_{self._rank}")
        self._files += 1
        return self._folder / f"{self._files:06d}{suffix}"

    def _flush(self, *, shard: bool) -> None:
        """Hands rows to the encoder thread (after the previous hand-over: at most two groups' rows in memory): those
        not in a segment yet to the stage's segment, and with ``shard`` the buffered ones to the shard (as one row
        group), else they stay buffered for it."""
        import pyarrow as pa

        self._join_plain()
        saving, self._unsaved = self._unsaved, []
        group: Any = None
        landing = [copies for _, copies in saving]
        if shard and self._buffer:
            tables = [table for table, _ in self._buffer]
            group = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            landing += [copies for _, copies in self._buffer]
            self._buffer, self._buffered = [], 0
        if group is None and not saving:
            return
        target: Any = None
        if group is not None:
            if self._sink is not None:
                self._open_table_file()
                target = self._table_file
            else:
                if self._shard is None:
                    local = self._local("." + OUTPUT_FORMATS[self._format])
                    self._shard = ShardFile(local, self._schema.schema, self._format)
                target = self._shard
        segment: _SegmentFile | SegmentLog | _LateAppends | None = None
        if saving and self._late is not None:  # in order with the seals' queued appends: the encoder makes them all
            self._late.queue(self._open_segment(), saving, self._stager.stage)
            landing = landing[len(saving) :]  # the queued rows' copies are waited for by their append
            segment, saving = self._late, []
        elif saving:
            segment = self._open_segment()
        self._wait()
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(1, thread_name_prefix="tbp-records")
        tables = [table for table, _ in saving]
        stage = self._stager.stage
        self._encoding = self._encoder.submit(self._encode, target, group, segment, stage, tables, landing)

    @staticmethod
    def _encode(
        target: Any,
        group: Any,
        segment: _SegmentFile | SegmentLog | _LateAppends | None,
        stage: int,
        saving: list[Any],
        landing: list[CopiesDone],
    ) -> None:
        """On the encoder thread: waits for the rows' copies back from the device, then writes them."""
        if isinstance(segment, _LateAppends):
            segment.make()  # the queued appends first (the shard's rows include theirs: their copies are done then)
        for copies in landing:
            copies.wait()
        if segment is not None and not isinstance(segment, _LateAppends):
            import pyarrow as pa

            segment.append(pa.concat_tables(saving) if len(saving) > 1 else saving[0], stage)  # one write
        if target is not None:
            if isinstance(target, ShardFile):
                target.write(group)
            else:
                target.write_table(group, row_group_size=group.num_rows)

    def _open_segment(self) -> _SegmentFile | SegmentLog:
        """The open segment part (a file in the scratch folder), or the open log (in ``_tbp/segments/``): opened now
        if there is none."""
        if self._segment is None:
            if self._logs:
                stage, part = self._log_name
                stage, part = (stage, part + 1) if stage == self._stager.stage else (self._stager.stage, 0)
                self._log_name = (stage, part)
                rel = segment_log_file(stage, self._rank, part)
                path = self._stager.storage.local_path(rel)
                assert path is not None
                self._segment = SegmentLog(path)
                self._live.append(rel)  # deleted once the shard that holds its rows is published
            else:
                self._segment = _SegmentFile(self._local(".arrow"))
        return self._segment

    def _end_segment(self) -> None:
        """Closes the open segment part (stored at the next :meth:`seal`) or log (nothing more goes into it)."""
        if self._late is not None:
            self._late.make()  # the log's queued appends first
        segment, self._segment = self._segment, None
        if segment is None:
            return
        segment.close()
        if isinstance(segment, _SegmentFile):
            self._parts.append(segment)

    def _wait(self) -> None:
        """Waits for the rows being written; raises its error."""
        encoding, self._encoding = self._encoding, None
        if encoding is not None:
            encoding.result()

    # ------------------------------------------------------------ table targets

    def _open_table_file(self) -> None:
        if self._table_file is not None:
            return
        stage = self._stager.stage
        if stage != self._part_stage:
            self._part, self._part_stage = 0, stage
        assert self._sink is not None and self._schema is not None
        self._table_file = self._sink.open(stage, self._part, self._schema.schema)
        self._part += 1

    def _close_table_file(self) -> None:
        """A table target: closes its open data file (its descriptor travels in the next vote)."""
        self._flush(shard=True)
        self._wait()
        if self._table_file is not None:
            writer, self._table_file = self._table_file, None
            assert self._sink is not None
            self._sink.closed(writer.close())
        self._shard_bytes = 0

    # ------------------------------------------------------------ commits

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

    def seal(self, closing: bool = False) -> None:
        """Before a commit (its vote): the stage's rows are stored as its segment, and the shard is rolled over into
        the stage when it is full or the commit is a ``closing`` one. A table target's data file is closed."""
        if self._sink is not None:
            self._close_table_file()
            return
        self._wait()
        self._join_plain()
        saving, self._unsaved = self._unsaved, []
        if saving and self._late is not None:  # one process: appended by the record writer (appended()), or earlier
            self._late.queue(self._open_segment(), saving, self._stager.stage)
            saving = []
        if saving:  # written here, not handed to the encoder thread: the vote waits for it anyway (a hand-over
            # and its wake-up cost more than the write of a few small tables: ~1 ms a commit on a busy machine)
            import pyarrow as pa

            segment = self._open_segment()
            for _, copies in saving:
                copies.wait()
            tables = [table for table, _ in saving]
            segment.append(pa.concat_tables(tables) if len(tables) > 1 else tables[0], self._stager.stage)
        stage = self._stager.stage
        if not self._logs:  # a segment file per commit (a log stays open until the shard rolls over)
            self._end_segment()
        parts, self._parts = self._parts, []
        for k, part in enumerate(parts):
            rel = segment_file(stage, self._rank, k)
            self._stager.store_file(part.path, rel)
            self._live.append(rel)
        if self.rows != self._sealed_rows:
            self._sealed_rows, self._row_stage = self.rows, stage
        if self._shard_bytes >= self._limit or (closing and (self._shard is not None or self._buffer)):
            self._roll(stage)

    def appended(self) -> None:
        """Makes sure the rows of every stage sealed so far are in the segment log (any thread: the record writer's,
        before a record that commits them is written): makes the queued appends; raises an append's error. Returns at
        once unless ``sole``: then a seal's append is queued."""
        if self._late is not None:
            self._late.make()

    def segment_rows(self) -> list[int] | None:
        """After :meth:`seal`: ``[rows, stage]``, the rows this rank has in segments only (committed with the stages
        since its last roll-over; 0 right after one) and the newest stage that had rows; ``None``: the rank never
        wrote a row to segments (a table target, or no ``context.write()``). Its vote carries it, the commit record
        keeps it, and the repair at the next start checks the leftover segments against it
        (:func:`~torch_batch_process.outputs.segments.roll_leftovers`)."""
        if self._sink is not None or not self.rows:
            return None
        return [self.rows - self._rolled_rows, self._row_stage]

    def _roll(self, stage: int) -> None:
        """Closes the shard and hands it to ``stage`` (published with it); its segments are deleted after that."""
        self._flush(shard=True)
        self._wait()
        self._end_segment()  # a log ends with its shard
        shard, self._shard = self._shard, None
        self._shard_bytes = 0
        self._rolled_rows = self.rows  # every row so far is in the shard
        if shard is None:
            return
        shard.close()
        self._stager.add_file(shard.path, shard_name(stage, self._rank, 0, self._format))
        live, self._live = self._live, []
        with self._doomed_lock:
            self._doomed[stage] = live

    def published(self, stage: int) -> None:
        """``stage`` of this rank is published (any thread): deletes the segments its shard holds, if it has one."""
        with self._doomed_lock:
            doomed = self._doomed.pop(stage, None)
        if doomed:
            self._stager.storage.delete_files(doomed)

    def close(self) -> None:
        """When the call ends: drops what was not committed and the scratch folder."""
        try:
            self._wait()
        except Exception:  # noqa: BLE001 - the rows are dropped anyway
            pass
        if self._encoder is not None:
            self._encoder.shutdown()
            self._encoder = None
        for writer in (self._shard, self._segment, self._table_file):
            if writer is not None:
                try:
                    writer.close()
                except Exception:  # noqa: BLE001 - the rows are dropped anyway
                    pass
        self._shard, self._segment, self._table_file = None, None, None
        if self._late is not None:
            self._late.drop()
        self._buffer, self._unsaved, self._pending, self._parts, self._plain_rows = [], [], None, [], []
        if self._batch_finished in self._current.listeners:  # the current batch holds this writer: no cycle left
            self._current.listeners.remove(self._batch_finished)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


_NO_COPIES = CopiesDone([])
"""The copies back of a plain batch's rows: none (CPU columns)."""

_NONE_RAGGED: frozenset[str] = frozenset()


class _LateAppends:
    """One process on local storage: the seals' appends to the segment log, queued by the batch's thread and made in
    order by the first thread that needs them (see ``sole`` of :class:`RecordWriter`). Queuing wakes no thread: the
    record writer makes them before the record that commits their stages, at most every
    :data:`~torch_batch_process.engine.commit.group_commit.RECORD_SPACING_S` (a hand-over to the encoder thread at each
    commit cost two thread switches, most of a commit's time at tiny batches). After a failed append, every later call
    of :meth:`make` raises its error: no record commits rows that are not in the log."""

    def __init__(self) -> None:
        self._queued: list[tuple[SegmentLog | _SegmentFile, list[tuple[Any, CopiesDone]], int]] = []
        self._queue_lock = threading.Lock()  # held briefly: the batch's thread never waits for an append
        self._make_lock = threading.Lock()  # one maker at a time, in the order queued
        self._error: BaseException | None = None

    def queue(self, segment: SegmentLog | _SegmentFile, rows: list[tuple[Any, CopiesDone]], stage: int) -> None:
        """Queues ``rows`` (tables with their copies back) for ``segment`` as rows of ``stage``."""
        with self._queue_lock:
            self._queued.append((segment, rows, stage))

    def make(self) -> None:
        """Appends everything queued so far, in order (any thread); raises the error of a failed append."""
        import pyarrow as pa

        with self._make_lock:
            if self._error is not None:
                raise self._error
            with self._queue_lock:
                queued, self._queued = self._queued, []
            try:
                for segment, rows, stage in queued:
                    for _, copies in rows:
                        copies.wait()
                    tables = [table for table, _ in rows]
                    segment.append(pa.concat_tables(tables) if len(tables) > 1 else tables[0], stage)
            except BaseException as exc:
                self._error = exc
                raise

    def drop(self) -> None:
        """When the call ends: what is still queued was never committed."""
        with self._queue_lock:
            self._queued = []


class _SegmentFile:
    """A segment part being written on the encoder thread: an Arrow IPC file, opened at its first rows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: Any = None
        self._sink: Any = None

    def append(self, table: Any, stage: int) -> None:
        """Adds rows (of the segment's one ``stage``)."""
        import pyarrow as pa

        try:
            if self._writer is None:
                self._sink = pa.OSFile(os.fspath(self.path), "wb")
                self._writer = pa.ipc.new_file(self._sink, table.schema)
            self._writer.write_table(table)
        except OSError as exc:  # e.g. a full disk: a StorageError naming the file (pyarrow's names none)
            raise file_error(os.fspath(self.path), "write the record segment", exc) from exc

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
                self._sink.close()
            except OSError as exc:
                raise file_error(os.fspath(self.path), "finish the record segment", exc) from exc


def check_output_format(output_format: Any) -> None:
    """Raises :class:`InvalidArgumentError` for an unknown ``output_format``."""
    if output_format not in OUTPUT_FORMATS:
        raise InvalidArgumentError(
            f"output_format must be one of {sorted(OUTPUT_FORMATS)}, got {output_format!r}: the format of the "
            "shards context.write() stores"
        )
