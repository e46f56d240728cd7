"""Any sharded stream as a source: a list of shard descriptors and a function that opens one.

``Sharded(shards, open_shard)``: ``open_shard(shards[i])`` returns an iterable of the examples of
shard ``i``, the same ones in the same order every time (a file name and a reader, a database
key range and a query, a seed and a generator...). The descriptors and the function travel to
DataLoader workers and ranks by pickle: use module-level functions (not lambdas) and plain
descriptors.

It cannot seek: ``read(shard, start)`` opens the shard and drops its first ``start`` examples
(counted in ``rows_read``); reads of consecutive ranges continue one iterator. Row counts are
unknown unless given (``num_rows=[...]``); a shard that ends before its given count is an error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.sources.base import Cursor, ShardInfo, Source, SourceChangedError

__all__ = ["Sharded"]


class Sharded(Source):
    """A source over user-defined shards.

    Args:
        shards: the shard descriptors, in order (anything picklable).
        open_shard: ``open_shard(descriptor)`` returns an iterable of the shard's examples.
        num_rows: optional count of each shard (``None`` items for unknown ones); gives totals
            and an ETA, and is checked when a shard is read to its end.
        names: optional stable name of each shard (default: ``str`` of a str/int/path
            descriptor, else its ``repr``); the names go into the fingerprint, so they must be
            the same in every run.

    Raises:
        InvalidArgumentError: bad types, lengths that differ, names that repeat or that would
            change between runs (a ``repr`` with a memory address).
    """

    kind = "sharded"

    def __init__(
        self,
        shards: Sequence[Any],
        open_shard: Callable[[Any], Iterable[Any]],
        *,
        num_rows: Sequence[int | None] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
            raise InvalidArgumentError(
                f"shards={shards!r} is not a list; pass a list of shard descriptors (e.g. file names)"
            )
        descriptors = list(shards)
        if not descriptors:
            raise InvalidArgumentError("shards is empty; pass at least one shard descriptor")
        if not callable(open_shard):
            raise InvalidArgumentError(
                f"open_shard={open_shard!r} is not callable; pass a function that returns the examples of one shard"
            )
        counts = _check_counts(num_rows, len(descriptors))
        labels = _check_names(names, descriptors)
        self._descriptors = descriptors
        self._open_shard = open_shard
        self._shards = [ShardInfo(label, count) for label, count in zip(labels, counts, strict=True)]

    def shards(self) -> list[ShardInfo]:
        return list(self._shards)

    def fingerprint(self) -> dict[str, Any]:
        fn = self._open_shard
        qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        module = getattr(fn, "__module__", None) or type(fn).__module__
        return {
            "kind": self.kind,
            "open_shard": f"{module}.{qualname}",
            "shards": [{"name": info.name, "num_rows": info.num_rows} for info in self._shards],
        }

    @property
    def descriptors(self) -> list[Any]:
        """The shard descriptors, in order."""
        return list(self._descriptors)

    def _open_cursor(self, shard: int, start: int, stop: int | None) -> _ShardedCursor:
        return _ShardedCursor(self, shard)


class _ShardedCursor(Cursor):
    """The iterator of ``open_shard(descriptor)``, from the shard's beginning."""

    source: Sharded

    def __init__(self, source: Sharded, shard: int) -> None:
        super().__init__(source, shard, 0)
        self._iter = iter(source._open_shard(source._descriptors[shard]))
        self._produced = 0
        self._expected = source._shards[shard].num_rows

    def _produce(self, n: int) -> list[Any]:
        rows = []
        for row in self._iter:
            rows.append(row)
            if len(rows) >= n:
                break
        self._produced += len(rows)
        self.source._count_read(len(rows))
        if len(rows) < n and self._expected is not None and self._produced < self._expected:
            info = self.source._shards[self.shard]
            raise SourceChangedError(
                f"shard {info.name!r} ended after {self._produced} rows but num_rows says {self._expected}; "
                "fix num_rows (or pass None for unknown)"
            )
        return rows

    def close(self) -> None:
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()


def _check_counts(num_rows: Sequence[int | None] | None, n: int) -> list[int | None]:
    if num_rows is None:
        return [None] * n
    if isinstance(num_rows, (str, bytes)) or not isinstance(num_rows, Sequence) or len(num_rows) != n:
        raise InvalidArgumentError(
            f"num_rows must be a list of {n} counts (one per shard, None for unknown); got {num_rows!r}"
        )
    counts: list[int | None] = []
    for count in num_rows:
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise InvalidArgumentError(f"num_rows contains {count!r}; every count must be an int >= 0 or None")
        counts.append(count)
    return counts


def _check_names(names: Sequence[str] | None, descriptors: list[Any]) -> list[str]:
    if names is not None:
        if isinstance(names, str) or not isinstance(names, Sequence) or len(names) != len(descriptors):
            raise InvalidArgumentError(f"names must be a list of {len(descriptors)} str (one per shard); got {names!r}")
        labels = list(names)
        for label in labels:
            if not isinstance(label, str) or not label:
                raise InvalidArgumentError(f"names contains {label!r}; every name must be a non-empty str")
    else:
        labels = []
        for desc in descriptors:
            if isinstance(desc, os.PathLike):
                label = os.fspath(desc)
            elif isinstance(desc, (str, int)):
                label = str(desc)
            else:
                label = repr(desc)
            if " at 0x" in label:
                raise InvalidArgumentError(
                    f"shard {label} has no stable name (its repr holds a memory address, which changes between runs); "
                    "pass names=[...] with a stable name per shard"
                )
            labels.append(label)
    seen: set[str] = set()
    for label in labels:
        if label in seen:
            raise InvalidArgumentError(
                f"two shards are named {label!r}; shard names must be unique (pass names=[...] or distinct descriptors)"
            )
        seen.add(label)
    return labels
