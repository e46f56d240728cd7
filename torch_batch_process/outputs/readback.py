"""Reading record outputs back in dataset order: :func:`read_outputs` and :func:`iter_outputs`.

The committed shards of a job, those of its ``retry_failed=True`` runs included (the rows of the examples they
recovered), are ``<storage_path>/outputs/commit_*/rank_*/records/part-*.parquet`` (or ``.jsonl``): plain files
that pandas, polars, DuckDB, Spark and Hugging Face ``datasets`` read with that glob (rows are in no particular
order there; sort by ``index``). Retries run by earlier versions of the library kept theirs in
``<storage_path>/retries/*/outputs/...`` (:data:`RETRY_OUTPUTS_GLOB`); :func:`read_outputs` and
:func:`iter_outputs` read those too.

Shards are not each sorted by ``index`` (ranks interleave, and ``bucket_by`` orders a batch by length), so
:func:`iter_outputs` merges *runs*: a Parquet row group, or a whole JSONL shard, each with its smallest and
largest index (from the Parquet statistics, or one pass over the JSONL shard). Runs are loaded in order of
their smallest index; every row below the next run's smallest index is final and is yielded, sorted. So the
rows held at once are those of the runs whose index ranges overlap, which depends on the batch size,
``checkpoint_interval`` and ``bucket_window``, never on the size of the job.

Before returning anything, both compare the rows found with the rows the job's records committed
(:mod:`torch_batch_process.outputs.completeness`): shards missing or added are an error, not a short table.

Given a table target (``tables.delta(...)``, ``tables.iceberg(...)``, ``tables.lance(...)``) instead of a storage
path, both read that table, in ``index`` order, with its format's reader
(:mod:`torch_batch_process.outputs.tables.reading`). The storage path of a job that wrote to a table holds no
shards: reading it is an error that names the table.

Threads: shards are read from Python file objects, so pyarrow wraps what they return in buffers that hold Python
objects. Decoded on pyarrow's own thread pool (``use_threads=True``, ``pre_buffer=True``), a pool thread could
drop the last of those buffers after the call returned, taking the GIL while the interpreter was exiting: the
process then died with ``terminate called without an active exception`` (SIGABRT) after printing its result
(issue 26 item 6: about 1 run in 15 on a loaded machine; the core dump showed an Arrow worker in
``PyBuffer::~PyBuffer`` -> ``PyGILState_Ensure`` -> ``pthread_exit`` during ``Py_FinalizeEx``). So every read
here decodes in the calling thread (``use_threads=False``, no pre-buffering), and :func:`read_outputs` parallelizes
over shards with a thread pool of its own that is joined before it returns: nothing the call started outlives it.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from torch_batch_process.errors import CheckpointCorruptError, InvalidArgumentError, OutputCorruptError
from torch_batch_process.integers import is_int
from torch_batch_process.jobstore.layout import JOB_FILE, OUTPUTS_DIR, RETRIES_DIR
from torch_batch_process.jobstore.retries import retry_numbers
from torch_batch_process.jobstore.store import latest_record_at
from torch_batch_process.outputs.columns import INDEX_COLUMN, require_pyarrow
from torch_batch_process.outputs.completeness import CommittedRows, check_rows, committed_rows
from torch_batch_process.outputs.keyed.keys import KEY_COLUMN
from torch_batch_process.outputs.keyed.runs import failed_keys, keyed_column, removed_keys
from torch_batch_process.outputs.keyed.shadow import RUN_COLUMN, Shadows, find_shadows
from torch_batch_process.outputs.segment_log import read_log_batch, scan_log
from torch_batch_process.outputs.segments import (
    LOG_SUFFIX,
    is_segment,
    list_segments,
    live_segments,
    newest_shards,
    read_segment,
)
from torch_batch_process.outputs.shard_names import RECORDS_DIR, committed_shards, published_shards
from torch_batch_process.outputs.tables.base import TableTarget
from torch_batch_process.outputs.tables.reading import iter_table, read_table
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.errors import NotAFileError
from torch_batch_process.storage.registry import check_storage_options, open_storage
from torch_batch_process.storage.urls import check_storage_url

__all__ = ["OUTPUTS_GLOB", "RETRY_OUTPUTS_GLOB", "iter_outputs", "list_shards", "published_shards", "read_outputs"]

OUTPUTS_GLOB = f"{OUTPUTS_DIR}/commit_*/rank_*/{RECORDS_DIR}/part-*"
"""Glob of the record shards below a job's storage path (add ``.parquet`` or ``.jsonl``)."""

