"""Parquet files as a source: row counts from the footers, reads that seek by row group.

Each file is one shard. At construction the footers are read (a few KiB per file, in parallel
for remote files) for the row count of every row group; nothing else is read until a range is.

An example is a ``dict`` of the selected columns with Python values (``pyarrow``'s ``to_pylist``:
ints, floats, str, bytes, lists, dicts for structs, ``datetime`` for timestamps, ``None`` for
nulls), which the default ``collate_fn`` batches like the rows of a list of dicts. For columnar
work, :meth:`ParquetSource.read_batches` yields the same rows as ``pyarrow.RecordBatch``\\ es.
There is no per-example Arrow format: a one-row Arrow object costs more than the Python values
and collates worse.

Reading rows ``[start, stop)`` opens the file at the row group that holds ``start`` (the rows of
earlier row groups are never fetched nor decoded), decodes from there in steps of at most
:attr:`ParquetSource.BATCH_ROWS` rows (sized to the range, at least ``MIN_BATCH_ROWS``, ending at
row group ends) and drops the rows before ``start``; so a resume reads again at most the part of one
row group before its offset. Consecutive ranges of a shard (``[0, 64)``, ``[64, 128)``...) continue the same reader
instead of reopening the row group. Parquet cannot seek inside a row group (pyarrow decodes a
row group from its first row), so files written with row groups of at most a few percent of
their rows resume best; pyarrow's default (up to 1Mi rows per group) makes a small file one group.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from torch_batch_process.errors import InvalidArgumentError, StorageError
from torch_batch_process.sources.base import Cursor, ShardInfo, check_index
from torch_batch_process.sources.files import FileSource

__all__ = ["ParquetSource", "parquet"]

SUFFIXES = (".parquet", ".parq", ".pq")
_FOOTER_THREADS = 16


def parquet(
    urls_or_glob: str | Sequence[str],
    columns: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ParquetSource:
    """A source over Parquet files, one shard per file.

    Args:
        urls_or_glob: a local path or fsspec URL (``s3://bucket/data/*.parquet``), a glob, a folder
            (its ``*.parquet`` files, recursively), or a list of these. Globs and folders are
            expanded sorted by path; list items keep their order.
        columns: the columns of each example (default: all columns of the first file); every
            file must have them.
        storage_options: options of the fsspec filesystem (credentials, endpoint...); default:
            the filesystem's usual environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...).

    Raises:
        InvalidArgumentError: no file matches, a file does not exist, a column is missing, bad types.
        StorageError: a footer cannot be read (not Parquet, truncated) or the storage cannot be reached.
    """
    return ParquetSource(urls_or_glob, columns=columns, storage_options=storage_options)


class ParquetSource(FileSource):
    """Parquet files read by row ranges; see :func:`parquet`."""

    kind = "parquet"
    #: Most rows pyarrow decodes per step. A reader opened for a range ``[start, stop)`` decodes in
    #: steps of about ``stop - start`` rows, between MIN_BATCH_ROWS and this, so a short read decodes
    #: little past its end; the rest stays in the reader for the next read. A
    #: step never exceeds the row group's rows: a reader does not decode into the next row group before
    #: it reads there (parallel readers that each take whole row groups decode no row twice).
    BATCH_ROWS: ClassVar[int] = 8192
    MIN_BATCH_ROWS: ClassVar[int] = 1024

    def __init__(
        self,
        urls_or_glob: str | Sequence[str],
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        wanted = _check_columns(columns)
        super().__init__(urls_or_glob, storage_options, suffixes=SUFFIXES)
        footers = self._read_footers()
        first_schema = footers[0][1]
        self._columns: list[str] = list(first_schema.names) if wanted is None else wanted
        for entry, (_, schema) in zip(self._files, footers, strict=True):
            missing = [name for name in self._columns if name not in schema.names]
            if missing:
                raise InvalidArgumentError(
                    f"columns: {entry.url!r} has no column {missing[0]!r} (it has {schema.names}); "
                    "pass columns that every file has, or leave the file out of urls_or_glob"
                )
        self._schema = pa.schema([first_schema.field(name) for name in self._columns])
        # Row offset of each row group's first row, then the file's row count: [0, n0, n0 + n1, ..., N].
        self._starts: list[list[int]] = []
        for group_rows, _ in footers:
            starts = [0]
            for rows in group_rows:
                starts.append(starts[-1] + rows)
            self._starts.append(starts)
        self._shards = [
            ShardInfo(entry.url, starts[-1]) for entry, starts in zip(self._files, self._starts, strict=True)
        ]

    # ------------------------------------------------------------------ the interface

    def shards(self) -> list[ShardInfo]:
        return list(self._shards)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "columns": list(self._columns),
            "schema": [[field.name, str(field.type)] for field in self._schema],
            "shards": [
                {**entry.describe(), "num_rows": starts[-1], "row_groups": len(starts) - 1}
                for entry, starts in zip(self._files, self._starts, strict=True)
            ],
        }

    @property
    def columns(self) -> list[str]:
        """The columns of each example."""
        return list(self._columns)

    @property
    def schema(self) -> pa.Schema:
        """The Arrow schema of the selected columns (from the first file)."""
        return self._schema

    def row_groups(self, shard: int) -> list[int]:
        """Row offset of the first row of each row group of ``shard``."""
        return self._starts[check_index("shard", shard)][:-1]

    def with_columns(self, columns: Sequence[str]) -> ParquetSource:
        """The same files and rows, reading only ``columns`` (some of this source's): a pass that needs a few
        columns (a keyed job's planner: the key and ``content=`` columns) decodes only those. Its readers are its
        own; no footer is read again."""
        wanted = _check_columns(columns) or []
        missing = [name for name in wanted if name not in self._columns]
        if missing:
            raise InvalidArgumentError(f"columns: the source has no column {missing[0]!r} (it has {self._columns})")
        schema = pa.schema([self._schema.field(name) for name in wanted])
        state = self.__getstate__() | {"_columns": wanted, "_schema": schema}
        narrow = ParquetSource.__new__(ParquetSource)
        narrow.__setstate__(state)
        return narrow

    def read_batches(
        self, shard: int, start: int = 0, stop: int | None = None, batch_rows: int | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Rows ``[start, stop)`` of ``shard`` as record batches of at most ``batch_rows`` rows.

        The columnar twin of :meth:`read` (same seeking, same reader reuse, same counting).
        """
        shard, start, stop = self._check_range(shard, start, stop)
        rows = self.BATCH_ROWS if batch_rows is None else check_index("batch_rows", batch_rows)
        if rows < 1:
            raise InvalidArgumentError(f"batch_rows={rows} must be >= 1")
        if stop is not None and start >= stop:
            return iter(())
        return self._batches(shard, start, stop, rows)

    # ------------------------------------------------------------------ reading

    def _seek_cost(self, shard: int, start: int) -> int:
        starts = self._starts[shard]
        return start - starts[self._group_of(shard, start)]

    def _group_of(self, shard: int, row: int) -> int:
        starts = self._starts[shard]
        return max(0, min(bisect.bisect_right(starts, row) - 1, len(starts) - 2))

    def _open_cursor(self, shard: int, start: int, stop: int | None) -> _ParquetCursor:
        group = self._group_of(shard, start)
        starts = self._starts[shard]
        step = self.BATCH_ROWS
        if stop is not None:
            step = max(self.MIN_BATCH_ROWS, min(step, stop - start))
        group_rows = starts[group + 1] - starts[group]
        if group_rows > 0:  # whole steps per row group, so steps end where row groups do
            step = -(-group_rows // -(-group_rows // min(step, group_rows)))
        return _ParquetCursor(self, shard, group, step)

    def _batches(self, shard: int, start: int, stop: int | None, batch_rows: int) -> Iterator[pa.RecordBatch]:
        cursor = self._checkout(shard, start, stop)
        assert isinstance(cursor, _ParquetCursor)
        healthy = True
        try:
            while True:
                want = batch_rows if stop is None else min(batch_rows, stop - cursor.position)
                if want <= 0:
                    return
                healthy = False
                batch = cursor.take_arrow(want)
                healthy = True
                if batch is None:
                    return
                yield batch
        finally:
            if healthy:
                self._checkin(cursor)
            else:
                cursor.close()

    def _read_footers(self) -> list[tuple[list[int], pa.Schema]]:
        if self.is_local or len(self._files) == 1:
            return [self._read_footer(i) for i in range(len(self._files))]
        with ThreadPoolExecutor(min(_FOOTER_THREADS, len(self._files)), thread_name_prefix="tbp-footers") as pool:
            return list(pool.map(self._read_footer, range(len(self._files))))

    def _read_footer(self, shard: int) -> tuple[list[int], pa.Schema]:
        entry = self._files[shard]
        try:
            if self.is_local:
                meta = pq.read_metadata(entry.path)
            else:
                with self.open_file(shard) as f:
                    meta = pq.read_metadata(f)
            schema = meta.schema.to_arrow_schema()
            return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)], schema
        except StorageError:
            raise
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, ValueError) as exc:
            raise StorageError(
                f"urls_or_glob: cannot read the Parquet footer of {entry.url!r} ({type(exc).__name__}: {exc}); "
                "it is not a Parquet file or it is truncated: rewrite it, or leave it out of urls_or_glob"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - a backend error names the file
            raise StorageError(f"urls_or_glob: cannot read {entry.url!r}: {type(exc).__name__}: {exc}") from exc


class _ParquetCursor(Cursor):
    """A pyarrow batch reader over the row groups of one file from a given one to the last."""

    source: ParquetSource

    def __init__(self, source: ParquetSource, shard: int, row_group: int, batch_rows: int) -> None:
        super().__init__(source, shard, source._starts[shard][row_group])
        entry = source._files[shard]
        self._url = entry.url
        self._file: Any = None
        self._reader: pq.ParquetFile | None = None
        self._pending: pa.RecordBatch | None = None
        self._offset = 0  # rows of _pending already given out
        try:
            self._file = entry.path if source.is_local else source.open_file(shard)
            # pre_buffer off: pyarrow would keep every column chunk it fetched until the reader is
            # closed, so the memory of a sequential read would grow with the file
            self._reader = pq.ParquetFile(self._file, pre_buffer=False)
            groups = list(range(row_group, len(source._starts[shard]) - 1))
            self._iter = self._reader.iter_batches(
                batch_size=batch_rows, row_groups=groups, columns=source._columns, use_threads=False
            )
        except StorageError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001
            self.close()
            raise StorageError(f"cannot open Parquet shard {self._url!r}: {type(exc).__name__}: {exc}") from exc

    @property
    def buffered(self) -> int:
        pending = 0 if self._pending is None else self._pending.num_rows - self._offset
        return len(self._head) + pending

    def _piece(self, n: int) -> pa.RecordBatch | None:
        """Up to ``n`` next rows from the decoded batch (decoding the next one when it is used up)."""
        while self._pending is None or self._offset >= self._pending.num_rows:
            try:
                batch = next(self._iter, None)
            except Exception as exc:  # noqa: BLE001 - corrupt pages, lost connections
                raise StorageError(
                    f"reading Parquet shard {self._url!r} near row {self.position}: {type(exc).__name__}: {exc}"
                ) from exc
            if batch is None:
                self._pending = None
                return None
            self.source._count_read(batch.num_rows)
            self._pending, self._offset = batch, 0
        piece = self._pending.slice(self._offset, n)
        self._offset += piece.num_rows
        return piece

    def _produce(self, n: int) -> list[Any]:
        piece = self._piece(n)
        return [] if piece is None else piece.to_pylist()

    def _skip(self, n: int) -> int:
        skipped = 0
        while skipped < n:
            piece = self._piece(n - skipped)
            if piece is None:
                break
            skipped += piece.num_rows
        return skipped

    def take_arrow(self, n: int) -> pa.RecordBatch | None:
        """Up to ``n`` next rows as one record batch (``None`` at the end)."""
        if self._head:
            rows = self._head[:n]
            del self._head[:n]
            self.position += len(rows)
            return pa.RecordBatch.from_pylist(rows, schema=self.source.schema)
        pieces: list[pa.RecordBatch] = []
        rows = 0
        while rows < n and not self._ended:  # decoding steps may end before n rows (at row group ends)
            piece = self._piece(n - rows)
            if piece is None:
                self._ended = True
                break
            pieces.append(piece)
            rows += piece.num_rows
        if not pieces:
            return None
        self.position += rows
        if len(pieces) == 1:
            return pieces[0]
        return pa.Table.from_batches(pieces).combine_chunks().to_batches()[0]

    def close(self) -> None:
        self._pending = None
        if self._reader is not None:
            try:
                self._reader.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
            self._reader = None
        if self._file is not None and not isinstance(self._file, str):
            try:
                self._file.close()
            except Exception:  # noqa: BLE001
                pass
        self._file = None


def _check_columns(columns: Sequence[str] | None) -> list[str] | None:
    if columns is None:
        return None
    if isinstance(columns, str) or not isinstance(columns, Sequence):
        raise InvalidArgumentError(
            f"columns={columns!r} is not a list of column names; pass e.g. columns=['text'] (or None for all)"
        )
    names = list(columns)
    if not names:
        raise InvalidArgumentError("columns is empty; pass at least one column name, or None for all columns")
    for name in names:
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"columns contains {name!r}; every column name must be a non-empty str")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"columns={names} names a column twice; list each column once")
    return names
