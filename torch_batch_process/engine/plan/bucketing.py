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

The options and the lengths are checked before, by :mod:`~torch_batch_process.engine.plan.bucket_options`.
The plan only depends on the lengths, ``batch_size``, ``bucket_window`` and ``max_tokens`` (see
:func:`layout_fingerprint`), never on the world size, so a resume with another number of ranks
computes the same batches. Everything is vectorised with numpy (sorts of 8- or 16-bit keys are radix
sorts; wider lengths take one radix pass per 16 bits): 10 million token lengths plan in 0.4-1.3 s on
one CPU core, lengths of up to a million (audio samples) in 0.5-2.5 s. The greedy cut under
``max_tokens`` loops in Python once per run of equal batch sizes inside a window (a few per window),
never once per example; its worst case, ``bucket_window=1`` with widely spread lengths, takes a few
seconds for 10 million examples.

**Memory** (DESIGN §14): the windows are planned about a million examples at a time (:data:`CHUNK_EXAMPLES`,
rounded to whole windows), so the sorts' temporary arrays stay some 50 MiB whatever the dataset's size. The
layout keeps no array of the dataset's size: one offset per batch (8 bytes per batch), and it plans a chunk again
when a batch of it is first asked for (:class:`BucketLayout`). The lengths are used as given when they are a
valid numpy array (no copy; see :func:`~torch_batch_process.engine.plan.bucket_options.as_lengths`), and kept by
reference. A window larger than a chunk (a huge ``bucket_window``, e.g. one window for the whole job) is sorted
at once, with temporaries of ~40 bytes per example of the window, kept for its batches. Chunking changes nothing
in the result: a batch never crosses a window.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from torch_batch_process.engine.plan.bucket_options import as_lengths, validate_bucket_options