RETRY_OUTPUTS_GLOB = f"{RETRIES_DIR}/*/{OUTPUTS_GLOB}"
"""Glob of the record shards of ``retry_failed=True`` runs of earlier versions of the library (today's retries
publish to the job's ``outputs/``, under :data:`OUTPUTS_GLOB`)."""

logger = logging.getLogger(__name__)


def list_shards(storage: Storage) -> list[str]:
    """The committed record shards of the job (paths relative to the storage), in commit and rank order (its
    ``retry_failed=True`` runs' among them, after the job's), then those of retries of earlier versions
    (``retries/<k>/outputs/``, in order)."""
    shards = committed_shards(storage, "")
    for k in retry_numbers(storage):
        shards += committed_shards(storage, f"{RETRIES_DIR}/{k}/")
    kinds = {os.path.splitext(s)[1] for s in shards}
    if len(kinds) > 1:
        raise ValueError(
            f"{storage.url}: record shards of several formats ({sorted(kinds)}); read them one format at a time"
        )
    return shards


def _open(
    storage_path: Any, storage_options: dict[str, Any] | None
) -> tuple[Storage, list[str], Any, CommittedRows, Callable[[int], bool]]:
    """The storage, its committed shards (and live segments), the JSONL shards' committed schema, the rows to find
    (read before the shards are listed: see :mod:`torch_batch_process.outputs.completeness`) and the test of a
    committed stage (the rows of a segment log that count)."""
    require_pyarrow()
    if not isinstance(storage_path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"storage_path must be a local path or an fsspec URL, got {type(storage_path).__name__}"
        )
    storage = open_storage(storage_path, check_storage_options(storage_options))
    _refuse_table_job(storage)
    expected = committed_rows(storage)
    record = _latest_record(storage)  # then the segments, then the shards (see outputs/segments.py)
    segments = list_segments(storage) if record is not None else []
    shards = list_shards(storage)
    if not shards and not segments and not storage.exists(JOB_FILE) and not storage.exists(OUTPUTS_DIR):
        raise FileNotFoundError(f"{storage.url} holds no job (no {JOB_FILE}, no {OUTPUTS_DIR}/); check storage_path")
    live = [s.rel for s in live_segments(segments, record, newest_shards(shards))]
    if not shards and not live:
        _say_no_records(storage)
    typed = _committed_schema(storage) if shards and _kind(shards[0]) is _Kind.JSONL else None
    committed = record.has_stage if record is not None else (lambda stage: False)
    return storage, shards + live, typed, expected, committed


def _latest_record(storage: Storage) -> Any:
    """The job's latest commit record (``None``: none, or damaged: only published shards are read then)."""
    from torch_batch_process.jobstore.store import latest_record_at

    try:
        return latest_record_at(storage, "")
    except CheckpointCorruptError:
        return None


def _refuse_table_job(storage: Storage) -> None:
    """Raises :class:`InvalidArgumentError` when the job stored there wrote its rows to a table (``table=``)."""
    import json

    try:
        spec = json.loads(storage.read_bytes(JOB_FILE)).get("spec", {})
    except (FileNotFoundError, NotAFileError, ValueError, AttributeError):
        return  # no job file (or a damaged one): the shards, if any, are read as before
    table = spec.get("table") if isinstance(spec, dict) else None
    if table:
        name = table.get("uri") or table.get("identifier")
        raise InvalidArgumentError(
            f"{storage.url}: this job wrote its rows to the {table.get('format')} table {name!r}, not to shards; read "
            f"it with read_outputs(tables.{table.get('format')}(...)) (the same target the job was given)"
        )


