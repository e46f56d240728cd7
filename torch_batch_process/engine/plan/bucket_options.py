"""The options of length-aware batching (DESIGN §9) as the user gives them, checked before any work.

``bucket_by`` (one length per example, or a callable ``index -> length``), ``bucket_window`` and
``max_tokens`` are checked for type and range when the call starts; the lengths become one validated
integer array (:func:`resolve_lengths`) that :mod:`~torch_batch_process.engine.plan.bucketing` plans from.
Every error names the argument and the fix.

At 10^8 examples the lengths' memory matters (DESIGN §14): a list of 10^8 Python ints takes over 3 GB before
the plan starts, while a numpy array or an Arrow array of int32 takes 400 MB. So a valid numpy array is used as
it is (no copy), an Arrow array (``pyarrow.Array``, e.g. ``pyarrow.compute.utf8_length`` of a text column) is
read without copying its values, a ``ChunkedArray``'s chunks are joined once, and whatever must be copied is
stored in the narrowest unsigned type that holds it (``uint8``, ``uint16``, ``uint32``, else ``int64``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from torch_batch_process.arguments import DEFAULT_BUCKET_WINDOW
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.integers import is_integer

__all__ = [
    "AUTO",
    "DEFAULT_BUCKET_WINDOW",
    "LengthsSource",
    "as_lengths",
    "check_lengths",
    "planned_max_tokens",
    "resolve_lengths",
    "validate_bucket_options",
]

AUTO = "auto"
"""``max_tokens="auto"``: the budget is learned from out-of-memory errors (DESIGN §15); planned as ``None``."""


def planned_max_tokens(max_tokens: int | str | None) -> int | None:
    """The ``max_tokens`` a plan is cut with: ``"auto"`` plans as ``None`` (batches of ``batch_size``), so the
    plan and the job's fingerprint do not depend on what is learned."""
    return None if max_tokens == AUTO else max_tokens  # type: ignore[return-value]


LengthsSource = Sequence[int] | np.ndarray | Callable[[int], int] | Any
"""What ``bucket_by`` accepts: one length per example (a list, a numpy array, a CPU tensor, a ``pyarrow.Array`` or
``ChunkedArray``...), or a callable ``index -> length``."""

_INT64_MAX = (1 << 63) - 1

_CALL_CHUNK = 1 << 20
"""Lengths a callable ``bucket_by`` gives that are checked and stored at a time."""


def validate_bucket_options(bucket_by: Any, bucket_window: Any, max_tokens: Any, batch_size: Any) -> None:
    """Checks the options of §9 before any work: types, ranges, and that ``max_tokens`` and a ``bucket_window``
    other than the default come with ``bucket_by`` (the default, given or not, is no request).

    The lengths themselves are checked by :func:`resolve_lengths` (it needs the dataset length).

    Raises:
        InvalidArgumentError: naming the argument and the fix.
    """
    if not is_integer(batch_size) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not is_integer(bucket_window) or bucket_window < 1:
        raise InvalidArgumentError(
            f"bucket_window must be an int >= 1 (how many batches' worth of consecutive examples are sorted "
            f"by length together; default {DEFAULT_BUCKET_WINDOW}), got {bucket_window!r}"
        )
    if max_tokens is not None and max_tokens != AUTO and (not is_integer(max_tokens) or max_tokens < 1):
        raise InvalidArgumentError(
            f"max_tokens must be None, an int >= 1 (the most len(batch) * max(length in batch) a batch may "
            f"hold) or 'auto' (the job finds it from out-of-memory errors), got {max_tokens!r}"
        )
    for name, value in (("max_tokens", max_tokens), ("bucket_window", bucket_window)):
        if is_integer(value) and value > _INT64_MAX:
            raise InvalidArgumentError(
                f"{name}={value} is beyond what the plan computes with (int64, at most 2**63 - 1); pass a smaller one"
                + (" or None for no token budget" if name == "max_tokens" else "")
            )
    if bucket_by is None:
        if max_tokens is not None:
            raise InvalidArgumentError(
                f"max_tokens needs bucket_by (got max_tokens={max_tokens!r}): batches are cut by token count only "
                "when the library knows each example's length; pass bucket_by=<one length per example> (see "
                "torch_batch_process.lengths) or drop max_tokens (on_oom='split', the default, still runs a batch "
                "that does not fit in parts)"
            )
        if bucket_window != DEFAULT_BUCKET_WINDOW:
            raise InvalidArgumentError(
                f"bucket_window={bucket_window} needs bucket_by: only batches planned by example length are sorted "
                "in windows; pass bucket_by=<one length per example> (see torch_batch_process.lengths) or drop "
                "bucket_window"
            )
        return
    if callable(bucket_by):
        _check_callable(bucket_by)
        return
    if isinstance(bucket_by, (str, bytes, Mapping, set, frozenset)) or not hasattr(bucket_by, "__len__"):
        raise InvalidArgumentError(
            f"bucket_by must be a sequence of ints (one length per example: a list, a numpy array...) or a "
            f"callable index -> int, got {type(bucket_by).__name__}; materialise an iterator with list(...)"
        )


