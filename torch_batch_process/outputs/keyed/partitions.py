"""Rows spilled to local files by a hash of their key, so that keys are compared one partition at a time.

Comparing a dataset's keys with the stored ones (:mod:`~torch_batch_process.outputs.keyed.diff`), or finding the
newest row of every stored key (:mod:`~torch_batch_process.outputs.keyed.shadow`), needs every row of one key
together, not every key at once: each side is written to ``P`` Arrow IPC files by a hash of the key
(:class:`KeyPartitions`), then partition ``p`` of every side is loaded and compared, and dropped. Memory is that of
one partition (plus :data:`FLUSH_ROWS` rows buffered while spilling), whatever the number of keys; ``P`` is chosen
from the row counts (:func:`partition_count`). The files are plain Arrow streams on the local disk (about 24 bytes a
row), removed with their folder.

The partition of a key is a hash that only has to agree within one process (both sides are spilled by the same
process): splitmix64 of an int key, and of a string key a positional hash over its UTF-8 bytes computed with numpy
over the Arrow buffers (no Python call per key).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.outputs.columns import require_pyarrow
from torch_batch_process.storage.errors import file_error

__all__ = ["FLUSH_ROWS", "KeyPartitions", "key_kind", "partition_count", "partition_of", "spill_error"]

FLUSH_ROWS = 1 << 20
"""Rows buffered over all partitions before they are written out."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


_weights_cache = np.zeros(0, np.uint64)


def _weights(n: int) -> np.ndarray:
    """Per-position multipliers of the string hash (the first ``n``)."""
    global _weights_cache
    if len(_weights_cache) < n:
        size = max(n, 2 * len(_weights_cache), 64)
        _weights_cache = _splitmix64(np.arange(size, dtype=np.uint64)) | np.uint64(1)
    return _weights_cache[:n]


_STRING_CHUNK = 1 << 15
"""Strings hashed together: their per-byte temporaries stay in the CPU's caches (13x faster than 2**20 at once)."""


def _string_hashes(array: Any) -> np.ndarray:
    """A 64-bit hash of each string of an Arrow string array (no nulls), a chunk of strings at a time."""
    if len(array) > _STRING_CHUNK:
        return np.concatenate(
            [_string_hashes(array.slice(first, _STRING_CHUNK)) for first in range(0, len(array), _STRING_CHUNK)]
        )
    pa = require_pyarrow()
    if not pa.types.is_large_string(array.type):
        array = array.cast(pa.large_string())
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int64)[array.offset : array.offset + len(array) + 1]
    start, end = int(offsets[0]), int(offsets[-1])
    lengths = np.diff(offsets)
    data = np.frombuffer(data_buffer, np.uint8)[start:end] if data_buffer is not None else np.zeros(0, np.uint8)
    position = np.arange(end - start, dtype=np.int64) - np.repeat(offsets[:-1] - start, lengths)
    with np.errstate(over="ignore"):
        terms = (data.astype(np.uint64) + np.uint64(1)) * _weights(int(lengths.max(initial=0)))[position]
        sums = np.concatenate((np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)))
        mixed = sums[offsets[1:] - start] - sums[offsets[:-1] - start] + lengths.astype(np.uint64) * _GOLDEN
    return _splitmix64(mixed)


def key_kind(arrow_type: Any) -> str:
    """``"int"`` or ``"str"`` for an Arrow key column type; :class:`InvalidArgumentError` for any other."""
    pa = require_pyarrow()
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type):
        return "str"
    raise InvalidArgumentError(f"key: the keys are {arrow_type}; a key column must hold ints or strings")


def partition_of(keys: Any, partitions: int) -> np.ndarray:
    """The partition (``0 <= p < partitions``) of each key of an Arrow array of int or string keys (no nulls)."""
    pa = require_pyarrow()
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if key_kind(keys.type) == "int":
        hashes = _splitmix64(keys.cast(pa.int64()).to_numpy(zero_copy_only=False).view(np.uint64))
    else:
        hashes = _string_hashes(keys)
    return ((hashes >> np.uint64(32)) * np.uint64(partitions) >> np.uint64(32)).astype(np.int64)


def partition_count(rows: int, rows_per_partition: int) -> int:
    """How many partitions keep each under ``rows_per_partition`` rows (of all sides together), on average."""
    return max(1, math.ceil(rows / rows_per_partition))


