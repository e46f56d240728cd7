"""JSON Lines files as a source: one JSON value (usually an object) per line, one shard per file.

- **Rows.** A row is a non-blank line; blank lines (a trailing newline, an empty line between
  records) are not rows. An example is the parsed value (``json.loads``): a ``dict`` for an object.
- **Compression.** Files ending in ``.gz``, ``.bz2``, ``.xz`` (and any other compression fsspec
  knows by suffix) are decompressed while read; they cannot seek.
- **Row counts.** Unknown by default (``num_rows=None``: counting needs a full scan). With
  ``count_rows=True`` every file is scanned once at construction (newlines only, no JSON parsing,
  files in parallel), which gives the totals (progress with an ETA) and, for uncompressed files,
  a sparse index: the byte offset of every :attr:`JsonlSource.INDEX_EVERY`-th row. A read that
  starts at row ``k`` then seeks to the indexed row at or before ``k`` and scans fewer than
  ``INDEX_EVERY`` lines; without the index it scans the ``k`` lines before (without parsing them,
  but counted in ``rows_read``). The index is kept with the source (a few bytes per thousand
  rows) and travels with it to DataLoader workers and ranks.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, ClassVar

from fsspec.compression import compr
from fsspec.utils import infer_compression

from torch_batch_process.errors import InvalidArgumentError, StorageError
from torch_batch_process.sources.base import Cursor, ShardInfo, SourceDataError
from torch_batch_process.sources.files import FileSource

__all__ = ["JsonlSource", "jsonl"]

SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.bz2", ".ndjson.bz2", ".jsonl.xz", ".ndjson.xz")
_SCAN_THREADS = 8
_BUFFER_BYTES = 1 << 20


def jsonl(
    urls_or_glob: str | Sequence[str],
    storage_options: dict[str, Any] | None = None,
    *,
    count_rows: bool = False,
) -> JsonlSource:
    """A source over JSON Lines files (``.jsonl``, ``.jsonl.gz``...), one shard per file.

    Args:
        urls_or_glob: a local path or fsspec URL, a glob, a folder (its ``*.jsonl``/``*.ndjson``
            files, compressed or not, recursively), or a list of these; globs and folders are
            expanded sorted by path.
        storage_options: options of the fsspec filesystem (credentials, endpoint...).
        count_rows: scan the files now to know their row counts (and to seek in uncompressed ones).

    Raises:
        InvalidArgumentError: no file matches, a file does not exist, an unknown compression, bad types.
        StorageError: the storage cannot be reached, or (``count_rows``) a file cannot be scanned.
    """
    return JsonlSource(urls_or_glob, storage_options=storage_options, count_rows=count_rows)


class JsonlSource(FileSource):
    """JSON Lines files read by row ranges; see :func:`jsonl`."""

    kind = "jsonl"
    #: With ``count_rows``, the byte offset of every this-many-th row is kept (uncompressed files).
    INDEX_EVERY: ClassVar[int] = 1024

    def __init__(
        self,
        urls_or_glob: str | Sequence[str],
        storage_options: dict[str, Any] | None = None,
        *,
        count_rows: bool = False,
    ) -> None:
        if not isinstance(count_rows, bool):
            raise InvalidArgumentError(f"count_rows={count_rows!r} must be True or False")
        super().__init__(urls_or_glob, storage_options, suffixes=SUFFIXES)
        self._compression: list[str | None] = []
        for entry in self._files:
            name = entry.path
            codec = infer_compression(name)
            if codec is not None and codec not in compr:
                raise InvalidArgumentError(
                    f"urls_or_glob: {entry.url!r} is {codec}-compressed but no {codec} decompressor is installed; "
                    "install it or decompress the file"
                )
            if codec == "zip":
                raise InvalidArgumentError(
                    f"urls_or_glob: {entry.url!r} is a zip archive; extract it (or gzip the JSONL file) first"
                )
            self._compression.append(codec)
        # Byte offset of rows 0, every, 2 * every... per shard; None: unknown (no scan, or compressed).
        self._every = self.INDEX_EVERY
        self._index: list[list[int] | None] = [None] * len(self._files)
        counts: list[int | None] = [None] * len(self._files)
        if count_rows:
            counts = self._scan_all()
        self._shards = [ShardInfo(entry.url, n) for entry, n in zip(self._files, counts, strict=True)]

    # ------------------------------------------------------------------ the interface

    def shards(self) -> list[ShardInfo]:
        return list(self._shards)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "shards": [
                {**entry.describe(), "num_rows": info.num_rows, "compression": codec}
                for entry, info, codec in zip(self._files, self._shards, self._compression, strict=True)
            ],
        }

    # ------------------------------------------------------------------ reading

    def _seek_cost(self, shard: int, start: int) -> int:
        if self._index[shard] is None:
            return start
        return start % self._every

    def _open_cursor(self, shard: int, start: int, stop: int | None) -> _JsonlCursor:
        index = self._index[shard]
        if index is None:
            return _JsonlCursor(self, shard, row=0, offset=0)
        mark = min(start // self._every, len(index) - 1)
        return _JsonlCursor(self, shard, row=mark * self._every, offset=index[mark])

    def open_text_lines(self, shard: int, offset: int = 0) -> tuple[BinaryIO, BinaryIO]:
        """``(raw, stream)``: the shard's file and a buffered, decompressed binary stream of its
        lines from byte ``offset`` (uncompressed files only); close both."""
        raw = self.open_file(shard)
        try:
            if offset:
                raw.seek(offset)
            codec = self._compression[shard]
            if codec is not None:
                return raw, io.BufferedReader(compr[codec](raw, mode="rb"), _BUFFER_BYTES)
            if self.is_local:
                return raw, raw  # a local file opened buffered
            return raw, io.BufferedReader(raw, _BUFFER_BYTES)
        except BaseException:
            raw.close()
            raise

    def _scan_all(self) -> list[int | None]:
        if self.is_local or len(self._files) == 1:
            return [self._scan(i) for i in range(len(self._files))]
        with ThreadPoolExecutor(min(_SCAN_THREADS, len(self._files)), thread_name_prefix="tbp-jsonl-scan") as pool:
            return list(pool.map(self._scan, range(len(self._files))))

    def _scan(self, shard: int) -> int:
        """Counts the rows of one file (and indexes its row offsets when it is uncompressed)."""
        entry = self._files[shard]
        every = self._every
        index: list[int] = []
        rows = 0
        offset = 0
        try:
            raw, stream = self.open_text_lines(shard)
            try:
                for line in stream:
                    if line.strip():
                        if rows % every == 0:
                            index.append(offset)
                        rows += 1
                    offset += len(line)
            finally:
                stream.close()
                raw.close()
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - unreadable, truncated gzip, lost connection
            raise StorageError(
                f"count_rows: cannot scan {entry.url!r} ({type(exc).__name__}: {exc}); "
                "fix or leave out the file, or pass count_rows=False"
            ) from exc
        if self._compression[shard] is None:
            self._index[shard] = index or [0]
        return rows


class _JsonlCursor(Cursor):
    """A line reader of one file from a known row and byte offset."""

    source: JsonlSource

    def __init__(self, source: JsonlSource, shard: int, *, row: int, offset: int) -> None:
        super().__init__(source, shard, row)
        self._url = source._files[shard].url
        self._raw, self._stream = source.open_text_lines(shard, offset)
        self._row = row  # the row number of the next line read from the stream

    def _lines(self, n: int) -> list[bytes]:
        lines: list[bytes] = []
        readline = self._stream.readline
        try:
            while len(lines) < n:
                line = readline()
                if not line:
                    break
                if line.strip():
                    lines.append(line)
        except Exception as exc:  # noqa: BLE001
            raise StorageError(
                f"reading JSONL shard {self._url!r} near row {self._row + len(lines)}: {type(exc).__name__}: {exc}"
            ) from exc
        self.source._count_read(len(lines))
        return lines

    def _produce(self, n: int) -> list[Any]:
        lines = self._lines(n)
        rows = []
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                snippet = line[:80].decode("utf-8", "replace").rstrip()
                raise SourceDataError(
                    f"JSONL shard {self._url!r}, row {self._row + i}: not valid JSON ({exc}): {snippet!r}"
                ) from exc
        self._row += len(lines)
        return rows

    def _skip(self, n: int) -> int:
        skipped = 0
        while skipped < n:
            lines = self._lines(min(n - skipped, 8192))
            if not lines:
                break
            skipped += len(lines)
        self._row += skipped
        return skipped

    def close(self) -> None:
        for f in (self._stream, self._raw):
            try:
                f.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