def _say_no_records(storage: Storage) -> None:
    """Warns that a job has no record rows to read (an empty table, silently, misled users of ``upload_path()``
    jobs), saying where its files are when it wrote some."""
    folders = [name for name in storage.list(OUTPUTS_DIR) if name.startswith("commit_")]
    if folders:
        logger.warning(
            "%s: the job wrote no records (context.write()), so read_outputs()/iter_outputs() have no rows to give; "
            "its committed files (upload_path()) are in %s/commit_*/rank_*/ (e.g. glob('%s/**/*', recursive=True))",
            storage.url, storage.url_of(OUTPUTS_DIR), storage.url_of(OUTPUTS_DIR),
        )
    else:
        logger.warning("%s: the job has committed no outputs yet: no rows to read", storage.url)


def _committed_schema(storage: Storage) -> Any:
    """The Arrow schema of the job's rows as its newest commit record keeps it (its newest retry's, which unifies
    with the job's), or ``None`` (nothing committed yet). Read after the shards are listed: records are
    cumulative, so it covers every listed shard.

    JSONL keeps numbers and tensors as plain JSON (a float32 tensor of shape ``(2, 3)`` per example reads back as a
    list of lists of float64); cast to this schema, JSONL shards read back with the types and per-example shapes
    they were written with, as Parquet shards do."""
    for root in [*(f"{RETRIES_DIR}/{k}" for k in reversed(retry_numbers(storage))), ""]:
        try:
            record = latest_record_at(storage, root)
        except CheckpointCorruptError as exc:  # the published shards are still whole: read them untyped
            logger.warning("reading JSONL outputs with the types JSON gives, not the written ones: %s", exc)
            return None
        if record is not None and record.record_schema is not None:
            return record.record_schema.schema
    return None


def _columns(columns: Sequence[str] | None) -> list[str] | None:
    if columns is None:
        return None
    if isinstance(columns, (str, bytes, Mapping)) or not isinstance(columns, Iterable):
        raise InvalidArgumentError(f"columns must be a list of column names, got {columns!r}")
    names = list(columns)  # once: a generator would be used up by the check below
    if not all(isinstance(c, str) for c in names):
        raise InvalidArgumentError(f"columns must be a list of column names, got {names!r}")
    return [INDEX_COLUMN, *[c for c in names if c != INDEX_COLUMN]]


def _check_read_arguments(storage_path: Any, storage_options: Any) -> None:
    """Checks the storage path and options of a read before anything is opened."""
    if isinstance(storage_path, TableTarget):
        if storage_options is not None:
            raise InvalidArgumentError(
                "storage_options is for a job's storage path; a table target takes its own: "
                "tables.delta(uri, storage_options=...), tables.lance(uri, storage_options=...)"
            )
        return
    if not isinstance(storage_path, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"storage_path must be a local path or an fsspec URL, got {type(storage_path).__name__}"
        )
    check_storage_url(storage_path)
    check_storage_options(storage_options)


def _check_columns(wanted: list[str] | None, available: Sequence[str], where: str) -> None:
    """Raises InvalidArgumentError when ``wanted`` (from ``columns``) names columns that ``available`` lacks."""
    unknown = [c for c in wanted or () if c not in available]
    if unknown:
        raise InvalidArgumentError(
            f"columns: unknown column(s) {unknown}; the record outputs at {where} have the columns {list(available)}"
        )


class _Kind(enum.Enum):
    """What a committed file of record rows is, by its name (:func:`_kind`), and so how its rows are read."""

    PARQUET = "a Parquet shard: a run per row group"
    JSONL = "a JSONL shard: one run"
    SEGMENT = "a segment file (rows not in a shard yet): one run"
    LOG = "a segment log: a run per committed record batch"


