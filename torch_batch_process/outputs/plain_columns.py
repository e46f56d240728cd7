"""The short way of ``context.write()`` for a batch whose columns look like the rank's last checked batch.

With tiny batches the checks and conversions of :func:`~torch_batch_process.outputs.columns.rows_to_table` (each
column's kind, device, shape and type looked at anew, the Arrow schema inferred, then compared with the rank's) are a
large part of a batch's own time. Most jobs write the same columns every batch: CPU tensors or numpy arrays of one
number per example, of the same types. :class:`PlainColumns` remembers such a batch's *signature* (the column names in
order, and each column's class and dtype) once its table has been checked against the rank's schema and kept as it
was, and builds a later batch's table straight from its buffers when the batch has that signature: the table the
long way gives, with the rank's schema (so the batch needs no schema comparison either).

A batch that differs in anything (another column, a dtype, a shape, a device, a tensor that requires grad, a list, a
subclass of tensor or array, a non-contiguous array...) takes the long way, which checks it and raises what it raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torch_batch_process.outputs.columns import INDEX_COLUMN, index_array, require_pyarrow

__all__ = ["PlainColumns"]

_PLAIN_TORCH = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.float16, torch.float32, torch.float64}
)
"""Tensor dtypes whose ``numpy()`` is an array Arrow wraps as it is (no bool, bfloat16, complex)."""


def _plain_array(array: np.ndarray) -> bool:
    return array.dtype.kind in "iuf" and array.dtype.isnative and array.flags.aligned and array.flags.c_contiguous


class PlainColumns:
    """The signature of one rank's plain batches (see the module docstring), and their tables.

    Args:
        names: the columns' names, in order.
        kinds: each column's class (``torch.Tensor`` or ``numpy.ndarray``) and dtype.
        schema: the ``pyarrow.Schema`` of their tables (``index`` first), the rank's.
    """

    def __init__(self, names: tuple[str, ...], kinds: tuple[tuple[type, Any], ...], schema: Any) -> None:
        self.names = names
        self.kinds = kinds
        self.schema = schema
        self._types = [field.type for field in schema]

    @staticmethod
    def signature(rows: Any, n: int) -> tuple[tuple[str, ...], tuple[tuple[type, Any], ...]] | None:
        """The signature of ``rows`` (``n`` examples) if it is a plain batch, else ``None``."""
        if type(rows) is not dict or not rows:
            return None
        kinds = []
        for value in rows.values():
            kind = type(value)
            if kind is torch.Tensor:
                if value.dtype not in _PLAIN_TORCH or not value.is_cpu or value.requires_grad or value.dim() != 1:
                    return None
                if len(value) != n or not _plain_array(value.numpy()):
                    return None
            elif kind is np.ndarray:
                if value.ndim != 1 or len(value) != n or not _plain_array(value):
                    return None
            else:
                return None
            kinds.append((kind, value.dtype))
        return tuple(rows), tuple(kinds)

    def fits(self, table: Any) -> bool:
        """Whether the table the long way made has the schema this signature's tables get (the rank's)."""
        return table.schema.equals(self.schema) and table.column_names == [INDEX_COLUMN, *self.names]

    def arrays(self, rows: Any, indices: Sequence[int]) -> list[Any] | None:
        """The batch's ``index`` (its ``range``, or its indices as a numpy array), then the columns of ``rows`` as numpy
        arrays, when they have this signature, else ``None``. No Arrow object yet: :meth:`join` makes one table of
        several batches."""
        if type(rows) is not dict or len(rows) != len(self.names):
            return None
        n = len(indices)
        arrays: list[Any] = [indices if type(indices) is range else index_array(indices)]
        for (name, value), (kind, dtype), expected in zip(rows.items(), self.kinds, self.names, strict=True):
            if name != expected or type(value) is not kind or value.dtype != dtype:
                return None
            if kind is torch.Tensor:
                if not value.is_cpu or value.requires_grad or value.dim() != 1:
                    return None
                value = value.numpy()
            elif value.ndim != 1:
                return None
            if len(value) != n or not (value.flags.c_contiguous and value.flags.aligned):
                return None
            arrays.append(value.copy())  # the values at the call: the processor may reuse its buffer (columns.py)
        return arrays

    @staticmethod
    def nbytes(arrays: list[Any]) -> int:
        """The bytes of a batch's :meth:`arrays` in a table (its ``index``: 8 a row)."""
        return 8 * len(arrays[0]) + sum(array.nbytes for array in arrays[1:])

    def join(self, batches: list[list[Any]]) -> Any:
        """One table of the rows of ``batches`` (each the :meth:`arrays` of a batch, in order), in the rank's schema."""
        pa = require_pyarrow()
        columns = [_joined_index([arrays[0] for arrays in batches])]
        if len(batches) == 1:
            columns += batches[0][1:]
        else:
            columns += [np.concatenate(column) for column in list(zip(*batches, strict=True))[1:]]
        rows = len(columns[0])
        return pa.Table.from_arrays(
            [
                pa.Array.from_buffers(arrow_type, rows, [None, pa.py_buffer(array)])
                for arrow_type, array in zip(self._types, columns, strict=True)
            ],
            schema=self.schema,
        )


def _joined_index(parts: list[Any]) -> np.ndarray:
    """The ``index`` column of batches whose indices are ``parts`` (ranges or arrays): one ``arange`` when they are
    consecutive ranges (a contiguous plan's batches of one rank, in a static schedule)."""
    if all(type(part) is range and part.step == 1 for part in parts) and all(
        before.stop == after.start for before, after in zip(parts, parts[1:], strict=False)  # one shorter
    ):
        return np.arange(parts[0].start, parts[-1].stop, dtype=np.int64)
    return np.concatenate([index_array(part) for part in parts])
