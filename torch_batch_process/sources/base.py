"""The engine's view of a streaming source: shards of rows, read by row ranges, resumable by offsets.

A :class:`Source` is a fixed, ordered list of shards (files, or the shards of a Hugging Face
iterable dataset, or anything a user can open). The engine cuts shards into ranges of rows and
calls :meth:`Source.read` for each range; a resume re-reads only the ranges not yet committed,
and a source seeks past the rows before a range where its format allows it (Parquet row groups,
a JSONL byte-offset index) instead of decoding them.

Three things every source does the same way, implemented here once:

- **Sequential reads stay sequential.** Reading consecutive ranges of one shard (``[0, 64)``,
  ``[64, 128)``...) continues one open reader (a *cursor*) instead of reopening the shard and
  skipping again each time: each process keeps its last few cursors per source
  (:attr:`Source.MAX_CURSORS`), and a read that starts at or shortly after a cached cursor's
  position goes on from it.
- **Per-process state.** Open files, filesystems and cursors belong to the process that opened
  them. They are never pickled, and a forked child (a DataLoader worker) discards its parent's
  copies and opens its own on first use.
- **Counting.** :attr:`Source.rows_read` counts the rows this object decoded (or scanned past) in
  this process, including rows read only to skip them; :attr:`Source.on_rows_read`, when set, is
  called with each increment, in whichever process reads.
  :class:`~torch_batch_process.sources.reads_log.RowsReadLog` is such a hook that adds up the counts of every
  process (DataLoader workers, ranks) in a file.

The files of file-based sources are listed and opened by :mod:`torch_batch_process.sources.files`.
"""

from __future__ import annotations

import abc
import operator
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from torch_batch_process.errors import BatchProcessError, InvalidArgumentError

__all__ = ["Cursor", "ShardInfo", "Source", "SourceChangedError", "SourceDataError", "check_index"]


class SourceDataError(BatchProcessError, ValueError):
    """A shard's content does not match what the source expects (a line that is not JSON...; a shard with fewer
    rows than counted raises the subclass :class:`SourceChangedError`). The message names the shard and row."""


class SourceChangedError(SourceDataError):
    """A shard holds fewer rows than the job counted in it, or than its declared ``num_rows``: the data changed
    under the job (or the count is wrong). No row's fault, so it fails the job even with ``on_error="skip"``."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard of a source.

    Attributes:
        name: the shard's URL (file sources) or another stable id.
        num_rows: its number of rows, or ``None`` when it is unknown without reading it all
            (JSONL without ``count_rows``, Hugging Face iterable datasets, :class:`Sharded`).
    """

    name: str
    num_rows: int | None