def _kind(shard: str) -> _Kind:
    """The kind of a committed file (the one place that tells them apart by name)."""
    if shard.endswith(LOG_SUFFIX):
        return _Kind.LOG
    if is_segment(shard):
        return _Kind.SEGMENT
    if shard.endswith(".jsonl"):
        return _Kind.JSONL
    return _Kind.PARQUET


@dataclass
class _Run:
    """Rows that are loaded together: a Parquet row group, a JSONL shard, a segment file, or a record batch of a
    segment log."""

    shard: str
    kind: _Kind
    low: int
    high: int
    rows: int
    group: int = 0
    """A Parquet shard's row group."""
    span: tuple[Any, int, int] | None = None
    """A segment log's batch: the log's schema, where the batch's message starts and ends."""


@contextmanager
def _reading(storage: Storage, shard: str) -> Iterator[None]:
    """Around the reading of a committed shard: one that pyarrow cannot decode raises
    :class:`~torch_batch_process.errors.OutputCorruptError` naming it (pyarrow's own error names no file)."""
    pa = require_pyarrow()
    try:
        yield
    except (pa.ArrowException, NotAFileError, OSError) as exc:  # ArrowInvalid, a folder in its place...
        if isinstance(exc, OSError) and not isinstance(exc, NotAFileError) and not _undecodable(exc):
            raise  # the storage's own error (unreachable, no permission, gone): not damage
        raise OutputCorruptError(
            f"{storage.url_of(shard)}: this committed record shard cannot be read ({exc}); it is damaged. Restore it "
            f"from a backup, or move it out of {OUTPUTS_DIR}/ to read the other rows (its rows are then missing)"
        ) from exc


def _undecodable(exc: OSError) -> bool:
    """Whether pyarrow raised ``exc`` decoding bytes (``Corrupt snappy compressed data``, a bad zstd frame: a plain
    ``OSError`` without an errno), rather than the storage failing to give them (an errno, or a subclass)."""
    import pyarrow as pa

    return type(exc) is OSError and exc.errno is None or isinstance(exc, pa.ArrowException)


def _select(table: Any, columns: list[str] | None, storage: Storage) -> Any:
    """``table``'s ``columns`` (all of them for ``None``), after checking that it has them."""
    if columns is None:
        return table
    _check_columns(columns, table.column_names, storage.url)
    return table.select(columns)


def _read_jsonl(storage: Storage, shard: str, columns: list[str] | None, typed: Any) -> Any:
    """A JSONL shard, its columns cast to ``typed`` (the committed schema, see :func:`_committed_schema`)."""
    import pyarrow.json as pj

    with _reading(storage, shard), storage.open_input(shard) as f:
        table = pj.read_json(f, read_options=pj.ReadOptions(use_threads=False))
    table = _select(table, columns, storage)
    if typed is None:
        return table
    fields = [typed.field(name) if name in typed.names else table.field(name) for name in table.column_names]
    with _reading(storage, shard):  # rows that do not fit the committed schema: the shard (or record) is damaged
        return table.cast(require_pyarrow().schema(fields))


def _read_jsonl_index(storage: Storage, shard: str) -> Any:
    """The ``index`` column of a JSONL shard alone: the other fields are tokenized but never built (about half
    the time of reading the whole shard, which :func:`iter_outputs` does once more when it yields its rows)."""
    import pyarrow.json as pj

    pa = require_pyarrow()
    only_index = pa.schema([(INDEX_COLUMN, pa.int64())])
    options = pj.ParseOptions(explicit_schema=only_index, unexpected_field_behavior="ignore")
    with _reading(storage, shard), storage.open_input(shard) as f:
        return pj.read_json(f, read_options=pj.ReadOptions(use_threads=False), parse_options=options)


