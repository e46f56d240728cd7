"""Shadowing: the read side of a keyed job returns every key once, with its newest values (DESIGN §21).

A keyed job's rows carry their key and the run that wrote them (``_tbp_run``). An incremental run that processes a
changed example writes a new row for its key and leaves the older one where it is (a published shard is never
rewritten: exactly-once publication stays one rename or one PUT); reading back then keeps, for each key, its newest
*event*: a row, or a *tombstone* that hides the key's older rows without a row of its own (a failure of the key
in a later run; a key removed from the dataset by a run with ``prune_missing=True``). The rule is the planner's
(:mod:`~torch_batch_process.outputs.keyed.diff`), so what a rerun compares with is what ``read_outputs`` returns.

:func:`find_shadows` reads only the key and run columns of every *part* (a shard, a segment: rows read together,
numbered from 0 in their order), spills ``(key, run, part, row)`` by a hash of the key
(:class:`~torch_batch_process.outputs.keyed.partitions.KeyPartitions`), and compares a partition at a time: memory is
one partition of keys plus one bit per stored row for the hidden ones (:class:`Shadows`, 12.5 MB for 10**8 rows),
never the keys of the job. Reading the rows back then filters each run of rows it loads with
:meth:`Shadows.visible`, in any order, so ``iter_outputs`` keeps its bounded merge by index.

Two rows of one key and one run (never written by the library: a shard copied in twice) are kept once, the first
in part order. A plain glob reader sees every row, superseded ones included; it keeps the newest per key itself,
e.g. DuckDB: ``SELECT * FROM '<glob>' QUALIFY row_number() OVER (PARTITION BY id ORDER BY _tbp_run DESC) = 1``
(tombstones are not in the shards: a glob reader sees a failed or pruned key's last row).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from torch_batch_process.outputs.columns import require_pyarrow
from torch_batch_process.outputs.keyed.keys import KEY_COLUMN
from torch_batch_process.outputs.keyed.partitions import KeyPartitions, key_kind, partition_count
from torch_batch_process.storage.scratch import process_folder

__all__ = ["RUN_COLUMN", "Shadows", "find_shadows"]

RUN_COLUMN = "_tbp_run"
"""The column of a keyed job's rows that says which run wrote them (1 for the job's first run)."""

_TOMBSTONE = -1
"""The part of a tombstone event."""


class Shadows:
    """The hidden rows of each part (see the module docstring): a bitmap per part that has any."""

    def __init__(self, sizes: dict[int, int]) -> None:
        self._sizes = sizes
        self._bits: dict[int, np.ndarray] = {}
        self.hidden = 0
        """Rows hidden in all parts."""

    def _hide(self, part: int, rows: np.ndarray) -> None:
        bits = self._bits.get(part)
        if bits is None:
            bits = self._bits[part] = np.zeros(-(-self._sizes[part] // 8), np.uint8)
        np.bitwise_or.at(bits, rows >> 3, np.uint8(128) >> (rows & 7).astype(np.uint8))
        self.hidden += len(rows)

    def visible(self, part: int, start: int, stop: int) -> np.ndarray | None:
        """Which rows ``[start, stop)`` of ``part`` are read back (a boolean mask), ``None`` when all are."""
        bits = self._bits.get(part)
        if bits is None:
            return None
        hidden = np.unpackbits(bits[start >> 3 : -(-stop // 8)])[start & 7 :][: stop - start]
        return None if not hidden.any() else ~hidden.astype(bool)


def find_shadows(
    parts: Iterable[tuple[int, Iterable[Any]]],
    tombstones: Iterable[Any] = (),
    *,
    total_rows: int,
    scratch: str | Path | None = None,
    rows_per_partition: int = 1 << 21,
) -> Shadows:
    """The rows that a newer event of their key hides.

    Args:
        parts: ``(part id >= 0, record batches)`` for every part, the batches with columns ``key`` and ``_tbp_run``
            (any others are ignored) in the part's row order.
        tombstones: record batches of ``key`` and ``_tbp_run``: failures and removals that hide a key's older rows.
        total_rows: about how many rows and tombstones there are (it sizes the partitions).
        scratch: a local folder for the partition files (a folder of this call is made in it and removed).
        rows_per_partition: rows per partition, on average (memory).
    """
    pa = require_pyarrow()
    partitions = partition_count(total_rows, rows_per_partition)
    folder = process_folder("shadow", scratch)  # a kill leaves it to the next process
    sizes: dict[int, int] = {}
    kind = ""  # "int" or "str": the first keys' (a keyed job's keys have one type)
    try:
        spilled = KeyPartitions(folder, "events", partitions)

        def event(batch: Any, part: int, first_row: int) -> Any:
            nonlocal kind
            keys = batch.column(KEY_COLUMN)
            kind = kind or key_kind(keys.type)
            n = batch.num_rows
            return pa.record_batch(
                [keys.cast(pa.int64() if kind == "int" else pa.large_string()),
                 batch.column(RUN_COLUMN).cast(pa.int32()),
                 pa.array(np.full(n, part, np.int32)),
                 pa.array(np.arange(first_row, first_row + n, dtype=np.int64))],
                names=[KEY_COLUMN, "run", "part", "row"],
            )

        for part, batches in parts:
            rows = 0
            for batch in batches:
                spilled.add(event(batch, part, rows))
                rows += batch.num_rows
            sizes[part] = rows
        for batch in tombstones:
            spilled.add(event(batch, _TOMBSTONE, 0))
        spilled.close()
        shadows = Shadows(sizes)
        for p in range(partitions):
            table = spilled.read(p)
            if table is None:
                continue
            _shadow_partition(table, kind, shadows)
            spilled.remove(p)
        return shadows
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _shadow_partition(table: Any, kind: str, shadows: Shadows) -> None:
    """Hides, in one partition's events, every row that is not its key's newest event."""
    import pyarrow.compute as pc

    keys = table.column(KEY_COLUMN)
    if kind == "int":
        codes = keys.to_numpy().astype(np.int64, copy=False)
    else:
        codes = np.concatenate([c.indices.to_numpy(zero_copy_only=False) for c in pc.dictionary_encode(keys).chunks])
    runs = table.column("run").to_numpy().astype(np.int64)
    parts = table.column("part").to_numpy()
    rows = table.column("row").to_numpy()
    tombstone = parts == _TOMBSTONE
    # by key, newest run first, a tombstone before a row of its run, then part and row order
    order = np.lexsort((rows, parts, ~tombstone, -runs, codes))
    ordered = codes[order]
    newest = np.ones(len(order), bool)
    newest[1:] = ordered[1:] != ordered[:-1]
    hidden = order[~newest & ~tombstone[order]]
    for part in np.unique(parts[hidden]).tolist():
        shadows._hide(part, np.sort(rows[hidden[parts[hidden] == part]]))
