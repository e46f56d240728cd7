"""Rows of ``context.write()`` as an Arrow table, and stored columns back as numpy arrays or tensors.

How values are stored (per example, i.e. along the first dimension of a column):

- a 1-d tensor or numpy array (one number per example): a plain Arrow column (``int64``, ``float``...);
- an n-d tensor or array of shape ``(N, d1, ..., dk)``: nested ``fixed_size_list`` columns (``d1`` lists of
  ... of ``dk`` values), so the shape of each example is in the column's type and comes back exactly
  (:func:`column_to_numpy` returns the ``(N, d1, ..., dk)`` array);
- a list of per-example tensors or arrays: stacked when they all have one shape, else variable-length nested
  lists (``list<list<...>>``);
- a list of Python values (strings, ints, floats, nested lists, dicts): the type Arrow infers.

Tensors on a device are copied to the CPU (CUDA tensors asynchronously, given a
:class:`~torch_batch_process.outputs.copyback.DeviceCopies`: the table then shares their pinned host memory, and its
values are valid once the copies are done); ``bfloat16`` becomes ``float32`` (neither numpy nor Parquet has it).
pyarrow is imported by the functions that need it (see :func:`require_pyarrow`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.shell_commands import pip_install

if TYPE_CHECKING:
    import pyarrow as pa

    from torch_batch_process.outputs.copyback import DeviceCopies

__all__ = ["INDEX_COLUMN", "column_to_numpy", "column_to_python", "index_array", "require_pyarrow", "rows_to_table"]

INDEX_COLUMN = "index"
"""The column the library adds to every row: the example's index in the dataset."""


_PYARROW: Any = None
"""pyarrow once imported (``require_pyarrow`` runs per ``context.write``: an import statement per batch costs ~1 us)."""


def require_pyarrow() -> Any:
    """Imports pyarrow, or raises an ImportError that names the extra to install."""
    global _PYARROW
    if _PYARROW is not None:
        return _PYARROW
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:  # pragma: no cover - pyarrow is in the test environment
        raise ImportError(
            "record outputs (context.write, read_outputs, iter_outputs, predict) need pyarrow: "
            f"{pip_install('records')} (or pip install pyarrow)"
        ) from exc
    _PYARROW = pyarrow
    return pyarrow


def _to_numpy(value: Any) -> Any:
    """A tensor as a numpy array (on the CPU); anything else unchanged."""
    torch = sys.modules.get("torch")  # not imported: ``value`` is no tensor (this runs per column per batch)
    if torch is None or not isinstance(value, torch.Tensor):
        return value
    if value.is_cpu and not value.requires_grad and value.dtype is not torch.bfloat16:
        return value.numpy()  # the common case: no new tensor (the column's values are copied once, into its table)
    value = value.detach()
    if value.dtype == torch.bfloat16:
        value = value.float()
    return value.cpu().numpy()


_ARROW_TYPES: dict[np.dtype, Any] = {}
"""numpy dtype -> Arrow type, as ``pa.from_numpy_dtype`` gives it (looked up per column per batch)."""