def _runs(
    storage: Storage, shards: list[str], typed: Any, committed: Callable[[int], bool]
) -> tuple[list[_Run], Any]:
    """Every run of the shards with its index range (footers only for Parquet, the index column for JSONL), and
    the shards' schemas unified (a column that was all None in one shard is typed in another). JSONL shards have
    the committed schema ``typed`` when the commit record keeps one (it covers every shard), else JSON's types."""
    pa = require_pyarrow()
    runs: list[_Run] = []
    schemas = []
    for shard in shards:
        kind = _kind(shard)
        if kind is _Kind.LOG:  # it grows with the job: a run per committed batch
            scan = _scan_log(storage, shard, committed)
            if scan is None:
                continue
            schemas.append(scan.schema)
            if not scan.self_contained:  # dictionaries in messages of their own: the whole log is one run
                whole = pa.Table.from_batches([b for _, _, b in scan.batches], schema=scan.schema)
                runs += _whole_run(shard, _Kind.SEGMENT, whole)
                continue
            for start, end, batch in scan.batches:
                index = batch.column(INDEX_COLUMN)
                if len(index):
                    span = (scan.schema, start, end)
                    runs.append(_Run(shard, kind, int(_np(index).min()), int(_np(index).max()), len(index), span=span))
        elif kind is _Kind.SEGMENT:  # committed rows not in a shard yet
            table = _read_segment(storage, shard, None, committed)
            if table is not None:
                schemas.append(table.schema)
                runs += _whole_run(shard, kind, table)
        elif kind is _Kind.JSONL:
            table = _read_jsonl(storage, shard, None, None) if typed is None else _read_jsonl_index(storage, shard)
            schemas.append(table.schema if typed is None else typed)
            runs += _whole_run(shard, kind, table)
        else:
            schemas.append(_parquet_runs(storage, shard, runs))
    runs.sort(key=lambda run: (run.low, run.shard, run.group))
    return runs, pa.unify_schemas(schemas, promote_options="permissive") if schemas else None


def _whole_run(shard: str, kind: _Kind, table: Any) -> list[_Run]:
    """The one run of a file read whole (none when it has no rows)."""
    index = table.column(INDEX_COLUMN)
    return [_Run(shard, kind, int(_np(index).min()), int(_np(index).max()), len(index))] if len(index) else []


def _parquet_runs(storage: Storage, shard: str, runs: list[_Run]) -> Any:
    """Adds a run per row group of a Parquet shard, from its footer (the ``index`` statistics give the range; a group
    without them is loaded first); returns the shard's schema."""
    import pyarrow.parquet as pq

    with _reading(storage, shard), storage.open_input(shard) as f:
        parquet = pq.ParquetFile(f, pre_buffer=False)
        meta = parquet.metadata
        schema = parquet.schema_arrow
    position = meta.schema.to_arrow_schema().get_field_index(INDEX_COLUMN)
    for group in range(meta.num_row_groups):
        rg = meta.row_group(group)
        if rg.num_rows == 0:
            continue
        stats = rg.column(position).statistics
        if stats is None or not stats.has_min_max:  # no statistics: the range is unknown, load it first
            runs.append(_Run(shard, _Kind.PARQUET, -1, 2**62, rg.num_rows, group=group))
        else:
            runs.append(_Run(shard, _Kind.PARQUET, int(stats.min), int(stats.max), rg.num_rows, group=group))
    return schema


class _Coalesced:
    """Rows in their final order, given out as record batches of ``batch_rows`` (the last one shorter)."""

    def __init__(self, batch_rows: int) -> None:
        self._batch_rows = batch_rows
        self._tables: list[Any] = []
        self._rows = 0

    def add(self, table: Any) -> Iterator[Any]:
        if table.num_rows:
            self._tables.append(table)
            self._rows += table.num_rows
        if self._rows >= self._batch_rows:
            yield from self._take(final=False)

    def flush(self) -> Iterator[Any]:
        yield from self._take(final=True)

    def _take(self, *, final: bool) -> Iterator[Any]:
        if not self._tables:
            return
        table = _concat(self._tables).combine_chunks()  # one chunk: batches of batch_rows, not of a run's rows
        whole = table.num_rows if final else table.num_rows - table.num_rows % self._batch_rows
        for start in range(0, whole, self._batch_rows):
            yield from table.slice(start, min(self._batch_rows, whole - start)).to_batches()
        rest = table.slice(whole)
        self._tables, self._rows = ([rest] if rest.num_rows else []), rest.num_rows


