"""A rank's segment log: its committed record rows appended to one file per shard period, on local storage.

On object stores each commit's rows are a segment file of their own (:mod:`torch_batch_process.outputs.segments`).
On a local folder (a disk, NFS, Lustre) a new file per commit is the dominant cost of a job that commits small
batches often: creating a file is a metadata operation (about 1 ms of kernel CPU on a busy ext4 disk, a server round
trip on a cluster file system), appending to an open one is not. So there a rank appends each commit's rows to its
open *log*, ``_tbp/segments/<s>-rank_<r>-<k>.arrows`` (:func:`~torch_batch_process.jobstore.layout.segment_log_file`:
``s`` is the stage of its first rows), and opens a new log only when its shard rolls over (or when the rows' types
widen: a stream has one schema).

The format is a plain Arrow IPC stream (any Arrow reader opens it): the schema, then one or more record batches per
commit, each carrying the stage it belongs to in its custom metadata (``tbp_stage``), and the end-of-stream marker
once the log is closed. The rows of stage ``s`` are appended (written to the file: a ``kill -9`` keeps them) before
the rank's vote for ``s`` (one process: before the record that commits ``s``, whose writer makes the appends the seals
queued), so:

- a batch counts iff the commit record commits its stage (:func:`read_log` takes that test), exactly as a segment
  file does;
- only the last batch can be cut off (the writer was killed or failed while appending it, before its vote or its
  record): its stage is not committed, and :func:`read_log` ignores such a *torn tail*. A damaged message that is
  whole (bytes follow it) raises :class:`~torch_batch_process.errors.OutputCorruptError` instead: committed rows may
  be behind it.
- each append ends with a *seal*: a record batch of no rows whose custom metadata (``tbp_crc32``) holds the CRC-32 of
  the append's messages. Arrow checks no checksum, so a flipped byte inside a value would otherwise be read (and rolled
  into a published shard) as another value; a reader checks each seal, and damage is an ``OutputCorruptError``.
  A log without seals (written by an earlier version) is read unchecked.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.errors import OutputCorruptError, StorageError
from torch_batch_process.storage.errors import file_error

__all__ = ["CRC_KEY", "STAGE_KEY", "LogScan", "SegmentLog", "read_log", "read_log_batch", "scan_log"]

STAGE_KEY = b"tbp_stage"
"""The custom metadata key of a record batch's stage."""

CRC_KEY = b"tbp_crc32"
"""The custom metadata key of a seal: the CRC-32 (decimal) of the append's messages before it."""

_CONTINUATION = 0xFFFFFFFF

_RESTORE = "Restore the job's storage from a copy, or run the job again in a new storage_path"