def _check_callable(length_of: Callable[[int], int]) -> None:
    """Raises InvalidArgumentError when a callable ``bucket_by`` cannot be called with one index (its lengths are
    computed when the call starts, for every example: a wrong signature would fail there with a bare TypeError)."""
    import inspect

    try:
        signature = inspect.signature(length_of)
    except (TypeError, ValueError):  # a builtin or a ufunc: nothing to check
        return
    try:
        signature.bind(0)
    except TypeError as exc:
        raise InvalidArgumentError(
            f"bucket_by must be a callable index -> length (called as bucket_by(i) for every example), but its signature "
            f"is {signature}: {exc}"
        ) from exc


def _narrowest_type(largest: int) -> type[np.integer]:
    """The narrowest of uint8, uint16, uint32 and int64 that holds non-negative ints up to ``largest``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if largest <= np.iinfo(dtype).max:
            return dtype
    return np.int64


def _narrowest(values: np.ndarray) -> np.ndarray:
    """Non-negative ints (checked) in the narrowest of uint8, uint16, uint32 and int64 that holds them (a copy)."""
    return values.astype(_narrowest_type(int(values.max()) if len(values) else 0))


def check_lengths(values: np.ndarray, dataset_length: int) -> np.ndarray:
    """Checks a 1-D array of lengths (``bucket_by``, one per example) and returns it as a contiguous integer array:
    ``values`` itself when it is one already (signed or unsigned, 8 to 64 bits, but no ``uint64``), else a copy in the
    narrowest unsigned type that holds it."""
    if values.ndim != 1:
        raise InvalidArgumentError(
            f"bucket_by must be one length per example (1-D), got an array of shape {values.shape}"
        )
    if len(values) != dataset_length:
        raise InvalidArgumentError(
            f"bucket_by has {len(values)} lengths but the dataset has {dataset_length} examples; pass exactly one "
            f"length per example, in dataset order"
        )
    if values.dtype.kind == "O":
        converted = np.empty(len(values), dtype=np.int64)
        for i, value in enumerate(values):  # only for object arrays (mixed or exotic element types)
            converted[i] = _length(value, "bucket_by must hold ints", f" at index {i}")
        return _narrowest(converted)
    if values.dtype.kind not in "iu":
        first = values[0] if len(values) else None
        raise InvalidArgumentError(
            f"bucket_by must hold ints, got dtype {values.dtype} (first value {first!r}; a missing value also "
            f"makes floats); convert it, e.g. numpy.asarray(lengths, dtype=numpy.int64)"
        )
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    if values.dtype.kind == "u" and values.dtype.itemsize == 8 and values.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(values > np.iinfo(np.int64).max))
        raise InvalidArgumentError(f"bucket_by holds a length too large for int64 at index {i}: {values[i]}")
    if values.dtype.kind == "i" and values.min() < 0:
        i = int(np.argmax(values < 0))
        raise InvalidArgumentError(f"bucket_by must hold ints >= 0, got {values[i]} at index {i}")
    if values.dtype.byteorder == ">" or (values.dtype.kind == "u" and values.dtype.itemsize == 8):
        return _narrowest(values)  # arithmetic on them would not stay in int64
    if not values.flags.c_contiguous:
        return np.ascontiguousarray(values)
    return values


def _is_arrow(value: Any) -> bool:
    """Whether ``value`` is a ``pyarrow.Array`` or ``ChunkedArray`` (without importing pyarrow)."""
    return type(value).__module__.split(".")[0] == "pyarrow" and hasattr(value, "null_count") and hasattr(value, "type")


def _arrow_lengths(values: Any, dataset_length: int) -> np.ndarray:
    """The lengths of an Arrow integer array or chunked array, read without copying its values (chunks joined)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_integer(values.type):
        raise InvalidArgumentError(
            f"bucket_by must hold ints, got an Arrow array of type {values.type}; cast it, e.g. "
            f"pyarrow.compute.cast(lengths, pyarrow.int64())"
        )
    if len(values) != dataset_length:
        raise InvalidArgumentError(
            f"bucket_by has {len(values)} lengths but the dataset has {dataset_length} examples; pass exactly one "
            f"length per example, in dataset order"
        )
    if values.null_count:
        i = int(pc.index(pc.is_null(values), True).as_py())
        raise InvalidArgumentError(
            f"bucket_by holds a null at index {i}; give every example a length, e.g. "
            f"pyarrow.compute.fill_null(lengths, 0)"
        )
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    if len(chunks) == 1:
        return check_lengths(chunks[0].to_numpy(zero_copy_only=False), dataset_length)  # a view of Arrow's buffer
    # Several chunks (a Hugging Face column has one per write batch): joined once, chunk by chunk, into the
    # narrowest type that holds them (uint16 for token counts: half of Arrow's int32, and no int32 copy first).
    smallest, largest = (pc.min_max(values)[key].as_py() for key in ("min", "max"))
    if smallest is not None and smallest < 0:
        return check_lengths(values.to_numpy(), dataset_length)  # names the first negative length
    joined = np.empty(len(values), dtype=_narrowest_type(largest or 0))
    position = 0
    for chunk in chunks:
        joined[position : position + len(chunk)] = chunk.to_numpy(zero_copy_only=False)
        position += len(chunk)
    return check_lengths(joined, dataset_length)