def _read_segment(
    storage: Storage, rel: str, columns: list[str] | None, committed: Callable[[int], bool]
) -> Any:
    """A live segment's rows (``columns`` of them; a log's of ``committed`` stages; ``None``: a log with no rows
    yet). One that vanished was rolled into a shard published after the listing (a running job): the read is to be
    done again."""
    try:
        with _reading(storage, rel):
            table = read_segment(storage, rel, committed)
    except FileNotFoundError as exc:
        raise _SegmentGone(rel) from exc
    return None if table is None else _select(table, columns, storage)


def _scan_log(storage: Storage, rel: str, committed: Callable[[int], bool]) -> Any:
    """The committed batches of a live segment log (see :func:`_read_segment` for one that vanished)."""
    try:
        with _reading(storage, rel), storage.open_input(rel) as f:
            return scan_log(f.read(), committed, storage.url_of(rel))
    except FileNotFoundError as exc:
        raise _SegmentGone(rel) from exc


def _read_log_batch(storage: Storage, rel: str, span: tuple[Any, int, int], columns: list[str] | None) -> Any:
    """One batch of a segment log, read from its bytes with the log's schema (found when its runs were listed)."""
    schema, start, end = span
    try:
        with _reading(storage, rel), storage.open_input(rel) as f:
            f.seek(start)
            message = f.read(end - start)
    except FileNotFoundError as exc:
        raise _SegmentGone(rel) from exc
    return _select(require_pyarrow().Table.from_batches([read_log_batch(schema, message)]), columns, storage)


class _SegmentGone(Exception):
    """A committed segment was deleted while it was being read: its rows are now in a published shard."""


_READ_AGAIN = 5
"""Attempts of a read that meets a segment rolled over meanwhile (each attempt lists again)."""


def _np(column: Any) -> np.ndarray:
    return column.to_numpy() if hasattr(column, "to_numpy") else np.asarray(column)


def _load(
    storage: Storage, run: _Run, columns: list[str] | None, typed: Any, committed: Callable[[int], bool]
) -> Any:
    import pyarrow.parquet as pq

    if run.kind is _Kind.LOG:
        assert run.span is not None
        return _read_log_batch(storage, run.shard, run.span, columns)
    if run.kind is _Kind.SEGMENT:
        return _read_segment(storage, run.shard, columns, committed)
    if run.kind is _Kind.JSONL:
        return _read_jsonl(storage, run.shard, columns, typed)
    with _reading(storage, run.shard), storage.open_input(run.shard) as f:
        return pq.ParquetFile(f, pre_buffer=False, page_checksum_verification=True).read_row_group(
            run.group, columns=columns, use_threads=False
        )


def _sorted(table: Any) -> Any:
    index = _np(table.column(INDEX_COLUMN))
    if len(index) < 2 or bool(np.all(index[1:] > index[:-1])):
        return table
    return table.take(np.argsort(index, kind="stable"))


def _key_events(table: Any, key: str) -> list[Any]:
    """A keyed part's rows as the events :func:`find_shadows` takes (columns ``key`` and ``_tbp_run``)."""
    return table.select([key, RUN_COLUMN]).rename_columns([KEY_COLUMN, RUN_COLUMN]).to_batches()


def _tombstones(storage: Storage) -> list[Any]:
    """The failures of a keyed job's runs and the keys its ``prune_missing=True`` runs removed: each hides its
    key's older rows (:func:`failed_keys`, :func:`removed_keys`)."""
    return [batch for found in (failed_keys(storage), removed_keys(storage)) if found is not None
            for batch in found.to_batches()]


