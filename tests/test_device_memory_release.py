"""A job lets go of the user's objects when it returns: its processor (the model, on the device) and its batches.

A user who calls ``torch_batch_process`` twice in one process (a notebook, a resume after a preemption, a sweep, a
second model) must get the device's memory back in between: what the first call still holds is memory the second
call's model and batches cannot use, and with ``max_tokens="auto"`` it turns limits learned by the first call into
out-of-memory errors in the second. Python frees an object at once when its last reference goes, but an object held
by a reference cycle waits for a garbage collection, which a process that allocates few Python objects (a GPU loop)
may not run for a long time. So every test here runs with the garbage collector off:

- everywhere: the processor instance, its reducer and every batch handed to ``process_batch`` are gone when the
  call returns (a failed call: once its exception is dropped), for a job that finished, one stopped by SIGTERM,
  one that failed (with and without the transaction of ``on_oom="split"``), one that skipped a failing example,
  one whose batches ran out of memory and ran in parts, one with loader workers, and one on the dynamic schedule;
- on a GPU: ``torch.cuda.memory_allocated()`` after the call equals what it was before, with the model built in the
  processor's ``__init__`` (as Determined code does) and the batches copied ahead to the device.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import JOBS, spawn_ranks, wait_all
from jobs.release_job import Total

from torch_batch_process import TorchBatchProcessor, read_outputs, torch_batch_process

N, BATCH = 64, 8

MODES = ["finish", "preempt", "fail", "fail_plain", "skip", "split", "workers", "dynamic"]


class Wide(torch.utils.data.Dataset):
    """Example ``i``: ``width`` copies of ``i``."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.width,), float(i))


class Doubler(TorchBatchProcessor):
    """Writes each example's first value, doubled by a model it builds on the device, and sums them in a reducer;
    ``mode`` picks what else happens. Keeps weak references to itself, its reducer and every batch it is handed."""

    mode = "finish"
    width = 16
    """The examples' width (``Wide``'s), set with ``mode``."""
    seen: list[weakref.ref[Any]] = []

    def __init__(self, context: Any) -> None:
        self.context = context
        self.calls = 0
        self.model = context.prepare_model_for_inference(torch.nn.Linear(self.width, 1, bias=False))
        torch.nn.init.zeros_(self.model.weight)
        self.reducer = Total()
        self.total = context.wrap_reducer(self.reducer, name="total")
        type(self).seen += [weakref.ref(self), weakref.ref(self.reducer)]

    def process_batch(self, batch: torch.Tensor, batch_idx: int) -> None:
        type(self).seen.append(weakref.ref(batch))
        batch = self.context.to_device(batch)
        self.calls += 1
        doubled = batch * 2 + self.model(batch)
        if self.mode == "split" and len(batch) > BATCH // 2:
            raise torch.OutOfMemoryError(f"a batch of {len(batch)} does not fit (holding {doubled.numel()} floats)")
        if self.mode.startswith("fail") and self.calls == 3:
            raise ValueError("the third batch is bad")
        if self.mode == "skip" and 20 in self.context.batch_indices:
            raise ValueError("example 20 is bad")
        self.context.write({"value": doubled[:, 0]})
        self.total.update(doubled[:, 0])
        if self.mode == "preempt" and self.calls == 3:
            os.kill(os.getpid(), signal.SIGTERM)


OPTIONS: dict[str, dict[str, Any]] = {
    "fail_plain": {"on_oom": "raise"},  # nothing to undo: the batch runs outside a transaction
    "skip": {"on_error": "skip"},
    "split": {"on_oom": "split"},
    "workers": {"dataloader_kwargs": {"num_workers": 2}},
    "dynamic": {"schedule": "dynamic"},
}


def run_job(storage: Path, mode: str, width: int) -> None:
    """Runs a job in ``mode``; a failed job's exception is checked and dropped."""
    Doubler.mode, Doubler.width = mode, width
    Doubler.seen = []
    call = lambda: torch_batch_process(  # noqa: E731
        Doubler, Wide(width), batch_size=BATCH, storage_path=str(storage), checkpoint_interval=2, progress=False,
        tensorboard=False, **OPTIONS.get(mode, {}),
    )
    if mode.startswith("fail"):
        with pytest.raises(ValueError, match="third batch") as caught:
            call()
        del caught
        return
    result = call()
    assert result.finished == (mode != "preempt"), result
    if mode == "split":
        assert result.ooms >= 1 and result.split_batches >= 1, result
    if mode in ("finish", "workers", "dynamic"):
        assert read_outputs(str(storage)).column("index").to_pylist() == list(range(N))


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", MODES)
def test_a_job_lets_go_of_its_processor_and_batches_when_it_returns(tmp_path: Path, no_gc: None, mode: str) -> None:
    run_job(tmp_path / "job", mode, width=16)
    seen = Doubler.seen
    assert len(seen) > 2, "the processor was not built or ran no batch"
    alive = [ref() for ref in seen if ref() is not None]
    kinds = sorted({type(obj).__name__ for obj in alive})
    del alive
    gc.collect()
    after_gc = sum(ref() is not None for ref in seen)
    assert not kinds, f"still held when the call returned: {kinds} ({after_gc} after a garbage collection)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_a_job_leaves_nothing_allocated_on_the_gpu(tmp_path: Path, no_gc: None, mode: str) -> None:
    """Batches of 4 MiB and a model of 512 KiB, on the GPU."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    run_job(tmp_path / "job", mode, width=2**17)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    gc.collect()
    after_gc = torch.cuda.memory_allocated()
    assert after == before, (
        f"{(after - before) / 2**20:.1f} MiB left allocated after the call; {(after_gc - before) / 2**20:.1f} MiB "
        "after a garbage collection"
    )


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
@pytest.mark.parametrize("fail_batch", [None, 5])
def test_two_ranks_let_go_of_their_processor_and_batches(tmp_path: Path, schedule: str, fail_batch: int | None) -> None:
    """Each of 2 real ranks checks itself (tests/jobs/release_job.py): the votes, the dynamic schedule's threads
    and a failure on one rank keep nothing either, on that rank or the other."""
    spec = {"storage": str(tmp_path / "job"), "report_dir": str(tmp_path), "schedule": schedule,
            "fail_batch": fail_batch}
    outcomes = wait_all(spawn_ranks(2, JOBS / "release_job.py", json.dumps(spec)), timeout=120)
    assert all(code == 0 for code, _, _ in outcomes), outcomes
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    ended = sorted(r["ended"] for r in reports)
    assert ended == (["finished"] * 2 if fail_batch is None else ["ValueError", "WorkerFailedError"]), reports
    assert all(r["seen"] >= 2 for r in reports), reports  # the processor and its reducer were built
    assert [r["alive"] for r in reports] == [[], []], reports
