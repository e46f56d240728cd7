"""Reading a table target back in dataset order: what :func:`~torch_batch_process.read_outputs` and
:func:`~torch_batch_process.iter_outputs` do when given a table target instead of a storage path.

The table is read with its format's own reader (delta-rs' query engine, pyiceberg's scan, Lance's scanner), its
current version: every job that wrote to it, every row once. :func:`read_table` sorts the whole table by ``index``;
:func:`iter_table` holds one window of :data:`WINDOW_ROWS` consecutive indices at a time (each window is a scan
filtered on ``index``, which the formats prune by file statistics), so memory does not grow with the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.outputs.columns import INDEX_COLUMN, require_pyarrow
from torch_batch_process.outputs.tables.base import Table, TableTarget

__all__ = ["WINDOW_ROWS", "iter_table", "read_table"]

WINDOW_ROWS = 1 << 20
""":func:`iter_table`: consecutive indices read (and sorted) together."""


def _opened(target: TableTarget, columns: list[str] | None) -> tuple[Table, Any]:
    """The opened table and the schema of the columns to read (``index`` first)."""
    require_pyarrow()
    target.check()
    table = target.open()
    schema = table.arrow_schema()
    if schema is None:
        raise FileNotFoundError(f"{target.describe_short()} does not exist (no job has committed rows to it yet)")
    names = columns if columns is not None else [INDEX_COLUMN, *[n for n in schema.names if n != INDEX_COLUMN]]
    unknown = [c for c in names if c not in schema.names]
    if unknown:
        raise InvalidArgumentError(
            f"columns: unknown column(s) {unknown}; {target.describe_short()} has the columns {schema.names}"
        )
    import pyarrow as pa

    return table, pa.schema([schema.field(name) for name in names])


def _typed(batch: Any, schema: Any) -> Any:
    """A batch with the table's (normalized) types, in the columns' order (readers differ: string views...)."""
    import pyarrow as pa

    table = pa.Table.from_batches([batch]).select(schema.names)
    return table if table.schema.equals(schema) else table.cast(schema)


def _sorted(table: Any) -> Any:
    index = table.column(INDEX_COLUMN).to_numpy()
    if len(index) < 2 or bool(np.all(index[1:] > index[:-1])):
        return table
    return table.take(np.argsort(index, kind="stable"))


def read_table(target: TableTarget, columns: list[str] | None) -> Any:
    """Every row of the table (``columns``, ``index`` first; ``None``: all) as one ``pyarrow.Table`` sorted by
    ``index``."""
    import pyarrow as pa

    table, schema = _opened(target, columns)
    parts = [_typed(batch, schema) for batch in table.batches(schema.names, None, None)]
    if not parts:
        return schema.empty_table()
    return _sorted(pa.concat_tables(parts))


def iter_table(target: TableTarget, columns: list[str] | None, batch_rows: int) -> Iterator[Any]:
    """The table's rows as record batches of at most ``batch_rows`` rows, in ``index`` order (see the module
    docstring)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table, schema = _opened(target, columns)
    low = high = None
    for batch in table.batches([INDEX_COLUMN], None, None):  # one column, streamed: the range of the indices
        if batch.num_rows:
            bounds = pc.min_max(batch.column(0))
            a, b = bounds["min"].as_py(), bounds["max"].as_py()
            low = a if low is None else min(low, a)
            high = b if high is None else max(high, b)
    if low is None or high is None:
        return
    for start in range(low, high + 1, WINDOW_ROWS):
        parts = [_typed(batch, schema) for batch in table.batches(schema.names, start, start + WINDOW_ROWS)]
        if not parts:
            continue
        window = _sorted(pa.concat_tables(parts))
        for offset in range(0, window.num_rows, batch_rows):
            yield from window.slice(offset, batch_rows).to_batches()
