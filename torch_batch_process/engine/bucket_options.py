"""The options of length-aware batching (DESIGN §9) as the user gives them, checked before any work.

``bucket_by`` (one length per example, or a callable ``index -> length``), ``bucket_window`` and
``max_tokens`` are checked for type and range when the call starts; the lengths become one validated
int64 array (:func:`resolve_lengths`) that :mod:`~torch_batch_process.engine.bucketing` plans from.
Every error names the argument and the fix.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from torch_batch_process.errors import InvalidArgumentError

__all__ = [
    "AUTO",
    "DEFAULT_BUCKET_WINDOW",
    "LengthsSource",
    "check_lengths",
    "planned_max_tokens",
    "resolve_lengths",
    "validate_bucket_options",
]

DEFAULT_BUCKET_WINDOW = 100
"""Default ``bucket_window``: the examples of 100 batches are sorted together."""

AUTO = "auto"
"""``max_tokens="auto"``: the budget is learned from out-of-memory errors (DESIGN §15); planned as ``None``."""


def planned_max_tokens(max_tokens: int | str | None) -> int | None:
    """The ``max_tokens`` a plan is cut with: ``"auto"`` plans as ``None`` (batches of ``batch_size``), so the
    plan and the job's fingerprint do not depend on what is learned."""
    return None if max_tokens == AUTO else max_tokens  # type: ignore[return-value]

LengthsSource = Sequence[int] | np.ndarray | Callable[[int], int]
"""What ``bucket_by`` accepts: one length per example, or a callable ``index -> length``."""


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def validate_bucket_options(bucket_by: Any, bucket_window: Any, max_tokens: Any, batch_size: Any) -> None:
    """Checks the options of §9 before any work: types, ranges, and that ``max_tokens`` and a ``bucket_window``
    other than the default come with ``bucket_by`` (the default, given or not, is no request).

    The lengths themselves are checked by :func:`resolve_lengths` (it needs the dataset length).

    Raises:
        InvalidArgumentError: naming the argument and the fix.
    """
    if not _is_int(batch_size) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not _is_int(bucket_window) or bucket_window < 1:
        raise InvalidArgumentError(
            f"bucket_window must be an int >= 1 (how many batches' worth of consecutive examples are sorted "
            f"by length together; default {DEFAULT_BUCKET_WINDOW}), got {bucket_window!r}"
        )
    if max_tokens is not None and max_tokens != AUTO and (not _is_int(max_tokens) or max_tokens < 1):
        raise InvalidArgumentError(
            f"max_tokens must be None, an int >= 1 (the most len(batch) * max(length in batch) a batch may "
            f"hold) or 'auto' (the job finds it from out-of-memory errors), got {max_tokens!r}"
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
        return
    if isinstance(bucket_by, (str, bytes, Mapping, set, frozenset)) or not hasattr(bucket_by, "__len__"):
        raise InvalidArgumentError(
            f"bucket_by must be a sequence of ints (one length per example: a list, a numpy array...) or a "
            f"callable index -> int, got {type(bucket_by).__name__}; materialise an iterator with list(...)"
        )


def check_lengths(values: np.ndarray, dataset_length: int) -> np.ndarray:
    """Checks a 1-D array of lengths (``bucket_by``, one per example) and returns it as contiguous int64."""
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
        return converted
    if values.dtype.kind not in "iu":
        first = values[0] if len(values) else None
        raise InvalidArgumentError(
            f"bucket_by must hold ints, got dtype {values.dtype} (first value {first!r}; a missing value also "
            f"makes floats); convert it, e.g. numpy.asarray(lengths, dtype=numpy.int64)"
        )
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    if values.dtype.kind == "u" and values.max() > np.iinfo(np.int64).max:
        i = int(np.argmax(values > np.iinfo(np.int64).max))
        raise InvalidArgumentError(f"bucket_by holds a length too large for int64 at index {i}: {values[i]}")
    if values.dtype.kind == "i" and values.min() < 0:
        i = int(np.argmax(values < 0))
        raise InvalidArgumentError(f"bucket_by must hold ints >= 0, got {values[i]} at index {i}")
    return np.ascontiguousarray(values, dtype=np.int64)


def _call_lengths(length_of: Callable[[int], int], dataset_length: int) -> np.ndarray:
    """``length_of(i)`` for every index; the values are checked together once all are in (fast path)."""
    values: list[Any] = []
    append = values.append
    index = 0
    try:
        for index in range(dataset_length):
            append(length_of(index))
    except Exception as error:
        if hasattr(error, "add_note"):  # Python 3.11+: tell which example the user's callable failed on
            error.add_note(f"raised by bucket_by({index}) while computing the length of example {index}")
        raise
    if all(type(value) is int for value in values):  # the common case: plain Python ints
        try:
            array = np.asarray(values, dtype=np.int64)
        except OverflowError:
            array = None
        if array is not None and (len(array) == 0 or array.min() >= 0):
            return array
    for i, value in enumerate(values):  # something is off: find and name the first bad value
        values[i] = _length(value, f"bucket_by({i}) must return an int", "")
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
    """The length of every example as a validated int64 array of ``dataset_length`` entries.

    Args:
        bucket_by: a sequence of ints (a list, tuple, numpy array, CPU tensor, pyarrow array...), one per
            example in dataset order, or a callable ``index -> int`` (called once per example, in order:
            about a microsecond each plus the callable's own cost, so prefer a precomputed sequence for
            tens of millions of examples; see :mod:`torch_batch_process.lengths`).
        dataset_length: number of examples of the dataset.

    Raises:
        InvalidArgumentError: naming ``bucket_by`` (wrong type, length, or a value that is not an int >= 0).
    """
    validate_bucket_options(bucket_by, DEFAULT_BUCKET_WINDOW, None, 1)
    if bucket_by is None:
        raise InvalidArgumentError("bucket_by is None: there are no lengths to resolve")
    if callable(bucket_by):
        return _call_lengths(bucket_by, dataset_length)
    try:
        array = np.asarray(bucket_by)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(
            f"bucket_by must be a sequence of ints, one per example; it could not be read as an array: {error}"
        ) from error
    return check_lengths(array, dataset_length)