def _from_numpy(pa: Any, array: np.ndarray, landing: bool = False) -> Any:
    """An Arrow array of ``array``'s first dimension: nested fixed-size lists for the other dimensions.
    ``landing``: ``array`` is pinned memory that a copy is still filling; its values are not read (zero-copy)."""
    if array.dtype.kind in "OUS":  # objects and strings: let Arrow infer from Python values
        return pa.array(array.tolist())
    flat = array if array.ndim == 1 and array.flags.c_contiguous else np.ascontiguousarray(array).reshape(-1)
    arrow_type = _ARROW_TYPES.get(flat.dtype)
    if arrow_type is None:
        arrow_type = _ARROW_TYPES[flat.dtype] = pa.from_numpy_dtype(flat.dtype)
    if landing or (flat.dtype.kind in "iuf" and flat.dtype.isnative and flat.flags.aligned):
        # wraps the buffer as it is (landing: nothing reads the values before the copy is done); for plain numbers
        # this is what ``pa.array`` does, without its per-call dispatch (~0.5 us a column: this runs per batch)
        values = pa.Array.from_buffers(arrow_type, len(flat), [None, pa.py_buffer(flat)])
    else:
        values = pa.array(flat, type=arrow_type)  # typed
    shape = array.shape
    if len(shape) == 1:
        return values
    for level in range(len(shape) - 1, 0, -1):
        if shape[level]:
            values = pa.FixedSizeListArray.from_arrays(values, shape[level])
        else:  # Arrow has no fixed-size list of size 0: empty lists, one per element of the outer dimensions
            parents = int(np.prod(shape[:level]))
            values = pa.ListArray.from_arrays(pa.array(np.zeros(parents + 1, dtype=np.int32)), values)
    return values


def _column(pa: Any, name: str, value: Any, n: int, copies: DeviceCopies | None = None) -> Any:
    if copies is not None and _same_device_tensors(value, copies):
        import torch

        value = torch.stack(list(value))  # on the device: one copy back instead of one per example
    if copies is not None and copies.eligible(value):
        value, landing = copies.start(value).numpy(), True  # a pinned copy, still landing
    else:
        value, landing = _to_numpy(value), False
    if isinstance(value, np.ndarray):
        if value.ndim == 0 or value.shape[0] != n:
            raise InvalidArgumentError(
                f"context.write(): column {name!r} has shape {tuple(value.shape)}; its first dimension must be the "
                f"batch's {n} example(s)"
            )
        if not landing:
            # the caller's memory (its array, or its tensor's): the rows are what the column held at the call, while a
            # processor may change it in place once write() has returned (a buffer it reuses per batch) and the table
            # waits for its commit; one C-ordered copy (a pinned copy still landing is the library's own memory)
            value = value.copy()
        return _arrow_array(pa, name, value, landing)
    if not _is_per_example_list(value):
        raise InvalidArgumentError(
            f"context.write(): column {name!r} is one {type(value).__name__} value; give a tensor, a numpy array or "
            f"a list with one value per example ({n})"
        )
    if len(value) != n:
        raise InvalidArgumentError(
            f"context.write(): column {name!r} has {len(value)} values for the batch's {n} example(s)"
        )
    items = [_to_numpy(v) for v in value]
    if items and all(isinstance(v, np.ndarray) for v in items):
        if len({(v.shape, v.dtype) for v in items}) == 1 and items[0].dtype.kind not in "OUS":
            return _arrow_array(pa, name, np.stack(items))
        items = [v.tolist() for v in items]  # shapes differ: variable-length nested lists
    try:
        return pa.array(items)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"context.write(): column {name!r} cannot be stored: {exc}") from exc


def _arrow_array(pa: Any, name: str, array: np.ndarray, landing: bool = False) -> Any:
    """:func:`_from_numpy`, with a clear error naming the column for values neither format can store."""
    if array.dtype.kind == "c":
        raise InvalidArgumentError(
            f"context.write(): column {name!r} holds complex numbers ({array.dtype}), which Parquet and JSONL cannot "
            "store; write the real and imaginary parts as two columns (tensor.real, tensor.imag) or one column of "
            "torch.view_as_real(tensor)"
        )
    try:
        return _from_numpy(pa, array, landing)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"context.write(): column {name!r} ({array.dtype}) cannot be stored: {exc}") from exc


def _same_device_tensors(value: Any, copies: DeviceCopies) -> bool:
    """Whether ``value`` is a non-empty list of device tensors that ``copies`` takes, all of one shape and type."""
    if not isinstance(value, (list, tuple)) or not value or not all(copies.eligible(v) for v in value):
        return False
    first = value[0]
    return all(v.shape == first.shape and v.dtype == first.dtype and v.device == first.device for v in value)