def _visible(table: Any, shadows: Shadows, part: int) -> Any:
    """The rows of part ``part`` that no newer row of their key hides."""
    mask = shadows.visible(part, 0, table.num_rows)
    return table if mask is None else table.filter(mask)


def _concat(tables: list[Any]) -> Any:
    pa = require_pyarrow()
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables, promote_options="permissive")


def iter_outputs(
    storage_path: str | os.PathLike[str] | TableTarget,
    *,
    columns: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    batch_rows: int = 65536,
) -> Iterator[Any]:
    """Yields a job's committed record outputs (with the rows its ``retry_failed=True`` runs recovered) as
    ``pyarrow.RecordBatch``\\ es in ``index`` (dataset) order.

    Memory holds the runs (row groups) whose index ranges overlap, not the job: see the module docstring.

    Args:
        storage_path: the job's storage path (local path or fsspec URL), or a table target (``tables.delta(...)``...):
            that table is read (see the module docstring).
        columns: the columns to read (``index`` is always included, first); ``None``: all. A name that is not
            stored raises :class:`~torch_batch_process.errors.InvalidArgumentError`.
        storage_options: options of the fsspec filesystem.
        batch_rows: most rows per yielded record batch.
    """
    if not is_int(batch_rows) or batch_rows < 1:
        raise InvalidArgumentError(f"batch_rows must be a positive int, got {batch_rows!r}")
    wanted = _columns(columns)
    _check_read_arguments(storage_path, storage_options)
    if isinstance(storage_path, TableTarget):
        return iter_table(storage_path, wanted, batch_rows)
    return _iter_outputs(storage_path, wanted, storage_options, batch_rows)


def _iter_outputs(
    storage_path: str | os.PathLike[str], wanted: list[str] | None, storage_options: Any, batch_rows: int
) -> Iterator[Any]:
    """The generator of :func:`iter_outputs`, whose arguments are checked when it is called, not when iterated."""
    for attempt in range(_READ_AGAIN):
        storage, shards, typed, expected, committed = _open(storage_path, storage_options)
        try:
            runs, schema = _runs(storage, shards, typed, committed)
            break
        except _SegmentGone:
            storage.close()
            if attempt == _READ_AGAIN - 1:
                raise
    try:
        check_rows(storage, expected, ((run.shard, run.rows) for run in runs))  # before the first row is yielded
        key = keyed_column(storage)
        shadows = None
        if key is not None and schema is not None and key in schema.names:  # a keyed job: each key once (§21)
            shadows = find_shadows(
                ((i, _key_events(_load(storage, run, [key, RUN_COLUMN], typed, committed), key))
                 for i, run in enumerate(runs)),
                _tombstones(storage), total_rows=sum(run.rows for run in runs),
            )
        if schema is not None:  # every yielded batch has one schema
            _check_columns(wanted, schema.names, storage.url)
            names = wanted if wanted is not None else schema.names
            schema = require_pyarrow().schema([schema.field(name) for name in names])
        held: list[Any] = []
        ready = _Coalesced(batch_rows)  # final rows, yielded in batches of batch_rows (tiny runs are joined)
        for i in range(len(runs) + 1):
            bound = runs[i].low if i < len(runs) else None
            if held:
                table = _sorted(_concat(held))
                index = _np(table.column(INDEX_COLUMN))
                cut = len(index) if bound is None else int(np.searchsorted(index, bound, side="left"))
                yield from ready.add(table.slice(0, cut))
                held = [table.slice(cut)] if cut < len(index) else []
            if i < len(runs):
                try:
                    loaded = _load(storage, runs[i], wanted, typed, committed)
                except _SegmentGone as exc:
                    raise RuntimeError(
                        f"{storage.url}: the running job moved committed rows ({exc.args[0]}) into a shard while "
                        "iter_outputs() read them; call it again (or read a stopped job)"
                    ) from exc
                if shadows is not None:
                    loaded = _visible(loaded, shadows, i)
                held.append(loaded.select(schema.names).cast(schema))
        yield from ready.flush()
    finally:
        storage.close()