def as_lengths(values: Any, dataset_length: int) -> np.ndarray:
    """``bucket_by`` given as a sequence, as a validated 1-D integer numpy array with as few copies as possible (see
    the module docstring): a numpy array, an Arrow array or chunked array, a CPU tensor, a list or tuple."""
    if isinstance(values, np.ndarray):
        return check_lengths(values, dataset_length)
    if _is_arrow(values):
        return _arrow_lengths(values, dataset_length)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(
            f"bucket_by must be a sequence of ints, one per example; it could not be read as an array: {error}"
        ) from error
    checked = check_lengths(array, dataset_length)
    if isinstance(values, (list, tuple)) and checked is array:  # a new int64 array: keep the narrowest copy instead
        return _narrowest(checked)
    return checked


def _call_lengths(length_of: Callable[[int], int], dataset_length: int) -> np.ndarray:
    """``length_of(i)`` for every index, checked and stored a chunk at a time (the fast path: plain ints)."""
    result = np.empty(dataset_length, dtype=np.int64)
    index = 0
    try:
        for first in range(0, dataset_length, _CALL_CHUNK):
            values: list[Any] = []
            append = values.append
            for index in range(first, min(dataset_length, first + _CALL_CHUNK)):
                append(length_of(index))
            result[first : first + len(values)] = _checked_calls(values, first)
    except InvalidArgumentError:
        raise
    except Exception as error:
        if hasattr(error, "add_note"):  # Python 3.11+: tell which example the user's callable failed on
            error.add_note(f"raised by bucket_by({index}) while computing the length of example {index}")
        raise
    return _narrowest(result)


def _checked_calls(values: list[Any], first: int) -> np.ndarray:
    """The values a callable ``bucket_by`` returned for indices ``first, first + 1, ...``, as int64, checked."""
    if all(type(value) is int for value in values):  # the common case: plain Python ints
        try:
            array = np.asarray(values, dtype=np.int64)
        except OverflowError:
            array = None
        if array is not None and (len(array) == 0 or array.min() >= 0):
            return array
    for i, value in enumerate(values):  # something is off: find and name the first bad value
        values[i] = _length(value, f"bucket_by({first + i}) must return an int", "")
    return np.asarray(values, dtype=np.int64)


def _length(value: Any, rule: str, where: str) -> int:
    """``value`` as a length (an int in [0, 2**63), not a bool); else an error saying ``rule`` (what the user's
    values must be) and ``where`` the value was."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"{rule}, got {value!r}{where}")
    number = operator.index(value)
    if not 0 <= number <= np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{rule} in [0, 2**63), got {number}{where}")
    return number


def resolve_lengths(bucket_by: LengthsSource, dataset_length: int) -> np.ndarray:
    """The length of every example as a validated integer array of ``dataset_length`` entries.

    Args:
        bucket_by: a sequence of ints (a numpy array, a ``pyarrow.Array`` or ``ChunkedArray``, a CPU tensor, a list,
            a tuple...), one per example in dataset order, or a callable ``index -> int`` (called once per example,
            in order: about a microsecond each plus the callable's own cost, so prefer a precomputed array for
            tens of millions of examples; see :mod:`torch_batch_process.lengths`).
        dataset_length: number of examples of the dataset.

    Returns:
        A 1-D integer numpy array: ``bucket_by`` itself when it is a valid contiguous numpy array (no copy), else a
        copy in the narrowest unsigned type that holds the lengths (see the module docstring).

    Raises:
        InvalidArgumentError: naming ``bucket_by`` (wrong type, length, or a value that is not an int >= 0).
    """
    validate_bucket_options(bucket_by, DEFAULT_BUCKET_WINDOW, None, 1)
    if bucket_by is None:
        raise InvalidArgumentError("bucket_by is None: there are no lengths to resolve")
    if callable(bucket_by):
        return _call_lengths(bucket_by, dataset_length)
    return as_lengths(bucket_by, dataset_length)