class KeyPartitions:
    """One side's rows, spilled to ``partitions`` Arrow IPC files in ``folder`` by the hash of their ``key`` column.

    Args:
        folder: a local folder of this process (created if needed).
        name: the side's name (the files are ``<name>-<p>.arrows``).
        partitions: the number of partitions.
        flush_rows: rows buffered (over all partitions) before they are written.
    """

    def __init__(
        self, folder: str | os.PathLike[str], name: str, partitions: int, flush_rows: int = FLUSH_ROWS
    ) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.partitions = partitions
        self.rows = 0
        self._flush_rows = flush_rows
        self._buffers: list[list[Any]] = [[] for _ in range(partitions)]
        self._buffered = 0
        self._writers: list[Any] = [None] * partitions
        self._schema: Any = None

    def path(self, partition: int) -> Path:
        return self.folder / f"{self.name}-{partition}.arrows"

    def add(self, batch: Any) -> None:
        """Adds the rows of a ``pyarrow.RecordBatch`` that has a ``key`` column (every batch one schema)."""
        pa = require_pyarrow()
        if isinstance(batch, pa.Table):
            for part in batch.to_batches():
                self.add(part)
            return
        if batch.num_rows == 0:
            return
        if self._schema is None:
            self._schema = batch.schema
        elif not batch.schema.equals(self._schema):
            batch = batch.cast(self._schema)
        pids = partition_of(batch.column("key"), self.partitions)
        order = np.argsort(pids, kind="stable")
        counts = np.bincount(pids, minlength=self.partitions)
        grouped = batch.take(order)
        start = 0
        for partition, count in enumerate(counts.tolist()):
            if count:
                self._buffers[partition].append(grouped.slice(start, count))
                start += count
        self.rows += batch.num_rows
        self._buffered += batch.num_rows
        if self._buffered >= self._flush_rows:
            self._flush()

    def write(self, partition: int, table: Any) -> None:
        """Appends the rows of ``table`` to partition ``partition`` as they are (the caller knows they belong there:
        rows read back from a partition of another :class:`KeyPartitions` with as many partitions)."""
        if table.num_rows == 0:
            return
        if self._schema is None:
            self._schema = table.schema
        self._buffers[partition].append(table.cast(self._schema))
        self.rows += table.num_rows
        self._buffered += table.num_rows
        if self._buffered >= self._flush_rows:
            self._flush()

    def _flush(self) -> None:
        pa = require_pyarrow()
        for partition, batches in enumerate(self._buffers):
            if not batches:
                continue
            try:
                if self._writers[partition] is None:
                    self._writers[partition] = pa.ipc.new_stream(str(self.path(partition)), self._schema)
                parts = [b if isinstance(b, pa.Table) else pa.Table.from_batches([b]) for b in batches]
                self._writers[partition].write_table(pa.concat_tables(parts).combine_chunks())
            except OSError as exc:  # e.g. a full disk: pyarrow's error names no file
                raise spill_error(self.path(partition), exc) from exc
            self._buffers[partition] = []
        self._buffered = 0

    def close(self) -> None:
        """Writes what is buffered and closes the files (then :meth:`read` reads them)."""
        self._flush()
        for partition, writer in enumerate(self._writers):
            if writer is not None:
                try:
                    writer.close()
                except OSError as exc:
                    raise spill_error(self.path(partition), exc) from exc

    def read(self, partition: int) -> Any:
        """Partition ``partition``'s rows as one ``pyarrow.Table`` (``None``: no rows), read into memory (not
        memory-mapped: the memory it takes is this process's, counted and freed like any other)."""
        pa = require_pyarrow()
        if self._writers[partition] is None:
            return None
        with pa.OSFile(str(self.path(partition))) as source:
            return pa.ipc.open_stream(source).read_all()

    def remove(self, partition: int) -> None:
        """Deletes partition ``partition``'s file (once it is compared)."""
        if self._writers[partition] is not None:
            self.path(partition).unlink(missing_ok=True)


def spill_error(path: str | os.PathLike[str], exc: OSError) -> Exception:
    """The :class:`~torch_batch_process.errors.StorageError` of a spill file that cannot be written (naming it, with
    the disk's ``errno``): the keys are spilled under ``TMPDIR``, which must have room for them."""
    action = "spill keys (a keyed job's planning and read-back spill them under TMPDIR: give it a folder with room) to"
    return file_error(os.fspath(path), action, exc)