def read_outputs(
    storage_path: str | os.PathLike[str] | TableTarget,
    *,
    columns: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """A job's committed record outputs (``context.write()``), with the rows that its ``retry_failed=True`` runs
    recovered, as one ``pyarrow.Table`` sorted by ``index``.

    Tensors come back as nested fixed-size lists (see :func:`torch_batch_process.outputs.columns.column_to_numpy`
    for a ``(N, *shape)`` numpy array); ``table.to_pandas()`` or ``polars.from_arrow(table)`` convert it.
    Holds the whole table in memory: use :func:`iter_outputs` for outputs larger than memory.

    Args:
        storage_path: the job's storage path (local path or fsspec URL), or a table target (``tables.delta(...)``...):
            that table is read (see the module docstring).
        columns: the columns to read (``index`` is always included, first); ``None``: all. A name that is not
            stored raises :class:`~torch_batch_process.errors.InvalidArgumentError`.
        storage_options: options of the fsspec filesystem.
    """
    wanted = _columns(columns)
    _check_read_arguments(storage_path, storage_options)
    if isinstance(storage_path, TableTarget):
        return read_table(storage_path, wanted)
    for attempt in range(_READ_AGAIN):  # a running job may roll segments over while they are read
        try:
            return _read_all(storage_path, storage_options, wanted)
        except _SegmentGone:
            if attempt == _READ_AGAIN - 1:
                raise
    raise AssertionError("unreachable")


def _read_all(storage_path: Any, storage_options: dict[str, Any] | None, wanted: list[str] | None) -> Any:
    """:func:`read_outputs` of a storage path, once."""
    import pyarrow.parquet as pq

    storage, shards, typed, expected, committed = _open(storage_path, storage_options)
    key = keyed_column(storage)
    asked = wanted
    if key is not None and wanted is not None:  # shadowing needs the key and the run of every row
        wanted = [*wanted, *(c for c in (key, RUN_COLUMN) if c not in wanted)]

    def read(shard: str) -> Any:
        kind = _kind(shard)
        if kind in (_Kind.LOG, _Kind.SEGMENT):
            table = _read_segment(storage, shard, wanted, committed)
            return table if table is not None else require_pyarrow().table({INDEX_COLUMN: []})
        if kind is _Kind.JSONL:
            return _read_jsonl(storage, shard, wanted, typed)
        with _reading(storage, shard), storage.open_input(shard) as f:  # ParquetFile.read: ~3x faster than read_table
            parquet = pq.ParquetFile(f, pre_buffer=False, page_checksum_verification=True)  # see shard_file.py
            _check_columns(wanted, parquet.schema_arrow.names, storage.url)  # pyarrow ignores unknown names
            return parquet.read(columns=wanted, use_threads=False)  # see the module docstring: threads

    try:  # shards are decoded in parallel (pyarrow releases the GIL)
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="tbp-read") as pool:
            tables = list(pool.map(read, shards))
        check_rows(storage, expected, ((shard, table.num_rows) for shard, table in zip(shards, tables, strict=True)))
    finally:
        storage.close()
    if key is not None and any(key in t.column_names for t in tables):  # a keyed job: each key once (§21)
        shadows = find_shadows(
            ((i, _key_events(t, key)) for i, t in enumerate(tables) if key in t.column_names),
            _tombstones(storage), total_rows=sum(t.num_rows for t in tables),
        )
        tables = [_visible(t, shadows, i).select(asked) if asked is not None else _visible(t, shadows, i)
                  for i, t in enumerate(tables)]
    found = [t for t in tables if t.num_rows]
    if not found:
        if tables:  # every row hidden (a keyed job's keys all pruned): no row, the columns a row would have
            return _concat(tables).slice(0, 0)
        pa = require_pyarrow()
        return pa.table({INDEX_COLUMN: pa.array([], pa.int64())})
    tables = found
    tables.sort(key=lambda t: int(_np(t.column(INDEX_COLUMN)).min()))
    return _sorted(_concat(tables))
