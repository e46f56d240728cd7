"""Length-aware batching (DESIGN §9): a deterministic plan of batches of examples of similar length.

Text and audio batches are padded to their longest example, so with uneven lengths most of the
compute of a batch in dataset order goes into padding. Given the length of every example
(``bucket_by``), this module cuts the dataset into batches of similar length:

1. **Windows.** The dataset indices are cut into windows of ``bucket_window * batch_size``
   consecutive indices (the last window may be shorter). A batch never mixes two windows, so an
   example stays near its place in the dataset: the plan streams through the dataset in order,
   window after window, and a window bounds how far apart the examples of a batch can be.
2. **Sort.** Inside a window the examples are sorted by length, longest first. The sort is stable
   (equal lengths keep their dataset order), so the same lengths always give the same plan, in
   every process and on every machine.
3. **Cut.** The sorted window is cut into batches: ``batch_size`` examples each (the last batch of
   the last window may be shorter), or, with ``max_tokens``, greedily from the longest example: a
   batch takes as many examples (at most ``batch_size``) as keep
   ``len(batch) * max(length in batch) <= max_tokens``. An example longer than ``max_tokens`` cannot
   meet that in any batch: it gets a batch of its own (one example, the smallest batch that can hold
   it) and is counted in :attr:`BucketLayout.num_oversized`. An example of length 0 costs no tokens.
4. **Order.** Inside a window the batches run largest first (by tokens: ``len(batch) * max length``),
   so a batch that runs out of memory does so at the start of the window, not at its end. In addition
   the single largest batch of the whole plan (the first one in plan order when several tie) is moved
   to position 0, so the worst case of the whole job shows in its very first batch, not hours in.

The options and the lengths are checked before, by :mod:`~torch_batch_process.engine.bucket_options`.
The plan only depends on the lengths, ``batch_size``, ``bucket_window`` and ``max_tokens`` (see
:func:`layout_fingerprint`), never on the world size, so a resume with another number of ranks
computes the same batches. Everything is vectorised with numpy (sorts of 8- or 16-bit keys are radix
sorts; wider lengths take one radix pass per 16 bits): 10 million token lengths plan in 0.4-1.3 s on
one CPU core, lengths of up to a million (audio samples) in 0.5-2.5 s. The greedy cut under
``max_tokens`` loops in Python once per run of equal batch sizes inside a window (a few per window),
never once per example; its worst case, ``bucket_window=1`` with widely spread lengths, takes a few
seconds for 10 million examples.

**Memory** (DESIGN §14): the windows are planned a few million examples at a time (:data:`CHUNK_EXAMPLES`,
rounded to whole windows), so the sorts' temporary arrays stay a few tens of MiB whatever the dataset's size,
and the plan keeps one index per example in the narrowest type that holds it (``uint32`` below 2**32
examples) plus one offset per batch: about 4 bytes per example kept, and some 50 MiB of temporaries. The lengths
are used as given when they are a valid numpy array (no copy; see
:func:`~torch_batch_process.engine.bucket_options.as_lengths`). A window larger than a chunk (a huge
``bucket_window``, e.g. one window for the whole job) is sorted at once, with temporaries of ~40 bytes per
example of the window. Chunking changes nothing in the result: a batch never crosses a window.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torch_batch_process.engine.bucket_options import as_lengths, validate_bucket_options

__all__ = [
    "BucketLayout",
    "CHUNK_EXAMPLES",
    "LAYOUT_VERSION",
    "bucket_layout",
    "contiguous_padded_tokens",
    "layout_fingerprint",
]

LAYOUT_VERSION = 1
"""Version of the planning rules above; part of the fingerprint, so a change of rules refuses a resume."""

CHUNK_EXAMPLES = 1 << 20
"""Examples planned at a time (rounded to whole windows): bounds the temporary arrays of the sorts."""

_HASH_CHUNK = 1 << 21
"""Lengths converted to int64 at a time for the fingerprint's hash."""


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class BucketLayout:
    """The batches of a length-bucketed plan.

    Attributes:
        order: permutation of the dataset indices ``[0, N)``, the examples in plan order (``uint32`` below
            2**32 examples, else ``int64``).
        offsets: int64, ``num_batches + 1`` entries: batch ``g`` holds ``order[offsets[g]:offsets[g+1]]``.
        num_oversized: number of examples longer than ``max_tokens``, each alone in its batch (0
            without ``max_tokens``).
    """

    order: np.ndarray
    offsets: np.ndarray
    num_oversized: int = 0

    def __post_init__(self) -> None:
        # The arrays are shared by every reader of the plan: make accidental writes fail loudly.
        _readonly(self.order)
        _readonly(self.offsets)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BucketLayout):
            return NotImplemented
        return (
            self.num_oversized == other.num_oversized
            and np.array_equal(self.order, other.order)
            and np.array_equal(self.offsets, other.offsets)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-looking arrays inside: compare, do not hash

    def batch_indices(self, g: int) -> np.ndarray:
        """Dataset indices of batch ``g``, in batch order (longest example first)."""
        if not 0 <= g < self.num_batches():
            raise IndexError(f"batch {g} is out of range: the plan has {self.num_batches()} batches")
        return self.order[self.offsets[g] : self.offsets[g + 1]]

    def num_batches(self) -> int:
        """Number of batches in the plan."""
        return len(self.offsets) - 1

    def batch_sizes(self) -> np.ndarray:
        """Number of examples of each batch, in plan order."""
        return np.diff(self.offsets)

    def padded_tokens(self, lengths: Sequence[int] | np.ndarray) -> int:
        """Tokens the batches take once padded: the sum over batches of ``len(batch) * max length in batch``.

        Computed a chunk of batches at a time (no array of the dataset's size is made)."""
        values = np.asarray(lengths)
        if len(values) != len(self.order):
            raise ValueError(f"padded_tokens needs one length per example ({len(self.order)}), got {len(values)}")
        if len(self.order) == 0:
            return 0
        if values.dtype.kind not in "iu":
            values = values.astype(np.int64)
        sizes = self.batch_sizes()
        step = max(1, CHUNK_EXAMPLES // max(1, int(sizes.max())))
        total = 0
        for g0 in range(0, len(sizes), step):
            g1 = min(len(sizes), g0 + step)
            first, stop = int(self.offsets[g0]), int(self.offsets[g1])
            longest = np.maximum.reduceat(values[self.order[first:stop]], self.offsets[g0:g1] - first)
            total += int(np.dot(sizes[g0:g1], longest.astype(np.int64)))
        return total


def contiguous_padded_tokens(lengths: Sequence[int] | np.ndarray, batch_size: int) -> int:
    """Padded tokens of the plain plan (§3: batch ``g`` holds ``[g*B, (g+1)*B)``), to compare with a layout."""
    values = np.asarray(lengths)
    if values.dtype.kind not in "iu":
        values = values.astype(np.int64)
    n = len(values)
    step = max(1, CHUNK_EXAMPLES // batch_size) * batch_size  # whole batches per chunk
    total = 0
    for c0 in range(0, n, step):
        part = values[c0 : min(n, c0 + step)]
        starts = np.arange(0, len(part), batch_size)
        sizes = np.diff(np.append(starts, len(part)))
        total += int(np.dot(sizes, np.maximum.reduceat(part, starts).astype(np.int64)))
    return total


# ------------------------------------------------------------------------------------------- planning


def _stable_argsort_rows(key: np.ndarray, maximum: int) -> np.ndarray:
    """Stable argsort of each row of ``key`` (non-negative ints, at most ``maximum``).

    numpy's stable sort is a radix sort for 8- and 16-bit ints (tens of times faster than its merge
    sort for wider ones), so wider keys are sorted by 16-bit digits, least significant first: each
    pass is stable, so ties left by a higher digit keep the order of the lower ones.
    """
    if maximum <= np.iinfo(np.uint16).max:
        dtype = np.uint8 if maximum <= np.iinfo(np.uint8).max else np.uint16
        return np.argsort(key.astype(dtype), axis=-1, kind="stable")
    order = None
    for shift in range(0, maximum.bit_length(), 16):
        digit = ((key >> shift) & 0xFFFF).astype(np.uint16)
        if order is not None:
            digit = np.take_along_axis(digit, order, axis=-1)
        step = np.argsort(digit, axis=-1, kind="stable")
        order = step if order is None else np.take_along_axis(order, step, axis=-1)
    assert order is not None
    return order


def _sort_windows(lengths: np.ndarray, window_examples: int) -> np.ndarray:
    """Dataset indices sorted by length, longest first, inside each window; stable (ties keep dataset order)."""
    n = len(lengths)
    longest = int(lengths.max())
    key = longest - lengths  # ascending key = descending length
    full = (n // window_examples) * window_examples
    parts = []
    if full:
        rows = _stable_argsort_rows(key[:full].reshape(-1, window_examples), longest)
        rows += (np.arange(full // window_examples, dtype=rows.dtype) * window_examples)[:, None]
        parts.append(rows.reshape(-1))
    if full < n:
        parts.append(_stable_argsort_rows(key[full:], longest) + full)
    return np.concatenate(parts).astype(np.int64, copy=False)


def _greedy_starts(sorted_lengths: np.ndarray, batch_size: int, window_examples: int, max_tokens: int) -> np.ndarray:
    """Batch starts (positions in the sorted order) of the greedy cut under ``max_tokens``.

    In a window sorted longest first, a batch starting at position ``p`` has its longest example at
    ``p``, so it holds ``size[p] = min(batch_size, max_tokens // length[p])`` examples (at least 1),
    fewer if the window ends first. ``size`` only grows along a window, so the positions cut into runs
    of equal size; the chain of batch starts crosses each run in one arithmetic step (a Python loop
    over runs, vectorised expansion afterwards).
    """
    n = len(sorted_lengths)
    size = np.where(
        sorted_lengths == 0,
        batch_size,
        np.clip(max_tokens // np.maximum(sorted_lengths, 1), 1, batch_size),
    )
    new_run = np.empty(n, dtype=bool)
    new_run[0] = True
    new_run[1:] = size[1:] != size[:-1]
    new_run[::window_examples] = True
    run_start = np.flatnonzero(new_run)
    run_stop = np.append(run_start[1:], n)
    run_size = size[run_start]
    run_window_end = np.minimum((run_start // window_examples + 1) * window_examples, n)

    first: list[int] = []
    step: list[int] = []
    count: list[int] = []
    position = 0
    for stop, width, window_end in zip(run_stop.tolist(), run_size.tolist(), run_window_end.tolist(), strict=True):
        if position >= stop:  # a batch of an earlier run already covers this whole run
            continue
        batches = -(-(stop - position) // width)
        first.append(position)
        step.append(width)
        count.append(batches)
        position = min(position + batches * width, window_end)  # the window's last batch may be cut short
    counts = np.asarray(count, dtype=np.int64)
    group_offsets = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(group_offsets, counts)
    return (
        np.repeat(np.asarray(first, dtype=np.int64), counts)
        + np.repeat(np.asarray(step, dtype=np.int64), counts) * within
    )


def _largest_first_in_windows(tokens: np.ndarray, window_of_batch: np.ndarray) -> np.ndarray:
    """Batch permutation: windows in order, largest batch first inside each (stable: ties keep their order)."""
    most = int(tokens.max())
    if (int(window_of_batch[-1]) + 1) * (most + 1) < np.iinfo(np.int64).max:
        return np.argsort(window_of_batch * (most + 1) + (most - tokens), kind="stable")
    return np.lexsort((most - tokens, window_of_batch))  # keys would overflow int64: two keys (slower, same result)


def _plan_chunk(
    lengths: np.ndarray, batch_size: int, window_examples: int, max_tokens: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plans whole windows (``lengths`` starts at a window's start): their batches in plan order, before the
    plan's largest batch moves to the front. Returns the batch sizes, their tokens and the examples in
    plan order (int64, positions in ``lengths``)."""
    n = len(lengths)
    sorted_indices = _sort_windows(lengths, window_examples)
    sorted_lengths = lengths[sorted_indices]
    if max_tokens is None:
        # Windows start at multiples of batch_size, so cutting every batch_size examples never crosses one.
        starts = np.arange(0, n, batch_size, dtype=np.int64)
    else:
        starts = _greedy_starts(sorted_lengths.astype(np.int64), batch_size, window_examples, max_tokens)
    sizes = np.diff(np.append(starts, n))
    tokens = sizes * sorted_lengths[starts].astype(np.int64)  # the first example of a batch is its longest
    permutation = _largest_first_in_windows(tokens, starts // window_examples)
    new_sizes = sizes[permutation]
    new_starts = np.cumsum(new_sizes) - new_sizes
    source = np.repeat(starts[permutation] - new_starts, new_sizes)
    source += np.arange(n, dtype=np.int64)
    return new_sizes, tokens[permutation], sorted_indices[source]


def _rotate_right(array: np.ndarray, stop: int, shift: int) -> None:
    """Moves ``array[stop - shift:stop]`` to the front of ``array[:stop]``, in place, in blocks (no copy of the
    array: the temporary arrays are at most :data:`CHUNK_EXAMPLES` long)."""
    moved = array[stop - shift : stop].copy()
    position = stop - shift  # elements [0, position) move right by shift, the last ones first
    while position > 0:
        first = max(0, position - CHUNK_EXAMPLES)
        array[first + shift : position + shift] = array[first:position]
        position = first
    array[:shift] = moved


def bucket_layout(lengths: Any, batch_size: int, window: int, max_tokens: int | None) -> BucketLayout:
    """Plans the batches of §9 (see the module docstring for the rules).

    Args:
        lengths: the length of each example: an integer numpy array (as returned by
            :func:`~torch_batch_process.engine.bucket_options.resolve_lengths`), or anything
            :func:`~torch_batch_process.engine.bucket_options.as_lengths` takes.
        batch_size: most examples per batch (exactly this many without ``max_tokens``, except the last).
        window: ``bucket_window``: the examples of ``window * batch_size`` consecutive indices are sorted together.
        max_tokens: if set, a batch holds at most ``max_tokens`` padded tokens (``len * max length``),
            except an example longer than that, which is alone in its batch.

    Returns:
        The layout; the same inputs give identical arrays in every process, whatever their integer type.
    """
    validate_bucket_options(lengths, window, max_tokens, batch_size)
    lengths = as_lengths(lengths, len(lengths))
    n = len(lengths)
    index_type = np.uint32 if n <= np.iinfo(np.uint32).max else np.int64
    if n == 0:
        return BucketLayout(order=np.zeros(0, dtype=index_type), offsets=np.zeros(1, dtype=np.int64))
    window_examples = window * batch_size
    chunk = max(1, CHUNK_EXAMPLES // window_examples) * window_examples
    order = np.empty(n, dtype=index_type)
    sizes_parts, tokens_parts = [], []
    oversized = 0
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        sizes, tokens, local = _plan_chunk(lengths[c0:c1], batch_size, window_examples, max_tokens)
        local += c0
        order[c0:c1] = local
        sizes_parts.append(sizes)
        tokens_parts.append(tokens)
        del local
        if max_tokens is not None:
            oversized += int(np.count_nonzero(lengths[c0:c1].astype(np.int64) > max_tokens))
    sizes = np.concatenate(sizes_parts)
    top = int(np.argmax(np.concatenate(tokens_parts)))  # the first of the largest batches, in plan order
    if top:  # the plan's largest batch goes first
        stop = int(sizes[: top + 1].sum())
        _rotate_right(order, stop, int(sizes[top]))
        sizes = np.concatenate(([sizes[top]], sizes[:top], sizes[top + 1 :]))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return BucketLayout(order=order, offsets=offsets, num_oversized=oversized)


def layout_fingerprint(lengths: Any, batch_size: int, window: int, max_tokens: int | None) -> dict[str, Any]:
    """What determines the plan, as JSON-able values, for the job's fingerprint (§3 resume safety).

    The lengths enter as the sha256 of their little-endian int64 bytes, so a list, a numpy array of any integer
    type and an Arrow array of the same values match, and a resume with any other length is refused. The bytes
    are made a chunk at a time (no int64 copy of the lengths).
    """
    values = as_lengths(lengths, len(lengths))
    digest = hashlib.sha256()
    for c0 in range(0, len(values), _HASH_CHUNK):
        digest.update(np.ascontiguousarray(values[c0 : c0 + _HASH_CHUNK], dtype="<i8").tobytes())
    return {
        "plan": "bucketed",
        "version": LAYOUT_VERSION,
        "num_examples": int(len(values)),
        "batch_size": int(batch_size),
        "bucket_window": int(window),
        "max_tokens": None if max_tokens is None else int(max_tokens),
        "lengths_sha256": digest.hexdigest(),
    }