class SegmentLog:
    """A segment log being appended (one thread at a time: the rank's batch thread, its encoder thread or, one process,
    its record writer).

    The file is created at the first rows (it must not exist: a log is never appended to by two writers)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None
        self._sink: Any = None  # a buffer over the file: an append is one write, at its end
        self._writer: Any = None
        self._schema: Any = None
        self._failed = False  # an append raised: the log is cut back to its last whole append, nothing more goes in
        self._whole = 0  # the file's size after its last whole append
        self._read_fd: int | None = None  # reads an append back for its seal's checksum

    def append(self, table: Any, stage: int) -> None:
        """Appends ``table``'s rows as rows of ``stage`` (the schema of the log's first rows)."""
        import pyarrow as pa

        if self._failed:
            raise RuntimeError(f"{self.path}: an earlier append to this segment log failed")
        if self._writer is None:
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                self._file = pa.OSFile(self.path, "ab")
            except FileExistsError:  # never appended to by two writers
                raise
            except OSError as exc:  # e.g. a full disk: a StorageError naming the log, as every storage failure
                raise file_error(self.path, "create the segment log", exc) from exc
            self._sink = pa.BufferedOutputStream(self._file, 1 << 16)
            self._schema = table.schema
            self._writer = pa.ipc.new_stream(self._sink, table.schema)
        elif not table.schema.equals(self._schema):
            raise ValueError(f"{self.path}: rows of another schema ({table.schema}) than the log's ({self._schema})")
        metadata = {STAGE_KEY: str(stage).encode()}
        try:
            batches = table.to_batches()
            for batch in batches:
                self._writer.write_batch(batch, custom_metadata=metadata)
            self._sink.flush()
            seal = {STAGE_KEY: metadata[STAGE_KEY], CRC_KEY: str(self._crc_since(self._whole)).encode()}
            # no rows: a slice of the last batch (free, and its dictionaries, if any, stay the stream's)
            self._writer.write_batch(batches[-1].slice(0, 0) if batches else self._empty(), custom_metadata=seal)
            self._sink.flush()  # in the file (a kill -9 keeps it) before the vote
        except BaseException as exc:
            self._failed = True  # e.g. a full disk: the stage is never voted
            self._cut_back()
            if isinstance(exc, OSError) and not isinstance(exc, StorageError):
                raise file_error(self.path, "append rows to the segment log", exc) from exc
            raise
        self._whole = self._file.tell()

    def _crc_since(self, offset: int) -> int:
        """The CRC-32 of the file's bytes from ``offset`` to its end (just written: read back from the page cache)."""
        crc, end = 0, self._file.tell()
        if self._read_fd is None:
            self._read_fd = os.open(self.path, os.O_RDONLY)
        while offset < end:
            chunk = os.pread(self._read_fd, min(end - offset, 1 << 24), offset)
            if not chunk:
                raise OSError(f"{self.path}: shorter than written ({offset} of {end} bytes)")
            crc, offset = zlib.crc32(chunk, crc), offset + len(chunk)
        return crc

    def _empty(self) -> Any:
        import pyarrow as pa

        return pa.RecordBatch.from_pylist([], schema=self._schema)

    def _cut_back(self) -> None:
        """After a failed append: the file ends at its last whole append again (best effort: readers ignore a
        cut-off last batch anyway)."""
        try:
            os.truncate(self.path, self._whole)
        except OSError:
            pass

    def close(self) -> None:
        """Ends the stream (its end-of-stream marker; after a failed append the log ends at its last whole one
        instead) and closes the file; nothing more is appended."""
        writer, sink, file = self._writer, self._sink, self._file
        self._writer, self._sink, self._file = None, None, None
        try:
            if writer is not None and not self._failed:
                writer.close()
        finally:
            try:
                if sink is not None:
                    sink.close()
            except Exception:  # noqa: BLE001 - a failed log's buffered rest: cut off below
                if not self._failed:
                    raise
            finally:
                if file is not None and not file.closed:
                    file.close()
                if self._read_fd is not None:
                    os.close(self._read_fd)
                    self._read_fd = None
                if self._failed:
                    self._cut_back()


@dataclass
class LogScan:
    """What :func:`scan_log` found in a segment log."""

    schema: Any
    """The rows' ``pyarrow.Schema`` (what decodes any of its batches: :func:`read_log_batch`)."""
    batches: list[tuple[int, int, Any]] = field(default_factory=list)
    """The committed record batches: where each one's message starts and ends, and the batch."""

    @property
    def self_contained(self) -> bool:
        """Whether each batch can be decoded from its own bytes and the schema's (no dictionary-encoded column,
        whose dictionaries travel in messages of their own)."""
        return not any(_has_dictionary(field.type) for field in self.schema)


def scan_log(data: Any, committed: Callable[[int], bool], name: str) -> LogScan | None:
    """The committed record batches of a segment log (``data``: its bytes), ignoring a torn tail (``None``: not even
    its schema is whole).

    Raises:
        OutputCorruptError: the log is damaged before its end (``name`` names it in the message).
    """
    import pyarrow as pa

    buffer = pa.py_buffer(data)
    source = pa.BufferReader(buffer)
    scan = None
    end = 0  # where the messages read so far end
    sealed = 0  # where the messages the last seal covers end (the first seal covers the schema's message too)
    unsealed: list[tuple[int, int, Any]] = []  # committed batches after the last seal
    seals = 0
    try:
        reader = pa.ipc.open_stream(source)
        end = source.tell()
        scan = LogScan(reader.schema)
        while True:
            try:
                batch, metadata = reader.read_next_batch_with_custom_metadata()
            except StopIteration:  # the end-of-stream marker: written last, when the log was closed
                if source.tell() < buffer.size:
                    raise OutputCorruptError(
                        f"{name}: the segment log is damaged: an end of stream at byte {end}, "
                        f"{buffer.size - end} bytes before its end; committed record rows may be lost. {_RESTORE}"
                    ) from None
                break
            start, end = end, source.tell()
            stage = _stage(metadata, name)
            if batch.num_rows == 0 and CRC_KEY in metadata:
                _check_seal(data, sealed, start, metadata[CRC_KEY], name)
                scan.batches += unsealed
                unsealed, sealed, seals = [], end, seals + 1
            elif committed(stage):
                unsealed.append((start, end, batch))
    except (pa.ArrowException, OSError) as exc:
        if not _torn(buffer, end):
            raise OutputCorruptError(
                f"{name}: the segment log is damaged at byte {end} ({exc}); committed record rows may be lost. "
                f"{_RESTORE}"
            ) from exc
    if scan is not None and unsealed:
        if seals:  # an append's batches are committed only after its seal is written
            raise OutputCorruptError(
                f"{name}: the segment log is damaged: committed record rows after byte {sealed} have no seal (their "
                f"checksum). {_RESTORE}"
            )
        scan.batches += unsealed  # a log of an earlier version: no seals to check
    return scan