def _is_per_example_list(value: Any) -> bool:
    """A column given as a list of per-example values (not as one tensor or array)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _is_row_dicts(rows: Any) -> bool:
    """Whether ``rows`` is a list of per-example dicts (not a dict of columns)."""
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
        return False
    return not rows or isinstance(rows[0], Mapping)


def index_array(indices: Sequence[int]) -> np.ndarray:
    """The ``index`` column's values (a contiguous plan's ``range`` without iterating it in Python)."""
    if type(indices) is range:
        return np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
    return np.asarray(indices, dtype=np.int64)


def rows_to_table(
    rows: Any, indices: Sequence[int], copies: DeviceCopies | None = None, ragged: set[str] | None = None
) -> pa.Table:
    """The rows of one ``context.write(rows)`` call as a table, with the ``index`` column first.

    Args:
        rows: a dict of columns (one value per example along the first dimension) or a list of per-example dicts.
        indices: the dataset indices of the batch's examples (``context.batch_indices``).
        copies: copies CUDA tensors asynchronously (see :mod:`torch_batch_process.outputs.copyback`); the caller
            waits for them (``copies.done().wait()``) before reading the table's values. ``None``: ``.cpu()``.
        ragged: if given, receives the names of the columns given as lists of per-example values, whose
            per-example shapes may differ between batches (see :mod:`torch_batch_process.jobstore.schema`).
    """
    pa = require_pyarrow()
    n = len(indices)
    if type(rows) is not dict and _is_row_dicts(rows):
        if len(rows) != n:
            raise InvalidArgumentError(f"context.write(): {len(rows)} row dicts for the batch's {n} example(s)")
        keys = list(rows[0]) if rows else []
        for row in rows:
            if not isinstance(row, Mapping) or list(row) != keys:
                raise InvalidArgumentError(
                    f"context.write(): every row dict must have the same keys in the same order, {keys}"
                )
        rows = {key: [row[key] for row in rows] for key in keys}
    if not isinstance(rows, Mapping) or not rows:
        raise InvalidArgumentError(
            "context.write(rows): rows must be a non-empty dict of columns (tensors, numpy arrays or lists, one value "
            f"per example) or a list of per-example dicts, got {type(rows).__name__}"
        )
    for key in rows:
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(
                f"context.write(): column names must be non-empty str, got {key!r}; name the column, e.g. "
                f"{{'score': ...}} (readers such as pandas, DuckDB and the table formats need str names)"
            )
    names = list(rows)
    if INDEX_COLUMN in names:
        raise InvalidArgumentError(
            f"context.write(): the column name {INDEX_COLUMN!r} is reserved (the library adds each example's dataset "
            "index under it); rename your column"
        )
    if ragged is not None:
        ragged.update(name for name, value in zip(names, rows.values(), strict=True) if _is_per_example_list(value))
    arrays = [_from_numpy(pa, index_array(indices))]
    arrays += [_column(pa, name, value, n, copies) for name, value in zip(names, rows.values(), strict=True)]
    return pa.Table.from_arrays(arrays, names=[INDEX_COLUMN, *names])


def column_to_numpy(column: Any) -> np.ndarray:
    """A stored numeric column as a numpy array of shape ``(N, d1, ..., dk)`` (nested fixed-size lists give the
    trailing dimensions). Raises ``ValueError`` for columns of another kind (see :func:`column_to_python`)."""
    pa = require_pyarrow()
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    shape = [len(array)]
    while pa.types.is_fixed_size_list(array.type):
        shape.append(array.type.list_size)
        array = array.flatten()
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type)):
        raise ValueError(f"a column of type {column.type} is not a numeric array")
    return array.to_numpy(zero_copy_only=False).reshape(shape)


def column_to_python(column: Any) -> Any:
    """A stored column as a numpy array when it is numeric with a fixed shape per example, else a list."""
    try:
        return column_to_numpy(column)
    except ValueError:
        return column.to_pylist()
