"""Memory-adaptive batches (DESIGN §15): ``on_oom="split"``, limits learned per length range and shared by the
ranks and the resumes, ``max_tokens="auto"``.

The model (tests/jobs/simulated_memory.py) raises a real ``torch.OutOfMemoryError`` when a batch holds more
padded tokens than its simulated device memory, after it has written a file, rows and reducer updates that the
library must undo. The multi-process tests (marked slow) run tests/jobs/oom_job.py in real processes and kill
them with SIGKILL. The CUDA tests at the end run a real model into a real out-of-memory error on a GPU (skipped
without one).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import JOBS, spawn_ranks, storage_fs, wait_all
from jobs.simulated_memory import Embedder, SimulatedMemory, Texts, expected_value, lengths_for, pad_collate

from torch_batch_process import (
    ExampleTooLargeError,
    InvalidArgumentError,
    TorchBatchProcessor,
    read_failures,
    read_outputs,
    torch_batch_process,
)
from torch_batch_process.engine.feed.device_memory import is_out_of_memory
from torch_batch_process.engine.feed.fitting import TOLERANCE, BatchFitter
from torch_batch_process.jobstore.memory_limits import MemoryLimits, RangeLimit, length_range, range_lengths
from torch_batch_process.observe.status import format_status, read_status

OOM_JOB = JOBS / "oom_job.py"

N, BATCH, BUDGET = 600, 64, 4096
LENGTHS = lengths_for(N)
EXPECTED = {i: expected_value(LENGTHS, i) for i in range(N)}


def run(storage: Path, *, budget: int | None = BUDGET, lengths: list[int] = LENGTHS, bucket: bool = True,
        processor: type[Embedder] = Embedder, **options: Any) -> tuple[Any, SimulatedMemory]:
    """One in-process job on the simulated device; returns its result and the device (its OOMs and calls)."""
    processor.memory = memory = SimulatedMemory(budget, options.pop("unit", "tokens"))
    options.setdefault("checkpoint_interval", 2)
    loader = {"collate_fn": pad_collate, "num_workers": options.pop("num_workers", 0)}
    result = torch_batch_process(
        processor, Texts(lengths), batch_size=options.pop("batch_size", BATCH), bucket_by=lengths if bucket else None,
        dataloader_kwargs=loader, storage_path=str(storage), progress=False, tensorboard=False, **options,
    )
    return result, memory


def outputs(storage: Path | str, n: int = N, missing: frozenset[int] = frozenset()) -> dict[int, int]:
    """The committed rows (``index -> value``), checked: every example but ``missing`` exactly once, in the rows
    and in the ``vals_*.json`` files (parts included)."""
    table = read_outputs(str(storage))
    index = table.column("index").to_pylist()
    assert sorted(index) == [i for i in range(n) if i not in missing], "rows: not every example exactly once"
    files: Counter[int] = Counter()
    fs, root = storage_fs(storage)
    for path in fs.find(f"{root}/outputs"):
        if path.rsplit("/", 1)[-1].startswith("vals_"):
            files.update(json.loads(fs.cat_file(path)))
    assert files == Counter(i for i in range(n) if i not in missing), "files: not every example exactly once"
    return dict(zip(index, table.column("value").to_pylist(), strict=True))


# ------------------------------------------------------------------------------------------ units


def test_out_of_memory_errors_are_told_apart() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 8.00 GiB)"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("MPS backend out of memory"))  # an allocator raises RuntimeError


def test_length_ranges() -> None:
    assert [length_range(n) for n in (0, 1, 2, 3, 4, 5, 64, 65, 128, 129)] == [0, 0, 1, 2, 2, 3, 6, 7, 7, 8]
    assert range_lengths(7) == (65, 128) and range_lengths(0) == (0, 1)


def test_limits_learn_merge_and_read_with_their_neighbours() -> None:
    limits = MemoryLimits("tokens")
    assert limits.bounds(7) == (0, None) and not limits
    assert limits.ran_out(7, 8192) and limits.fitted(7, 4096)
    assert not limits.fitted(7, 2048) and not limits.ran_out(7, 9000)  # no news
    assert not limits.fitted(7, 8192)  # the out-of-memory wins
    assert limits.bounds(7) == (4096, 8192)
    assert limits.bounds(6) == (4096, 8192)  # fits with longer examples: fits; the longer range's OOM: a guess
    assert limits.bounds(8) == (0, 8192)  # OOM with shorter examples: OOM with longer ones; its fits say nothing
    other = MemoryLimits("tokens", {7: RangeLimit(4600, 5000), 5: RangeLimit(9000, None)})
    assert limits.merge(other.to_json()) == {5, 7}
    assert limits.ranges[7] == RangeLimit(4600, 5000) and limits.bounds(6) == (4600, 5000)
    assert limits.ran_out(7, 4500)  # a contradicted fit is forgotten: the limits only get more careful
    assert limits.ranges[7] == RangeLimit(0, 4500)
    assert MemoryLimits.from_json(json.loads(json.dumps(limits.to_json()))) == limits
    assert limits.to_json({7}) == {"unit": "tokens", "device": "", "ranges": [[7, 0, 4500]]}
    elsewhere = MemoryLimits("tokens", {7: RangeLimit(100, 200)}, device="cuda A100 42")
    assert not limits.same_kind(elsewhere) and not limits.same_kind(elsewhere.to_json())
    with pytest.raises(ValueError, match="cannot merge"):
        limits.merge(elsewhere)
    fitter = BatchFitter.for_job(elsewhere.to_json(), np.ones(10, dtype=np.int64), "cuda H100 80")
    assert not fitter.active  # learned on another kind of device: learned anew
    fitter.merge(elsewhere.to_json())
    assert not fitter.active
    assert "lengths 65-128: 4,500 ran out of memory" in limits.describe()
    with pytest.raises(ValueError):
        MemoryLimits.from_json({"unit": "bytes", "ranges": []})


def test_a_fitter_finds_a_budget_in_a_handful_of_out_of_memory_errors() -> None:
    """Batches of 128 examples sorted by length (as a bucketed plan's), on a device of 5,000 tokens: the first
    batch runs out of memory, then a few probes, then never again, at parts within TOLERANCE of the limit."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(70, 128, size=128 * 40)
    fitter = BatchFitter(MemoryLimits("tokens"), lengths)
    budget, ooms, sizes = 5000, 0, []
    order = np.argsort(-lengths, kind="stable")
    for batch in np.array_split(order, 40):
        parts = fitter.cut(batch.tolist()) or [batch.tolist()]
        queue = list(parts)
        while queue:
            piece = queue.pop(0)
            size = len(piece) * int(lengths[piece].max())
            if size > budget:
                ooms += 1
                fitter.ran_out(piece)
                take = fitter.next_part(piece, below=len(piece))
                queue[:0] = [piece[:take], piece[take:]]
            else:
                fitter.fitted(piece)
                sizes.append(size)
    assert ooms <= 6, ooms
    lo, hi = fitter.limits.bounds(7)
    assert budget / (1 + TOLERANCE) <= lo <= budget < hi <= lo * (1 + TOLERANCE)
    assert fitter.ooms == ooms and fitter.take_counts() == (ooms, 0) and fitter.take_news() is not None


def test_examples_are_cut_into_equal_parts_without_lengths() -> None:
    fitter = BatchFitter(MemoryLimits("examples", {0: RangeLimit(40, 64)}), None)
    assert fitter.cut(list(range(64))) == [list(range(32)), list(range(32, 64))]
    assert fitter.cut(list(range(30))) is None
    assert BatchFitter(MemoryLimits("examples"), None).cut(list(range(64))) is None  # nothing known: as it is


# ------------------------------------------------------------------------------------------ jobs, one process


@pytest.mark.parametrize("num_workers", [0, 2])
def test_auto_gives_the_outputs_of_the_best_max_tokens_set_by_hand(tmp_path: Path, num_workers: int) -> None:
    reference, device = run(tmp_path / "reference", budget=None, num_workers=num_workers)
    assert device.ooms == 0 and outputs(tmp_path / "reference") == EXPECTED
    by_hand, device = run(tmp_path / "by_hand", max_tokens=BUDGET, num_workers=num_workers)
    assert device.ooms == 0 and outputs(tmp_path / "by_hand") == EXPECTED

    auto, device = run(tmp_path / "auto", max_tokens="auto", num_workers=num_workers)
    assert outputs(tmp_path / "auto") == EXPECTED
    assert auto.metrics == reference.metrics == by_hand.metrics  # failed attempts' reducer updates undone
    assert auto.metrics["seen"] == list(range(N)) and auto.metrics["count"] == N
    assert 1 <= device.ooms <= 5 and auto.ooms == device.ooms  # a handful, all in the first window's batches
    assert auto.split_batches >= 1
    limits = auto.memory_limits
    assert limits["unit"] == "tokens" and BUDGET / (1 + TOLERANCE) <= limits["budget"] <= BUDGET
    assert "ran out of memory" in limits["text"]
    assert sum(size > BUDGET for size in device.calls) == device.ooms
    assert auto.num_batches == reference.num_batches  # the plan did not change: cut batches keep their batch_idx


def test_a_resume_after_learning_meets_no_out_of_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class StopsOnce(Embedder):
        stop_after = 6

        def process_batch(self, batch: Any, batch_idx: int) -> None:
            super().process_batch(batch, batch_idx)
            type(self).stop_after -= 1
            if type(self).stop_after == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # preempted, once the first batches taught the limits

    StopsOnce.__qualname__ = "Embedder"
    first, device = run(tmp_path / "job", processor=StopsOnce, max_tokens="auto")
    assert first.preempted and device.ooms >= 1 and first.memory_limits is not None
    caplog.set_level("INFO", logger="torch_batch_process")
    second, device = run(tmp_path / "job", processor=StopsOnce, max_tokens="auto")
    assert second.finished and second.attempt == 2 and second.batches_skipped > 0
    assert device.ooms == 0 and second.ooms == 0  # every batch cut before it ran, from the stored limits
    assert max(device.calls) <= BUDGET and second.split_batches > 0
    assert second.memory_limits["budget"] == first.memory_limits["budget"]
    assert outputs(tmp_path / "job") == EXPECTED
    assert second.metrics["seen"] == list(range(N))
    assert "memory limits learned by earlier attempts" in caplog.text
    status = read_status(str(tmp_path / "job"))
    assert status["memory_limits"] == second.memory_limits and status["ooms"] == first.ooms
    assert "memory       tokens per batch" in format_status(status)


def test_parts_keep_their_batch_idx_and_name_their_files_by_their_first_example(tmp_path: Path) -> None:
    run(tmp_path / "job", max_tokens="auto", checkpoint_interval=100)
    fs, root = storage_fs(tmp_path / "job")
    names = [p[len(root) :] for p in fs.find(f"{root}/outputs") if "vals_" in p]
    parts = [name for name in names if "/part_" in name]
    assert parts, names
    for name in parts:  # part_<first index>/vals_<batch_idx>.json: the part's first example is in that batch
        first = int(name.split("/part_")[1].split("/")[0])
        values = json.loads(fs.cat_file(root + name))
        assert values[0] == first


def test_an_example_that_does_not_fit_alone(tmp_path: Path) -> None:
    """With on_error="raise": an error naming the example and its length; with "skip": a failing example."""
    long = 123

    class TooLong(Embedder):
        too_long = frozenset({long})

    TooLong.__qualname__ = "Embedder"
    with pytest.raises(ExampleTooLargeError, match=rf"example {long} of batch \d+ \(length {LENGTHS[long]}\)"):
        run(tmp_path / "raise", processor=TooLong)
    result, _ = run(tmp_path / "raise", processor=TooLong, on_error="skip")  # resumes, skipping it
    assert result.finished and result.failed_examples == 1
    failures = read_failures(str(tmp_path / "raise"))
    assert [(f["index"], f["error_type"]) for f in failures] == [(long, "OutOfMemoryError")]
    assert outputs(tmp_path / "raise", missing=frozenset({long})) == {i: v for i, v in EXPECTED.items() if i != long}


def test_a_job_that_died_of_an_out_of_memory_error_resumes_with_split(tmp_path: Path) -> None:
    """on_oom="raise" fails the job; the same job (same fingerprint: max_tokens "auto" plans as None) resumes
    with the default and finishes: nobody has to start again from zero with a smaller batch_size."""
    with pytest.raises(torch.OutOfMemoryError, match="simulated device"):
        run(tmp_path / "job", on_oom="raise")
    result, device = run(tmp_path / "job", max_tokens="auto")
    assert result.finished and result.attempt == 2 and device.ooms >= 1
    assert outputs(tmp_path / "job") == EXPECTED


def test_without_learning_every_long_batch_runs_out_of_memory_again(tmp_path: Path) -> None:
    """on_error="skip" with on_oom="raise" bisects each batch that runs out of memory (§11) and learns nothing:
    the baseline that on_oom="split" improves on."""
    n = 2400
    lengths = lengths_for(n)
    expected = {i: expected_value(lengths, i) for i in range(n)}
    baseline, without = run(tmp_path / "bisect", lengths=lengths, on_error="skip", on_oom="raise")
    assert outputs(tmp_path / "bisect", n) == expected and baseline.failed_examples == 0
    assert baseline.ooms == 0 and baseline.memory_limits is None  # not counted: nothing learned
    _, split = run(tmp_path / "split", lengths=lengths, on_error="skip")
    assert outputs(tmp_path / "split", n) == expected
    long_batches = sum(1 for size in without.calls if size > BUDGET)
    assert without.ooms == long_batches > 3 * split.ooms, (without.ooms, split.ooms)


def test_without_bucket_by_the_limit_is_in_examples(tmp_path: Path) -> None:
    result, device = run(tmp_path / "job", budget=16, unit="examples", bucket=False)
    assert outputs(tmp_path / "job") == EXPECTED
    assert 1 <= device.ooms <= 4 and result.memory_limits["unit"] == "examples"
    assert result.memory_limits["budget"] == 16
    later = device.calls[-20:]
    assert max(later) <= 16 and min(later) >= 11  # equal parts (a short last batch aside): 4 x 16, not 16+16+16+16+0


def test_dynamic_schedule_in_one_process(tmp_path: Path) -> None:
    result, device = run(tmp_path / "job", max_tokens="auto", schedule="dynamic")
    assert outputs(tmp_path / "job") == EXPECTED and 1 <= device.ooms <= 5


class StreamRows(TorchBatchProcessor):
    """A stream job's processor on a device of 5 rows."""

    ooms = 0

    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        ids = [int(v) for v in batch["id"]]
        assert ids == list(self.context.batch_indices)
        with self.context.upload_path() as path:
            (path / f"vals_{batch_idx}.json").write_text(json.dumps(ids))
        if len(ids) > 5:
            type(self).ooms += 1
            raise torch.OutOfMemoryError(f"simulated device: {len(ids)} rows, 5 fit")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_streaming_source_reads_the_parts_again_by_row_number(tmp_path: Path, num_workers: int) -> None:
    from test_stream_jobs import write_parquet_files

    from torch_batch_process import sources

    counts = [40, 0, 37]
    write_parquet_files(str(tmp_path / "data"), counts, row_group=8)
    StreamRows.ooms = 0
    result = torch_batch_process(
        StreamRows, sources.parquet(str(tmp_path / "data" / "*.parquet")), batch_size=16, checkpoint_interval=2,
        dataloader_kwargs={"num_workers": num_workers}, storage_path=str(tmp_path / "job"), progress=False,
    )
    assert result.finished and 1 <= StreamRows.ooms <= 3 and result.memory_limits["unit"] == "examples"
    fs, root = storage_fs(tmp_path / "job")
    ids: Counter[int] = Counter()
    for path in fs.find(f"{root}/outputs"):
        if "vals_" in path:
            ids.update(json.loads(fs.cat_file(path)))
    assert ids == Counter(range(sum(counts)))


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"on_oom": "retry"}, "on_oom must be 'split'"),
        ({"on_oom": "raise", "max_tokens": "auto"}, "max_tokens='auto' learns the token budget"),
        ({"bucket": False, "max_tokens": "auto"}, "max_tokens needs bucket_by (got max_tokens='auto')"),
        ({"max_tokens": "Auto"}, "or 'auto'"),
    ],
)
def test_bad_options_are_refused_before_any_work(tmp_path: Path, options: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        run(tmp_path / "job", **options)
    assert not (tmp_path / "job").exists()


# ------------------------------------------------------------------------------------------ jobs, several processes


def spec_for(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    spec = {
        "storage": str(tmp_path / "storage"),
        "report_dir": str(tmp_path / "reports"),
        "n": 2000,
        "batch_size": 64,
        "budget": BUDGET,
        "max_tokens": "auto",
        "checkpoint_interval": 1,
    }
    spec.update(extra)
    return spec


def reports(spec: dict[str, Any], world_size: int, attempt: int = 1) -> list[dict[str, Any]]:
    return [
        json.loads(Path(spec["report_dir"], f"attempt{attempt}_rank{r}.json").read_text()) for r in range(world_size)
    ]


def latest_limits(storage: str) -> dict[str, Any] | None:
    records = sorted(Path(storage, "_tbp", "commits").glob("*.json"))
    for path in reversed(records):
        try:
            return json.loads(path.read_text()).get("memory_limits")
        except (FileNotFoundError, ValueError):
            continue
    return None


def converged(limits: dict[str, Any] | None) -> bool:
    """Whether stored limits have found the budget of the longest examples (no more probes there)."""
    if not limits:
        return False
    parsed = MemoryLimits.from_json(limits)
    lo, hi = parsed.bounds(7)
    return lo > 0 and hi is not None and hi <= lo * (1 + TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_kill_9_then_resume_with_another_world_size_meets_no_out_of_memory(tmp_path: Path, schedule: str) -> None:
    spec = spec_for(tmp_path, sleep=0.25, schedule=schedule)
    procs = spawn_ranks(2, OOM_JOB, json.dumps(spec))
    deadline = time.monotonic() + 120
    while not converged(latest_limits(spec["storage"])):  # the limits are learned, shared and committed
        assert time.monotonic() < deadline, "the limits were never committed"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.05)
    time.sleep(0.3)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    wait_all(procs, 30)
    record = json.loads(sorted(Path(spec["storage"], "_tbp", "commits").glob("*.json"))[-1].read_text())
    assert not record["finished"], "the kill came too late to test a resume"

    resumed = dict(spec, sleep=0.0, attempt=2)
    results = wait_all(spawn_ranks(3, OOM_JOB, json.dumps(resumed)), 180)
    assert [rc for rc, _, _ in results] == [0, 0, 0], results[0][2][-3000:]
    got = reports(resumed, 3, attempt=2)
    assert [r["ooms"] for r in got] == [0, 0, 0]  # the stored limits cut every batch before it ran
    result = got[0]["result"]
    assert result["ooms"] == 0 and result["attempt"] == 2 and result["batches_skipped"] > 0
    assert all(max(r["calls"], default=0) <= BUDGET for r in got)
    lengths = lengths_for(2000)
    assert outputs(spec["storage"], n=2000) == {i: expected_value(lengths, i) for i in range(2000)}
    assert result["metrics"]["seen"] == list(range(2000)) and result["metrics"]["count"] == 2000


@pytest.mark.slow
def test_ranks_share_what_they_learn_through_the_votes(tmp_path: Path) -> None:
    """bucket_window=1 keeps batch g on examples [16g, 16g + 16): rank 0's first batches are long (it meets the
    limit), rank 1's are short, then both get long ones. Rank 1 never runs out of memory: rank 0's votes taught it
    the limit before its first long batch."""
    lengths = [128 if g % 2 == 0 else 10 for g in range(8) for _ in range(16)] + [120] * (16 * 24)
    spec = spec_for(tmp_path, n=len(lengths), lengths=lengths, batch_size=16, budget=1024, bucket_window=1)
    results = wait_all(spawn_ranks(2, OOM_JOB, json.dumps(spec)), 180)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    rank0, rank1 = reports(spec, 2)
    assert rank0["ooms"] >= 1 and rank1["ooms"] == 0, (rank0["ooms"], rank1["ooms"])
    assert max(rank1["calls"]) <= 1024 and sum(size > 160 for size in rank1["calls"]) > 0  # cut, never failed
    assert rank0["result"]["ooms"] == rank0["ooms"]  # the result counts every rank's
    assert outputs(spec["storage"], n=len(lengths)) == {i: expected_value(lengths, i) for i in range(len(lengths))}


# ------------------------------------------------------------------------------------------ a real GPU


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU_JOB_LIMIT = 2 * 2**30
"""The tests cap this process's share of the GPU at about 2 GiB (torch.cuda.set_per_process_memory_fraction), so
their out-of-memory errors are real allocator errors that never take memory from anything else on the GPU."""


class GpuModel(Embedder):
    """A real model on the GPU: a linear layer over 64 hidden vectors of 1,024 floats per token (512 KiB of
    activations per padded token, input and output), so a batch of more than about 4,000 padded tokens does not
    fit in the capped memory; it stops itself (SIGTERM) after ``stop_after`` batches, once."""

    stop_after = 0

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.layer = context.prepare_model_for_inference(torch.nn.Linear(1024, 1024))

    def process_batch(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = self.context.to_device(batch["ids"])
        hidden = torch.ones(*ids.shape, 64, 1024, device=ids.device)
        out = self.layer(hidden)
        del hidden, out
        super().process_batch(batch, batch_idx)
        type(self).stop_after -= 1
        if type(self).stop_after == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def _cap_gpu_memory() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, GPU_JOB_LIMIT / total), 0)


@needs_cuda
def test_a_real_out_of_memory_error_on_a_gpu_is_split_learned_and_not_met_again_after_a_resume(tmp_path: Path) -> None:
    _cap_gpu_memory()
    try:
        GpuModel.stop_after = 8
        first, _ = run(tmp_path / "job", budget=None, processor=GpuModel, max_tokens="auto")
        assert first.preempted and first.ooms >= 1 and first.memory_limits["budget"], first
        second, _ = run(tmp_path / "job", budget=None, processor=GpuModel, max_tokens="auto")
        assert second.finished and second.ooms == 0 and second.split_batches > 0
        assert outputs(tmp_path / "job") == EXPECTED
        assert second.metrics["seen"] == list(range(N))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


@needs_cuda
def test_a_batch_too_large_to_copy_to_the_gpu_is_split(tmp_path: Path) -> None:
    """The device copy ahead (device_prefetch) runs out of memory: the batch's parts are copied one by one."""
    _cap_gpu_memory()

    class Wide(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"index": i, "x": torch.full((2**30 // 4 // 12,), float(i))}  # 1/12 GiB each: 32 need 2.7 GiB

    class Copied(Embedder):
        def process_batch(self, batch: dict[str, Any], batch_idx: int) -> None:
            assert batch["x"].is_cuda
            self.context.write({"value": batch["x"][:, 0].cpu()})

    try:
        result = torch_batch_process(
            Copied, Wide(), batch_size=32, storage_path=str(tmp_path / "job"), progress=False, tensorboard=False,
        )
        assert result.finished and result.ooms >= 1 and result.split_batches == 1
        table = read_outputs(str(tmp_path / "job"))
        assert table.column("index").to_pylist() == list(range(32))
        assert table.column("value").to_pylist() == [float(i) for i in range(32)]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