__all__ = [
    "BucketLayout",
    "CHUNK_EXAMPLES",
    "LAYOUT_VERSION",
    "bucket_layout",
    "contiguous_padded_tokens",
    "layout_fingerprint",
    "token_stats",
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


class BucketLayout:
    """The batches of a length-bucketed plan, made from the lengths a chunk of windows at a time.

    Only what the job needs for every batch is kept: the batch offsets (8 bytes per batch) and, per chunk of
    :data:`CHUNK_EXAMPLES` examples (whole windows), its first batch. The examples of a batch are found by
    planning its chunk again when a batch of it is first asked for (the two chunks used last are kept), so a
    rank holds no array of the dataset's size: it plans each chunk twice in all (the first pass counts the
    batches, a rank's batches walk through the chunks in order). The lengths are read again then: they must not
    change while the job runs (a chunk planned differently raises).

    Built by :func:`bucket_layout`. Attributes:
        offsets: int64, ``num_batches + 1`` entries: batch ``g`` holds ``offsets[g+1] - offsets[g]`` examples.
        num_oversized: number of examples longer than ``max_tokens``, each alone in its batch (0 without
            ``max_tokens``).
        planned_padded_tokens: padded tokens of the plan (``len(batch) * max length``, summed over batches).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        window_examples: int,
        max_tokens: int | None,
        chunk: int,
        chunk_batches: np.ndarray,
        chunk_tokens: list[int],
        top: int,
        offsets: np.ndarray,
        num_oversized: int,
    ) -> None:
        self._lengths = lengths
        self._batch_size = batch_size
        self._window_examples = window_examples
        self._max_tokens = max_tokens
        self._chunk = chunk
        self._chunk_batches = chunk_batches  # first batch (before the largest moves to the front) of each chunk
        self._chunk_tokens = chunk_tokens  # padded tokens of each chunk: a chunk planned again must match
        self._top = top  # the largest batch's index before it moved to the front
        self.offsets = _readonly(offsets)
        self.num_oversized = num_oversized
        self.planned_padded_tokens = int(sum(chunk_tokens))
        self._index_type = np.uint32 if len(lengths) <= np.iinfo(np.uint32).max else np.int64
        self._cache: collections.OrderedDict[int, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"], state["_lock"] = collections.OrderedDict(), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BucketLayout):
            return NotImplemented
        return (
            self.num_oversized == other.num_oversized
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.order, other.order)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-looking arrays inside: compare, do not hash

    def num_batches(self) -> int:
        """Number of batches in the plan."""
        return len(self.offsets) - 1

    def batch_sizes(self) -> np.ndarray:
        """Number of examples of each batch, in plan order."""
        return np.diff(self.offsets)

    def batch_indices(self, g: int) -> np.ndarray:
        """Dataset indices of batch ``g``, in batch order (longest example first); a read-only array."""
        if not 0 <= g < self.num_batches():
            raise IndexError(f"batch {g} is out of range: the plan has {self.num_batches()} batches")
        before = self._top if g == 0 else g - 1 if g <= self._top else g  # its index before the largest moved
        k = int(np.searchsorted(self._chunk_batches, before, side="right")) - 1
        order, offsets = self._chunk_plan(k)
        q = before - int(self._chunk_batches[k])
        return order[offsets[q] : offsets[q + 1]]

    @property
    def order(self) -> np.ndarray:
        """Every dataset index in plan order (a read-only array of the dataset's size, made on each access: for
        tests and tools; the job itself uses :meth:`batch_indices`)."""
        n = len(self._lengths)
        order = np.empty(n, dtype=self._index_type)
        for k in range(len(self._chunk_batches) - 1):
            c0 = k * self._chunk
            order[c0 : min(n, c0 + self._chunk)] = self._chunk_plan(k, keep=False)[0]
        if self._top:
            sizes = self.batch_sizes()
            shift = int(sizes[0])
            stop = int(self.offsets[self._top + 1])  # the batches before the largest, then the largest itself
            _rotate_right(order, stop, shift)
        return _readonly(order)

    def padded_tokens(self, lengths: Sequence[int] | np.ndarray) -> int:
        """Tokens the batches take once padded with ``lengths``: the sum over batches of ``len(batch) * max length
        in batch`` (a chunk at a time; with the planned lengths, :attr:`planned_padded_tokens` costs nothing)."""
        values = np.asarray(lengths)
        if len(values) != len(self._lengths):
            raise ValueError(f"padded_tokens needs one length per example ({len(self._lengths)}), got {len(values)}")
        if values.dtype.kind not in "iu":
            values = values.astype(np.int64)
        total = 0
        for k in range(len(self._chunk_batches) - 1):
            order, offsets = self._chunk_plan(k, keep=False)
            longest = np.maximum.reduceat(values[order], offsets[:-1]).astype(np.int64)
            total += int(np.dot(np.diff(offsets), longest))
        return total

    def _chunk_plan(self, k: int, *, keep: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``k``'s examples in plan order (before the largest batch moves) and its batch offsets."""
        with self._lock:
            cached = self._cache.get(k)
            if cached is not None:
                self._cache.move_to_end(k)
                return cached
        c0 = k * self._chunk
        part = self._lengths[c0 : min(len(self._lengths), c0 + self._chunk)]
        sizes, tokens, local = _plan_chunk(part, self._batch_size, self._window_examples, self._max_tokens)
        expected = int(self._chunk_batches[k + 1] - self._chunk_batches[k])
        if len(sizes) != expected or int(tokens.sum()) != self._chunk_tokens[k]:
            raise RuntimeError(
                f"bucket_by's lengths changed while the job ran (examples {c0}..{c0 + len(part) - 1} now plan "
                f"differently): the plan reads them again chunk by chunk, so pass an array that nothing modifies"
            )
        local += c0
        order = _readonly(local.astype(self._index_type))
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        planned = (order, _readonly(offsets))
        if keep:
            with self._lock:
                self._cache[k] = planned
                while len(self._cache) > 2:  # the chunk of the job's first (largest) batch, and the current one
                    self._cache.popitem(last=False)
        return planned


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


FILL_BINS = 20
"""Bins of the per-batch fill histograms of :func:`token_stats` (real / padded tokens, 0 to 1)."""


def token_stats(layout: BucketLayout, lengths: np.ndarray, batch_size: int, num_batches: int) -> dict[str, Any]:
    """Real and padded tokens of the first ``num_batches`` batches of ``layout`` and of the same examples batched
    in dataset order (``batch_size`` at a time): what bucketing saves, for ``tbp report``.

    Returns:
        ``{"batches", "examples", "real", "padded", "padded_in_order", "fill_bins", "fill", "fill_in_order"}``:
        the token counts, and histograms of the batches' fill (real / padded tokens) over ``fill_bins`` equal bins
        of ``[0, 1]``, for the plan and for dataset order.
    """
    values = np.asarray(lengths, dtype=np.int64)
    num_batches = min(num_batches, layout.num_batches())
    count = int(layout.offsets[num_batches])
    stats: dict[str, Any] = {
        "batches": num_batches, "examples": count, "real": 0, "padded": 0, "padded_in_order": 0,
        "fill_bins": FILL_BINS, "fill": [0] * FILL_BINS, "fill_in_order": [0] * FILL_BINS,
    }
    if count == 0:
        return stats
    planned = values[layout.order[:count]]
    starts = layout.offsets[:num_batches]
    sizes = np.diff(layout.offsets[: num_batches + 1])
    real = np.add.reduceat(planned, starts)
    padded = sizes * np.maximum.reduceat(planned, starts)
    in_order = values[np.sort(layout.order[:count])]
    order_starts = np.arange(0, count, batch_size)
    order_sizes = np.diff(np.append(order_starts, count))
    order_real = np.add.reduceat(in_order, order_starts)
    order_padded = order_sizes * np.maximum.reduceat(in_order, order_starts)
    stats.update(
        real=int(real.sum()),
        padded=int(padded.sum()),
        padded_in_order=int(order_padded.sum()),
        fill=_fill_histogram(real, padded),
        fill_in_order=_fill_histogram(order_real, order_padded),
    )
    return stats


def _fill_histogram(real: np.ndarray, padded: np.ndarray) -> list[int]:
    """Counts of batches per fill bin (a batch of empty examples is full)."""
    fill = np.divide(real, padded, out=np.ones(len(real), dtype=np.float64), where=padded > 0)
    bins = np.minimum((fill * FILL_BINS).astype(np.int64), FILL_BINS - 1)
    return np.bincount(bins, minlength=FILL_BINS).astype(int).tolist()


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
            :func:`~torch_batch_process.engine.plan.bucket_options.resolve_lengths`), or anything
            :func:`~torch_batch_process.engine.plan.bucket_options.as_lengths` takes. The layout keeps a reference
            to the validated array (see :class:`BucketLayout`).
        batch_size: most examples per batch (exactly this many without ``max_tokens``, except the last).
        window: ``bucket_window``: the examples of ``window * batch_size`` consecutive indices are sorted together.
        max_tokens: if set, a batch holds at most ``max_tokens`` padded tokens (``len * max length``),
            except an example longer than that, which is alone in its batch.

    Returns:
        The layout; the same inputs give identical batches in every process, whatever their integer type.
    """
    validate_bucket_options(lengths, window, max_tokens, batch_size)
    lengths = as_lengths(lengths, len(lengths))
    n = len(lengths)
    # No batch nor window holds more than the n examples: capped at n, a batch_size or window of 10**30 plans as
    # one of n (the same plan) instead of overflowing numpy's int64.
    batch_size = min(batch_size, max(n, 1))
    window_examples = min(window * batch_size, max(n, 1))
    chunk = max(1, CHUNK_EXAMPLES // window_examples) * window_examples
    sizes_parts, tokens_parts, chunk_tokens = [], [], []
    oversized = 0
    for c0 in range(0, n, chunk):
        part = lengths[c0 : min(n, c0 + chunk)]
        sizes, tokens, _ = _plan_chunk(part, batch_size, window_examples, max_tokens)
        sizes_parts.append(sizes)
        tokens_parts.append(tokens)
        chunk_tokens.append(int(tokens.sum()))
        if max_tokens is not None:
            oversized += int(np.count_nonzero(part.astype(np.int64) > max_tokens))
    counts = np.array([len(sizes) for sizes in sizes_parts], dtype=np.int64)
    chunk_batches = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=chunk_batches[1:])
    sizes = np.concatenate(sizes_parts) if sizes_parts else np.zeros(0, dtype=np.int64)
    top = int(np.argmax(np.concatenate(tokens_parts))) if tokens_parts else 0  # the first largest, in plan order
    if top:  # the plan's largest batch goes first
        sizes = np.concatenate(([sizes[top]], sizes[:top], sizes[top + 1 :]))
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return BucketLayout(
        lengths, batch_size, window_examples, max_tokens, chunk, chunk_batches, chunk_tokens, top, offsets, oversized
    )


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
