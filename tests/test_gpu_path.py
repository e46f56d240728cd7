"""The GPU path's standalone parts: device prefetch (engine/feed/prefetch.py) and autocast (engine/feed/autocast.py).

The CPU tests run everywhere: the pass-through, the lookahead's order and error positions (the same
code the CUDA path runs, with identity stages), option validation, bf16 autocast on CPU. The CUDA tests
skip without a GPU; they check that prefetched batches equal ``to_device`` of the originals, that the
consumer stream waits for the side stream's copies, and that the allocator does not reuse a handed-out
batch's memory while the consumer still has work queued on it (``record_stream``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from torch_batch_process.device import to_device
from torch_batch_process.engine.feed.autocast import AUTOCAST_DTYPES, resolve_autocast
from torch_batch_process.engine.feed.prefetch import DevicePrefetcher, Lookahead, validate_device_prefetch
from torch_batch_process.errors import InvalidArgumentError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

Pair = collections.namedtuple("Pair", "left right")


class LoadError(Exception):
    """Raised by the test sources for the batches that fail to load."""


class Source:
    """An iterator of ``(key, batch)`` like a DataLoader's: batch ``i`` raises when ``i`` is in
    ``failing``, and the iteration goes on after it (as a DataLoader's does). Counts its pulls."""

    def __init__(self, n: int, failing: tuple[int, ...] = (), make: Any = None) -> None:
        self.n = n
        self.failing = set(failing)
        self.make = make or (lambda i: torch.full((2,), float(i)))
        self.pulled = 0
        self.errors: dict[int, LoadError] = {}

    def __iter__(self) -> Source:
        return self

    def __next__(self) -> tuple[int, Any]:
        i = self.pulled
        if i >= self.n:
            raise StopIteration
        self.pulled += 1
        if i in self.failing:
            self.errors[i] = LoadError(f"batch {i} failed to load")
            raise self.errors[i]
        return i, self.make(i)


def outcomes(iterator: Iterator[Any], limit: int = 1000) -> list[Any]:
    """Everything the caller sees, in order: items, and the exceptions (the objects themselves)."""
    seen: list[Any] = []
    for _ in range(limit):
        try:
            seen.append(next(iterator))
        except StopIteration:
            return seen
        except LoadError as exc:
            seen.append(exc)
    raise AssertionError("the iterator did not stop")


def identity_lookahead(source: Any, depth: int = 1) -> Lookahead[Any, Any, Any]:
    return Lookahead(source, lambda item: item, lambda item: item, depth)


# ------------------------------------------------------------------------------ pass-through


@pytest.mark.parametrize("enabled", [False, True])
def test_cpu_pass_through_returns_the_source_items_unchanged(enabled: bool) -> None:
    items = [
        (0, torch.arange(3)),
        ("k1", {"ids": torch.ones(2, 2), "text": ["a", "b"]}),
        ((2, "x"), np.arange(4)),  # numpy arrays are not converted: context.to_device does that
        (3, "just a string"),
        (4, Pair(torch.zeros(1), None)),
    ]
    prefetcher = DevicePrefetcher(iter(items), "cpu", enabled=enabled)
    assert not prefetcher.active and prefetcher.stream is None
    got = list(prefetcher)
    assert len(got) == len(items)
    for item, original in zip(got, items):
        assert item is original  # the very same objects: no copy, no rebuilt tuple


def test_pass_through_of_non_tensor_batches() -> None:
    from PIL import Image

    images = [Image.new("RGB", (4, 4), color=(i, 0, 0)) for i in range(3)]
    items = [(i, {"image": img, "caption": f"c{i}"}) for i, img in enumerate(images)]
    got = list(DevicePrefetcher(items, torch.device("cpu"), enabled=True))
    assert [k for k, _ in got] == [0, 1, 2]
    assert all(batch["image"] is img for (_, batch), img in zip(got, images))


def test_disabled_on_a_cuda_device_touches_no_cuda() -> None:
    # Works on a machine without CUDA: a disabled prefetcher creates no stream.
    prefetcher = DevicePrefetcher(Source(3), "cuda", enabled=False)
    assert not prefetcher.active
    assert [k for k, _ in prefetcher] == [0, 1, 2]


def test_pass_through_error_position_and_continuation() -> None:
    source = Source(6, failing=(2, 4))
    seen = outcomes(DevicePrefetcher(source, "cpu", enabled=True))
    assert [s if isinstance(s, LoadError) else s[0] for s in seen] == [0, 1, source.errors[2], 3, source.errors[4], 5]


def test_pass_through_of_a_failing_dataloader() -> None:
    """A real DataLoader whose dataset fails on batch 2: the error surfaces at that batch, unchanged."""

    class Failing(Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 5:  # in batch 2 (batch size 2)
                raise LoadError("example 5 is corrupt")
            return torch.tensor([index])

    loader = DataLoader(Failing(), batch_size=2)
    prefetcher = DevicePrefetcher(enumerate(loader), "cpu", enabled=True)
    assert next(prefetcher)[0] == 0
    assert next(prefetcher)[0] == 1
    with pytest.raises(LoadError, match="example 5 is corrupt"):
        next(prefetcher)


def test_pass_through_overhead_per_batch_is_negligible() -> None:
    """The pass-through costs one Python call per batch (about 50 ns on this machine's 2 cores)."""
    n = 100_000
    items = [(i, None) for i in range(n)]

    def per_item(make: Any) -> float:
        best = float("inf")
        for _ in range(5):
            iterator = make()
            start = time.perf_counter()
            for _ in iterator:
                pass
            best = min(best, time.perf_counter() - start)
        return best / n

    raw = per_item(lambda: iter(items))
    wrapped = per_item(lambda: DevicePrefetcher(items, "cpu", enabled=True))
    overhead = wrapped - raw
    print(f"pass-through overhead: {overhead * 1e9:.0f} ns per batch (raw iteration {raw * 1e9:.0f} ns)")
    assert overhead < 5e-6  # generous for a loaded machine; a batch takes milliseconds


# ----------------------------------------------------------------------------- lookahead


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_lookahead_keeps_depth_items_started_ahead(depth: int) -> None:
    source = Source(10)
    started: list[int] = []
    lookahead = Lookahead(source, lambda item: started.append(item[0]) or item, lambda item: item, depth)
    assert source.pulled == 0  # nothing is pulled before the first request
    for i in range(10):
        key, _ = next(lookahead)
        assert key == i
        assert source.pulled == min(10, i + 1 + depth)  # the next `depth` were pulled before handing out i
        assert started == list(range(source.pulled))
    with pytest.raises(StopIteration):
        next(lookahead)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_lookahead_raises_each_error_at_its_position(depth: int) -> None:
    source = Source(8, failing=(0, 3, 4, 7))
    seen = outcomes(identity_lookahead(source, depth))
    expected = [source.errors.get(i) or i for i in range(8)]
    assert [s if isinstance(s, LoadError) else s[0] for s in seen] == expected
    assert all(seen[i] is source.errors[i] for i in source.failing)  # unchanged objects


@pytest.mark.parametrize("depth", [1, 3])
def test_lookahead_never_pulls_past_an_undelivered_error(depth: int) -> None:
    source = Source(10, failing=(2,))
    lookahead = identity_lookahead(source, depth)
    assert next(lookahead)[0] == 0
    assert next(lookahead)[0] == 1
    assert source.pulled == 3  # batch 2 failed: nothing after it is pulled, whatever the depth
    with pytest.raises(LoadError) as raised:
        next(lookahead)
    assert raised.value is source.errors[2]
    assert raised.value.__traceback__ is not None
    assert next(lookahead)[0] == 3  # the caller asked again: the iteration goes on
    assert source.pulled == min(10, 4 + depth)


def test_lookahead_error_from_start_is_raised_at_its_position() -> None:
    def start(item: tuple[int, Any]) -> tuple[int, Any]:
        if item[0] == 1:
            raise LoadError("copy of batch 1 failed")
        return item

    lookahead = Lookahead(Source(3), start, lambda item: item)
    assert next(lookahead)[0] == 0
    with pytest.raises(LoadError, match="copy of batch 1"):
        next(lookahead)
    assert next(lookahead)[0] == 2


def test_lookahead_base_exceptions_propagate_at_once_and_keep_the_queue() -> None:
    class Interrupting(Source):
        def __next__(self) -> tuple[int, Any]:
            if self.pulled == 1 and not getattr(self, "interrupted", False):
                self.interrupted = True
                raise KeyboardInterrupt
            return super().__next__()

    source = Interrupting(3)
    lookahead = identity_lookahead(source, 1)
    with pytest.raises(KeyboardInterrupt):
        next(lookahead)  # pulling batch 1 ahead was interrupted: at once, not at batch 1's turn
    assert [item[0] for item in lookahead] == [0, 1, 2]  # batch 0 was kept


def test_lookahead_does_not_call_an_exhausted_source_again() -> None:
    class Strict(Source):
        def __next__(self) -> tuple[int, Any]:
            if self.pulled >= self.n and getattr(self, "done", False):
                raise AssertionError("called after StopIteration")
            try:
                return super().__next__()
            except StopIteration:
                self.done = True
                raise

    lookahead = identity_lookahead(Strict(2), 2)
    assert [item[0] for item in lookahead] == [0, 1]
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(lookahead)


def test_lookahead_close_drops_what_was_started() -> None:
    source = Source(5)
    lookahead = identity_lookahead(source, 2)
    next(lookahead)
    lookahead.close()
    with pytest.raises(StopIteration):
        next(lookahead)
    assert source.pulled == 3


def test_lookahead_over_a_failing_dataloader_with_workers() -> None:
    class Failing(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 4:
                raise ValueError("example 4 is corrupt")
            return torch.tensor([index])

    loader = DataLoader(Failing(), batch_size=2, num_workers=1)
    lookahead = identity_lookahead(enumerate(loader), 1)
    assert next(lookahead)[0] == 0
    assert next(lookahead)[0] == 1
    with pytest.raises(ValueError, match="example 4 is corrupt"):
        next(lookahead)
    del lookahead


@pytest.mark.parametrize("depth", [0, -1, 1.5, True, "1"])
def test_depth_is_validated(depth: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="depth"):
        DevicePrefetcher([], "cpu", enabled=False, depth=depth)
    with pytest.raises(InvalidArgumentError, match="depth"):
        identity_lookahead([], depth)


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("value", "device", "expected"),
    [
        (None, "cpu", False),
        (None, "cuda", True),
        (None, torch.device("cuda", 1), True),
        (None, "mps", False),
        (True, "cuda:0", True),
        (False, "cuda", False),
        (True, "cpu", False),  # allowed, does nothing
        (True, "mps", False),
        (False, "cpu", False),
    ],
)
def test_validate_device_prefetch(value: bool | None, device: Any, expected: bool) -> None:
    assert validate_device_prefetch(value, device) is expected


@pytest.mark.parametrize("value", [1, 0, "yes", "true", [True]])
def test_validate_device_prefetch_refuses_non_bools(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="device_prefetch must be True, False or None"):
        validate_device_prefetch(value, "cuda")


# ------------------------------------------------------------------------------ autocast


def test_autocast_none_is_a_null_context() -> None:
    factory = resolve_autocast(None, "cpu")
    linear = torch.nn.Linear(4, 4)
    with factory():
        assert linear(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("value", ["bf16", "fp16"])
def test_autocast_runs_a_linear_in_the_dtype_on_cpu(value: str) -> None:
    # torch >= 2.3 supports both on CPU; fp16 is accepted there (documented in engine/feed/autocast.py).
    factory = resolve_autocast(value, torch.device("cpu"))
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    for _ in range(2):  # a fresh context per batch
        with torch.inference_mode(), factory():
            out = linear(x)
        assert out.dtype == AUTOCAST_DTYPES[value]
        assert torch.allclose(out.float(), linear(x), atol=0.05, rtol=0.05)
    assert linear(x).dtype == torch.float32  # nothing leaks out of the region


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("BF16", "did you mean autocast='bf16'"),
        ("bfloat16", "did you mean autocast='bf16'"),
        ("float16", "did you mean autocast='fp16'"),
        (torch.float16, "pass autocast='fp16'"),
        (torch.float32, "bfloat16 ('bf16') and float16 ('fp16') only"),
        (False, "pass autocast=None"),
        ("fp8", "got 'fp8'"),
        (16, "got 16"),
    ],
)
def test_autocast_refuses_unknown_values_naming_the_fix(value: Any, fix: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        resolve_autocast(value, "cpu")
    message = str(raised.value)
    assert message.startswith("autocast must be None, 'bf16' or 'fp16'")
    assert fix in message
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, TypeError)


def test_autocast_refuses_a_device_type_without_autocast() -> None:
    with pytest.raises(InvalidArgumentError, match="no autocast for device type 'meta'; pass autocast=None"):
        resolve_autocast("bf16", "meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_autocast_on_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="CUDA is not available; pass autocast=None"):
        resolve_autocast("fp16", "cuda")


# ---------------------------------------------------------------------------------- CUDA

SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: about half a second on current GPUs


class Movable:
    """A batch leaf with its own ``to()`` (moved at hand-out, on the consumer stream)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def to(self, device: torch.device) -> Movable:
        return Movable(self.tensor.to(device))


def assert_same(got: Any, want: Any) -> None:
    """``got`` equals ``want``: same structure and types, tensors equal and on the same device."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.device == want.device and got.dtype == want.dtype and got.layout == want.layout
        if want.layout != torch.strided:
            got, want = got.to_dense(), want.to_dense()
        assert torch.equal(got.cpu(), want.cpu())
    elif isinstance(want, Movable):
        assert_same(got.tensor, want.tensor)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same(a, b)
    elif isinstance(want, np.ndarray):
        assert np.array_equal(got, want)
    else:
        assert got == want


def nested_batch(i: int, pin: bool = True) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(i)

    def pinned(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if pin else tensor

    return {
        "pinned": pinned(torch.randn(64, 32, generator=generator)),
        "pageable": torch.randint(0, 1000, (16,), generator=generator),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3) + i,
        "strings": np.array(["a", "b"]),  # stays a numpy array, as to_device leaves it
        "pair": Pair(torch.ones(3, dtype=torch.uint8) * i, [f"text {i}", i]),
        "tuple": (pinned(torch.zeros(2, 2, dtype=torch.int64)), None),
        "movable": Movable(torch.full((4,), float(i))),
        "sparse": torch.eye(3).to_sparse(),
        "label": i,
    }


def test_copy_ahead_follows_to_device_and_defers_what_it_cannot_track() -> None:
    """The CUDA path's structure walk, run with the CPU as the target (only its stream calls need a
    GPU): copied ahead, then finished at hand-out, a batch equals ``to_device`` of the original."""
    from torch_batch_process.engine.feed.prefetch import _copy_ahead

    cpu = torch.device("cpu")
    original = nested_batch(3, pin=False)
    tensors: list[torch.Tensor] = []
    deferred = [False]
    ahead = _copy_ahead(original, cpu, set(), tensors, deferred)
    assert deferred == [True]  # the Movable and the sparse tensor wait for the hand-out
    assert ahead["movable"] is original["movable"] and ahead["sparse"] is original["sparse"]
    assert isinstance(ahead["array"], torch.Tensor) and isinstance(ahead["strings"], np.ndarray)
    tracked = {id(t) for t in tensors}
    expected = [ahead["pinned"], ahead["pageable"], ahead["array"], ahead["pair"].left, ahead["tuple"][0]]
    assert tracked == {id(t) for t in expected}  # every strided tensor, for record_stream
    assert_same(to_device(ahead, cpu), to_device(original, cpu))

    plain: list[torch.Tensor] = []
    flag = [False]
    _copy_ahead({"ids": torch.ones(2), "text": ["a"]}, cpu, set(), plain, flag)
    assert flag == [False] and len(plain) == 1


@cuda
@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_prefetched_batches_equal_to_device_of_the_originals(depth: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    originals = [nested_batch(i) for i in range(5)]
    prefetcher = DevicePrefetcher(((i, b) for i, b in enumerate(originals)), device, enabled=True, depth=depth)
    assert prefetcher.active and prefetcher.stream is not None
    got = list(prefetcher)
    assert [k for k, _ in got] == list(range(5))
    for (_, batch), original in zip(got, originals):
        assert_same(batch, to_device(original, device))
        assert batch["movable"].tensor.device == device and batch["sparse"].device == device


@cuda
def test_cuda_default_index_is_the_current_device() -> None:
    prefetcher = DevicePrefetcher([(0, torch.ones(2))], "cuda", enabled=True)
    assert prefetcher.device == torch.device("cuda", torch.cuda.current_device())
    assert next(prefetcher)[1].device == prefetcher.device


@cuda
def test_cuda_consumer_stream_waits_for_the_copy() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    source = torch.randint(-(2**31), 2**31 - 1, (32 * 2**20,), dtype=torch.int32).pin_memory()  # 128 MiB
    prefetcher = DevicePrefetcher([(0, source)], device, enabled=True)
    assert prefetcher.stream is not None
    with torch.cuda.stream(prefetcher.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy queues behind half a second of side-stream work
    _, batch = next(prefetcher)
    marker = torch.cuda.Event()
    marker.record(torch.cuda.current_stream(device))
    assert not marker.query()  # the consumer stream is held until the copy has landed
    # Values read on the consumer stream (a device-to-host copy there) are the copied ones, not
    # whatever the fresh block held: the read waited for the copy.
    assert torch.equal(batch.cpu(), source)
    assert marker.query()


@cuda
def test_cuda_batches_land_before_use_across_many_batches() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    sources = [torch.randn(4 * 2**20, generator=torch.Generator().manual_seed(i)).pin_memory() for i in range(6)]
    prefetcher = DevicePrefetcher(enumerate(sources), device, enabled=True, depth=2)
    assert prefetcher.stream is not None
    sums = []
    for i, (key, batch) in enumerate(prefetcher):
        with torch.cuda.stream(prefetcher.stream):
            torch.cuda._sleep(SLEEP_CYCLES // 10)  # delays the copies issued next
        sums.append((key, batch.double().sum()))  # computed on the consumer stream
        assert key == i
    for key, total in sums:
        assert torch.isclose(total.cpu(), sources[key].double().sum())


def _load_kernels(batch: torch.Tensor) -> None:
    """Runs the kernels used after the sleep once before it: CUDA loads a kernel at its first launch (lazy loading,
    the default since CUDA 12.2), and loading synchronizes the context, which would wait out the sleep on the host
    and leave nothing queued to test against."""
    torch.cuda._sleep(1)
    batch.clone().add_(0)
    torch.cuda.synchronize()


@cuda
def test_cuda_memory_of_a_handed_out_batch_is_not_reused_while_the_consumer_uses_it() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached blocks of earlier tests that could hide a reuse
    numel = 2**20  # 4 MiB of float32
    items = [(i, torch.full((numel,), float(i)).pin_memory()) for i in range(3)]
    prefetcher = DevicePrefetcher(items, device, enabled=True)
    side = prefetcher.stream
    assert side is not None

    # Control: without record_stream, a block freed on the side stream is handed out again at once.
    with torch.cuda.stream(side):
        block = torch.empty(numel, device=device)
        pointer = block.data_ptr()
        del block
        again = torch.empty(numel, device=device)
        assert again.data_ptr() == pointer
        del again

    _, batch = next(prefetcher)  # allocated on the side stream, used on the consumer stream
    pointer = batch.data_ptr()
    consumer = torch.cuda.current_stream(device)
    _load_kernels(batch)
    torch.cuda._sleep(SLEEP_CYCLES)  # the consumer is busy for half a second...
    batch.add_(1)  # ...then uses the batch
    del batch  # the last reference goes while that work is still queued
    with torch.cuda.stream(side):
        probe = torch.empty(numel, device=device)
    assert not consumer.query(), "premise: the consumer's queued work has not finished yet"
    assert probe.data_ptr() != pointer  # the block waits for the consumer's queued work
    del probe
    consumer.synchronize()
    assert [k for k, _ in prefetcher] == [1, 2]


@cuda
def test_cuda_error_position() -> None:
    source = Source(5, failing=(1, 3), make=lambda i: torch.full((8,), float(i)).pin_memory())
    device = torch.device("cuda", torch.cuda.current_device())
    seen = outcomes(DevicePrefetcher(source, device, enabled=True))
    assert [s if isinstance(s, LoadError) else s[0] for s in seen] == [0, source.errors[1], 2, source.errors[3], 4]
    assert all(s[1].device == device for s in seen if not isinstance(s, LoadError))


@cuda
def test_cuda_non_tensor_batches_pass_through() -> None:
    from PIL import Image

    image = Image.new("RGB", (2, 2))
    items = [(0, "a string"), (1, {"image": image, "words": ["x", "y"]}), (2, None)]
    got = list(DevicePrefetcher(items, "cuda", enabled=True))
    assert got[0] == (0, "a string") and got[2] == (2, None)
    assert got[1][1]["image"] is image and got[1][1]["words"] == ["x", "y"]


@cuda
@pytest.mark.parametrize("value", ["bf16", "fp16"])
def test_cuda_autocast(value: str) -> None:
    if value == "bf16" and not torch.cuda.is_bf16_supported():
        with pytest.raises(InvalidArgumentError, match="autocast='fp16'"):
            resolve_autocast(value, "cuda")
        return
    factory = resolve_autocast(value, torch.device("cuda", torch.cuda.current_device()))
    linear = torch.nn.Linear(8, 4).cuda()
    with torch.inference_mode(), factory():
        assert linear(torch.randn(3, 8, device="cuda")).dtype == AUTOCAST_DTYPES[value]


# ------------------------------------------------------------------ benchmarks/gpu.py, CPU-safe parts

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def run_benchmark(*args: str, env: dict[str, str] | None = None, code: str | None = None) -> Any:
    """``python -m benchmarks.gpu ARGS`` (forked by the suite's fork server: torch already imported) or ``python -c
    CODE`` (executed), from the repository root."""
    import os
    import sys

    from harness import run_process

    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "benchmarks.gpu", *args]
    return run_process(command, {**os.environ, **(env or {})}, 120, cwd=REPO)


def test_benchmark_help_and_dry_run_work_without_a_gpu() -> None:
    helped = run_benchmark("--help")
    assert helped.returncode == 0 and "--cpu-smoke" in helped.stdout and "--prefetch-overhead" in helped.stdout
    dry = run_benchmark("--dry-run", "--quick")
    assert dry.returncode == 0, dry.stderr
    assert "plan: resnet50 (2,560 examples, batch 128)" in dry.stderr
    refused = run_benchmark("--contenders", "tbp")
    assert refused.returncode == 2 and "must include hand_pinned" in refused.stderr


def test_benchmark_table_shows_where_rank_0_spent_its_time(tmp_path: Any) -> None:
    """A saved results.json whose runs carry rank 0's CPU by thread and its wait for data renders a second table
    with them (medians over the rounds), for every contender that reports them."""
    import json

    def run(contender: str, round_index: int, main: float, wait: float) -> dict[str, Any]:
        return {
            "contender": contender, "workload": "minilm", "nproc": 1, "round": round_index, "ok": True,
            "examples": 1024, "job_s": 1.0, "wall_s": 5.0, "first_batch_s": 0.5, "steady_throughput": 2000.0,
            "rows": 1024, "files": 4, "error": None,
            "extra": {"cpu": {"main": main, "threads": 0.25, "children": 3.0}, "data_wait_s": wait},
        }

    runs = [run("hand_pinned", 0, 1.0, 0.1), run("tbp", 0, 1.5, 0.2), run("hand_pinned", 1, 1.25, 0.3),
            run("tbp", 1, 1.75, 0.4)]
    machine = {"cpu": "a CPU", "cores": 2, "memory_gib": 8, "gpu": "a GPU", "python": "3", "packages": {},
               "commit": "abc", "date": "today"}
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"machine": machine, "args": {"size": "quick", "scale": 1.0}, "unavailable": {},
                                 "runs": runs}))
    done = run_benchmark("--render", str(saved))
    assert done.returncode == 0, done.stderr
    table = done.stdout.split("Rank 0's time", 1)[1]
    assert "| Main thread CPU | Other threads CPU | Loader workers CPU | Waiting for data |" in table
    hand = next(line for line in table.splitlines() if "hand loop, pinned + non_blocking (target)" in line)
    ours = next(line for line in table.splitlines() if "torch_batch_process (defaults)" in line)
    assert hand.endswith("| 1.12 [1.00–1.25] | 0.25 | 3.00 | 0.20 [0.10–0.30] |"), hand
    assert ours.endswith("| 1.62 [1.50–1.75] | 0.25 | 3.00 | 0.30 [0.20–0.40] |"), ours


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_benchmark_without_cuda_says_so_and_exits_cleanly() -> None:
    done = run_benchmark()
    assert done.returncode == 0
    assert "no CUDA device is visible" in done.stderr and "nothing was measured" in done.stderr
    assert "Traceback" not in done.stderr


def test_benchmark_prefetch_overhead_runs_on_cpu() -> None:
    done = run_benchmark("--prefetch-overhead")
    assert done.returncode == 0, done.stderr
    assert "DevicePrefetcher pass-through:" in done.stdout and "ns per batch" in done.stdout


def test_lookahead_order_benchmark_prints_a_row_per_load(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.lookahead_order import main

    assert main(["--load-ms", "1", "2", "--gpu-ms", "1", "--batches", "6", "--rounds", "2", "--workers", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and all(len(row.split("|")[4].split(",")) == 2 for row in rows), rows


def test_benchmark_utilization_sampler_reads_nvidia_smi(tmp_path: Any) -> None:
    """The sampler parses ``nvidia-smi`` output (here a stand-in printing two GPUs at 30% and 50%)."""
    import os

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 30\necho 50\n")
    fake.chmod(0o755)
    code = (
        "import time\n"
        "from benchmarks.gpu import UtilizationSampler\n"
        "sampler = UtilizationSampler(['0', '1'])\n"
        "assert sampler.source == 'nvidia-smi', sampler.source\n"
        "start = time.time()\n"
        "with sampler:\n"
        "    time.sleep(1.0)\n"
        "print(len(sampler.samples), sampler.mean_between(start, time.time()), sampler.mean_between(0, 1))\n"
    )
    done = run_benchmark(code=code, env={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    count, mean, outside = done.stdout.split()
    assert int(count) >= 2 and float(mean) == 40.0 and outside == "None"


@cuda
@pytest.mark.slow
def test_ranks_sharing_a_gpu_get_a_gloo_default_group_and_finish(tmp_path: Any) -> None:
    """More ranks than GPUs on a machine: NCCL refuses two ranks on one GPU, so the library's default group is gloo
    on every rank (with a warning), and the job runs on the shared GPUs."""
    from harness import assert_exactly_once, job_spec, per_batch_values, run_generic

    world = torch.cuda.device_count() + 1  # at least two ranks share a GPU
    spec = job_spec(tmp_path, n=40, batch_size=4)
    outcomes, reports = run_generic(spec, nproc=world, launcher="plain", timeout=180)
    assert [rc for rc, _, _ in outcomes] == [0] * world, [err[-2000:] for _, _, err in outcomes]
    assert {reports[r]["backend"] for r in range(world)} == {"gloo"}
    assert all(reports[r]["result"]["finished"] for r in range(world))
    assert "NCCL cannot run two ranks on one GPU" in outcomes[0][2]
    assert_exactly_once(per_batch_values(spec["storage"]), 40)