def _check_seal(data: Any, start: int, end: int, expected: bytes, name: str) -> None:
    """Raises :class:`OutputCorruptError` unless the CRC-32 of ``data[start:end]`` (an append's messages) is the one
    its seal holds."""
    found = zlib.crc32(memoryview(data)[start:end])
    if str(found).encode() != bytes(expected):
        raise OutputCorruptError(
            f"{name}: the segment log is damaged between bytes {start} and {end} (its CRC-32 is {found}, its seal "
            f"says {bytes(expected).decode(errors='replace')}): committed record rows would be read wrong. {_RESTORE}"
        )


def read_log(data: Any, committed: Callable[[int], bool], name: str) -> Any:
    """The rows of the committed stages of a segment log (``data``: its bytes) as a ``pyarrow.Table`` (``None``: not
    even its schema is whole), ignoring a torn tail (see :func:`scan_log`)."""
    import pyarrow as pa

    scan = scan_log(data, committed, name)
    if scan is None:
        return None
    return pa.Table.from_batches([batch for _, _, batch in scan.batches], schema=scan.schema)


def read_log_batch(schema: Any, message: bytes) -> Any:
    """One record batch of a log whose :attr:`LogScan.self_contained` is true, from the log's ``schema`` and the
    batch's message (its bytes in the log): a reader holds one batch, not the log."""
    import pyarrow as pa

    return pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(message)), schema)


def _has_dictionary(arrow_type: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        return True
    return any(_has_dictionary(arrow_type.field(i).type) for i in range(arrow_type.num_fields))


def _stage(metadata: Any, name: str) -> int:
    raw = None if metadata is None else metadata.get(STAGE_KEY)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise OutputCorruptError(f"{name}: a record batch of the segment log names no stage ({raw!r})") from None


def _torn(buffer: Any, start: int) -> bool:
    """Whether the message at byte ``start`` runs past the end of the data: cut off while it was appended (rather
    than damaged). An Arrow IPC message is a continuation marker (``0xFFFFFFFF``), its metadata's length (int32),
    the metadata (a flatbuffer ``Message`` table whose field 3 is the body's length) and the body."""
    data = memoryview(buffer)
    size = len(data)

    def integer(at: int, width: int, signed: bool = False) -> int:
        if at < 0 or at + width > size:
            raise IndexError(at)
        return int.from_bytes(data[at : at + width], "little", signed=signed)

    if size - start < 8:
        return True
    if integer(start, 4) != _CONTINUATION:
        return False
    length = integer(start + 4, 4, signed=True)
    meta = start + 8
    if length <= 0:
        return False
    if meta + length > size:
        return True
    try:
        root = meta + integer(meta, 4)
        vtable = root - integer(root, 4, signed=True)
        vtable_size = integer(vtable, 2)
        slot = 4 + 2 * 3  # the vtable's sizes (2 x uint16), then one uint16 offset per field: field 3 is bodyLength
        offset = integer(vtable + slot, 2) if vtable_size >= slot + 2 else 0
        body = integer(root + offset, 8, signed=True) if offset else 0
    except IndexError:
        return False  # the metadata is whole but does not parse: damaged
    return body >= 0 and meta + length + body > size
