"""Columnar batches of Parquet sources: the default ``collate_fn``'s result built from Arrow columns.

A Parquet example is a dict of Python values, and the default ``collate_fn`` turns a list of them back into
columns: ``{"id": tensor([...]), "text": [...]}``. For a batch read from a Parquet file that round trip
(Arrow -> one dict per row -> tensors) costs more than the rest of the engine. When the user gave no
``collate_fn``, the engine reads a Parquet batch as one Arrow table and builds **the same result** from its
columns directly: integer columns as ``int64`` tensors, floating point ones as ``float64`` tensors (what
``default_collate`` makes of Python floats), booleans as ``bool`` tensors, strings and binaries as lists.
A batch with another column type (lists, structs, timestamps...) or with nulls goes the row way, so what
``process_batch`` receives never depends on the path (tested against ``default_collate``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import default_collate

__all__ = ["ArrowRows", "StreamCollate", "columns_of"]


class ArrowRows:
    """The rows of one batch as an Arrow table, for :class:`StreamCollate` (never seen by users)."""

    __slots__ = ("table",)

    def __init__(self, table: pa.Table) -> None:
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows


_LISTED = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
"""Column types that ``default_collate`` leaves as lists (str and bytes values)."""


def _column(values: pa.ChunkedArray) -> Any:
    """``default_collate`` of the column's Python values, or ``None`` when this type goes the row way."""
    kind = values.type
    if values.null_count:
        return None
    if pa.types.is_integer(kind) and kind != pa.uint64():
        array = values.to_numpy().astype(np.int64, copy=True)
        return torch.from_numpy(array)
    if pa.types.is_floating(kind):
        return torch.from_numpy(values.to_numpy().astype(np.float64, copy=True))
    if pa.types.is_boolean(kind):
        return torch.from_numpy(np.array(values.to_numpy(), dtype=np.bool_, copy=True))
    if any(test(kind) for test in _LISTED):
        return values.to_pylist()
    return None


def columns_of(table: pa.Table) -> dict[str, Any] | None:
    """The collated batch of ``table``'s rows, or ``None`` when a column must go the row way."""
    if table.num_rows == 0:
        return None
    out: dict[str, Any] = {}
    for name, values in zip(table.column_names, table.columns, strict=True):
        column = _column(values)
        if column is None:
            return None
        out[name] = column
    return out


class StreamCollate:
    """The ``collate_fn`` of a stream job without the user's own: columns straight from Arrow when it can
    (see the module docstring), else ``default_collate`` of the rows."""

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, ArrowRows):
            columns = columns_of(batch.table)
            if columns is not None:
                return columns
            return default_collate(batch.table.to_pylist())
        return default_collate(batch)