class Source(abc.ABC):
    """A sharded stream of examples: what ``torch_batch_process(dataset=...)`` accepts besides
    map-style datasets.

    Subclasses implement :meth:`shards`, :meth:`fingerprint` and :meth:`_open_cursor` (plus
    :meth:`_seek_cost` when their format can seek). Sources are picklable and usable inside
    DataLoader worker processes.

    Attributes:
        rows_read: rows decoded (or scanned past to skip them) by this object in this process.
            A pickled copy starts from 0.
        on_rows_read: ``None`` or a picklable callable, called with the number of rows each time
            ``rows_read`` grows (in the process that reads). See
            :class:`~torch_batch_process.sources.reads_log.RowsReadLog`.
    """

    kind: ClassVar[str] = "source"
    #: Rows produced per step of a read (converted to Python objects together).
    CHUNK_ROWS: ClassVar[int] = 1024
    #: Open cursors kept per source per process, for reads that continue where another ended.
    MAX_CURSORS: ClassVar[int] = 4
    #: Attributes that belong to one process and are never pickled (reset to None in a copy).
    _TRANSIENT: ClassVar[tuple[str, ...]] = ()

    _pid: int
    _lock: threading.Lock
    _cursors: list[Cursor]

    def __init__(self) -> None:
        self.rows_read = 0
        self.on_rows_read: Callable[[int], None] | None = None
        self._reset_process_state()

    # ------------------------------------------------------------------ the interface

    @abc.abstractmethod
    def shards(self) -> list[ShardInfo]:
        """The shards, in a stable order (computed once, from metadata only)."""

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """A JSON-able description that changes when the data would (kind, names, sizes, versions...)."""

    def read(self, shard: int, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """The examples of rows ``[start, stop)`` of shard ``shard`` (``stop=None``: to its end).

        Arguments are checked now; rows are read lazily as the iterator is consumed. A range past
        the end of the shard yields fewer rows (none when ``start`` is past the end). Rows before
        ``start`` are skipped by seeking where the format allows, else read and dropped (and
        counted in :attr:`rows_read`).

        Raises:
            InvalidArgumentError: ``shard`` is not an index of :meth:`shards`, ``start < 0`` or
                ``stop < start``.
        """
        shard, start, stop = self._check_range(shard, start, stop)
        if stop is not None and start >= stop:
            return iter(())
        return self._rows(shard, start, stop)

    def count_rows(self, shard: int) -> int:
        """The rows of ``shard``, counted by skipping through it: without decoding where the format can (a JSONL
        line is counted, not parsed, so a line that is not JSON is the failure of its row when read, not of
        the count)."""
        shard, _, _ = self._check_range(shard, 0, None)
        cursor = self._open_cursor(shard, 0, None)
        try:
            while not cursor.at_end:
                cursor.skip(self.CHUNK_ROWS)
            return cursor.position
        finally:
            cursor.close()

    # ------------------------------------------------------------------ conveniences

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return len(self.shards())

    @property
    def num_rows(self) -> int | None:
        """Total rows over all shards, or ``None`` when any shard's count is unknown."""
        counts = [info.num_rows for info in self.shards()]
        return None if any(n is None for n in counts) else sum(counts)  # type: ignore[arg-type]

    def seek_origin(self, shard: int, row: int) -> int:
        """The row from which a new reader of ``row`` decodes (the first row of its Parquet row group, of its
        JSONL index mark, or 0 when the format cannot seek): reads with the same origin share decoding."""
        return row - self._seek_cost(shard, row)

    def close(self) -> None:
        """Closes the readers this process keeps open (they are reopened when needed)."""
        self._own_process()
        with self._lock:
            cursors, self._cursors = self._cursors, []
        for cursor in cursors:
            cursor.close()

    def __repr__(self) -> str:
        infos = self.shards()
        total = self.num_rows
        rows = "unknown" if total is None else str(total)
        return f"<{type(self).__name__} {len(infos)} shard(s), rows: {rows}>"

    # ------------------------------------------------------------------ for subclasses

    @abc.abstractmethod
    def _open_cursor(self, shard: int, start: int, stop: int | None) -> Cursor:
        """A new cursor on ``shard`` at a position ``<= start`` (as close to it as the format can seek);
        ``stop`` (``None``: unknown) tells how far the first read goes, to size its first decoding step."""

    def _check_range(self, shard: Any, start: Any, stop: Any) -> tuple[int, int, int | None]:
        """``(shard, start, stop)`` checked and normalized; ``stop`` clipped to a known row count."""
        infos = self.shards()
        shard = check_index("shard", shard)
        if not 0 <= shard < len(infos):
            raise InvalidArgumentError(
                f"shard={shard} is out of range: this {self.kind} source has {len(infos)} shard(s); "
                f"pass an index in [0, {len(infos)})"
            )
        start = check_index("start", start)
        if start < 0:
            raise InvalidArgumentError(f"start={start} is negative; pass a row offset >= 0")
        if stop is not None:
            stop = check_index("stop", stop)
            if stop < start:
                raise InvalidArgumentError(f"stop={stop} is before start={start}; pass stop >= start or None")
        known = infos[shard].num_rows
        if known is not None:
            stop = known if stop is None else min(stop, known)
        return shard, start, stop

    def _seek_cost(self, shard: int, start: int) -> int:
        """Rows a new cursor reads before reaching ``start`` (``start`` when the format cannot seek)."""
        return start

    def _count_read(self, rows: int) -> None:
        """Records ``rows`` rows decoded or scanned in this process."""
        if rows <= 0:
            return
        self.rows_read += rows
        if self.on_rows_read is not None:
            self.on_rows_read(rows)

    # ------------------------------------------------------------------ reading

    def _rows(self, shard: int, start: int, stop: int | None) -> Iterator[Any]:
        cursor = self._checkout(shard, start, stop)
        healthy = True
        try:
            while True:
                want = self.CHUNK_ROWS if stop is None else min(self.CHUNK_ROWS, stop - cursor.position)
                if want <= 0:
                    return
                healthy = False
                rows = cursor.take(want)
                healthy = True
                if not rows:
                    return
                given = 0
                try:
                    for row in rows:
                        given += 1  # counted before the yield: a consumer that stops here has this row
                        yield row
                finally:
                    if given < len(rows):
                        cursor.untake(rows[given:])
        finally:
            if healthy:
                self._checkin(cursor)
            else:
                cursor.close()

    def _checkout(self, shard: int, start: int, stop: int | None) -> Cursor:
        """A cursor at ``start``: a cached one at or before it that reaches it decoding no more rows than a
        new cursor would (rows it has decoded already cost nothing), else a new one."""
        self._own_process()
        cost = self._seek_cost(shard, start)
        best: Cursor | None = None
        with self._lock:
            for cursor in self._cursors:
                ahead = start - cursor.position
                if (
                    cursor.shard == shard
                    and 0 <= ahead
                    and ahead - cursor.buffered <= cost
                    and (best is None or cursor.position > best.position)
                ):
                    best = cursor
            if best is not None:
                self._cursors.remove(best)
        cursor = best if best is not None else self._open_cursor(shard, start, stop)
        try:
            cursor.skip(start - cursor.position)
        except BaseException:
            cursor.close()
            raise
        return cursor

    def _checkin(self, cursor: Cursor) -> None:
        """Keeps a cursor for a read that continues where this one ended (or closes it)."""
        if cursor.at_end or self._pid != os.getpid():
            cursor.close()
            return
        with self._lock:
            self._cursors.append(cursor)
            evicted = self._cursors[: -self.MAX_CURSORS] if len(self._cursors) > self.MAX_CURSORS else []
            del self._cursors[: len(evicted)]
        for old in evicted:
            old.close()

    # ------------------------------------------------------------------ processes and pickling

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._cursors = []
        for name in self._TRANSIENT:
            setattr(self, name, None)

    def _own_process(self) -> None:
        """Drops (without closing: they are the parent's) the readers inherited through a fork."""
        if self._pid != os.getpid():
            self._reset_process_state()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_pid", "_lock", "_cursors", *self._TRANSIENT):
            state.pop(name, None)
        state["rows_read"] = 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()


class Cursor(abc.ABC):
    """An open reader of one shard at row ``position``, producing rows in order.

    Subclasses implement :meth:`_produce` (and :meth:`_skip` when skipping can avoid decoding)
    and :meth:`close`. Rows given back with :meth:`untake` are served first by the next call.
    """

    def __init__(self, source: Source, shard: int, position: int) -> None:
        self.source = source
        self.shard = shard
        self.position = position
        self._head: list[Any] = []
        self._ended = False

    @property
    def buffered(self) -> int:
        """Rows after ``position`` decoded already (skipping them costs no decoding)."""
        return len(self._head)

    @property
    def at_end(self) -> bool:
        """Whether the shard has no row left after ``position``."""
        return self._ended and not self._head

    def take(self, n: int) -> list[Any]:
        """Up to ``n`` next rows (fewer only at the end of the shard)."""
        rows = self._head[:n]
        del self._head[:n]
        while len(rows) < n and not self._ended:
            more = self._produce(n - len(rows))
            if not more:
                self._ended = True
                break
            rows.extend(more)
        self.position += len(rows)
        return rows

    def untake(self, rows: list[Any]) -> None:
        """Gives back the last rows of a :meth:`take` that the consumer did not receive."""
        self._head[:0] = rows
        self.position -= len(rows)

    def skip(self, n: int) -> None:
        """Moves ``n`` rows ahead (or to the end) without converting them."""
        if n <= 0:
            return
        dropped = min(n, len(self._head))
        del self._head[:dropped]
        self.position += dropped
        if n > dropped and not self._ended:
            skipped = self._skip(n - dropped)
            self.position += skipped
            if skipped < n - dropped:
                self._ended = True

    @abc.abstractmethod
    def _produce(self, n: int) -> list[Any]:
        """Up to ``n`` new rows, ``[]`` at the end; counts what it decodes with ``source._count_read``."""

    def _skip(self, n: int) -> int:
        """Skips up to ``n`` rows; returns how many (fewer only at the end). Default: produce and drop."""
        skipped = 0
        while skipped < n:
            rows = self._produce(min(n - skipped, self.source.CHUNK_ROWS))
            if not rows:
                break
            skipped += len(rows)
        return skipped

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the files or iterators this cursor holds."""


def check_index(name: str, value: Any) -> int:
    """``value`` as an int (numpy and torch integers accepted); bools and other types refused."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name}={value!r} is a bool; pass an int")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name}={value!r} is not an int; pass an int") from None
