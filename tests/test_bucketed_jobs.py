"""Length-bucketed jobs (DESIGN §9) end to end: real processes, kill -9, resumes with other world sizes.

The unit tests of the plan itself are in test_bucketing.py; here the plan drives real jobs: every batch file
holds exactly the examples the plan gives its ``batch_idx`` (the plan is the same in every attempt, whatever
the world size), every example's output is committed exactly once, and a resume with other lengths or
options is refused with nothing changed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from harness import (
    GENERIC_JOB,
    assert_exactly_once,
    buffered_values,
    job_spec,
    per_batch_values,
    read_outputs,
    read_reports,
    run_generic,
    spawn_ranks,
    tree_digest,
    wait_all,
    wait_for_progress,
)

from torch_batch_process import JobMismatchError, TorchBatchProcessor, torch_batch_process
from torch_batch_process.engine.plan.plans import BucketedPlan

N, BATCH, WINDOW, MAX_TOKENS = 600, 8, 4, 400
LENGTHS = [(i * 37) % 101 + 1 for i in range(N)]


def bucket_kwargs(schedule: str) -> dict[str, object]:
    return {"bucket_by": LENGTHS, "bucket_window": WINDOW, "max_tokens": MAX_TOKENS, "schedule": schedule}


def batch_files(storage: str) -> dict[int, list[int]]:
    """batch_idx -> the example values its committed file holds."""
    files = {}
    for rel, data in read_outputs(storage, "batch_*.json").items():
        batch_idx = int(rel.rsplit("batch_", 1)[1].split(".")[0])
        assert batch_idx not in files, f"batch {batch_idx} committed twice"
        files[batch_idx] = json.loads(data)
    return files


def kill_one_mid_run(spec: dict[str, object], world_size: int, attempt: int, rng: random.Random) -> None:
    """Starts an attempt, SIGKILLs one rank once it processes batches (then the others, as torchrun would)."""
    progress = Path(str(spec["progress_file"]))
    progress.unlink(missing_ok=True)
    procs = spawn_ranks(world_size, GENERIC_JOB, json.dumps(dict(spec, attempt=attempt)))
    wait_for_progress(progress, procs)
    time.sleep(rng.uniform(0.2, 0.6))
    os.kill(procs[rng.randrange(world_size)].pid, signal.SIGKILL)
    time.sleep(rng.uniform(0.0, 0.3))
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    wait_all(procs, timeout=60)
    assert not any("result" in r for r in read_reports(spec, attempt).values()), "the kill came after the end"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_bucketed_job_killed_then_resumed_on_another_world_size_keeps_its_plan_and_every_output_once(tmp_path, schedule):
    spec = job_spec(tmp_path, n=N, batch_size=BATCH, checkpoint_interval=3, outputs="both", sleep=0.02,
                    kwargs=bucket_kwargs(schedule), progress_file=str(tmp_path / "progress"))
    kill_one_mid_run(spec, 2, 1, random.Random(7))
    outcomes, reports = run_generic(spec, nproc=3, attempt=2, launcher="plain", timeout=180)
    assert [rc for rc, _, _ in outcomes] == [0, 0, 0], outcomes
    result = reports[0]["result"]
    plan = BucketedPlan(np.asarray(LENGTHS), BATCH, WINDOW, MAX_TOKENS)
    assert result["finished"] and 0 < result["batches_skipped"] < plan.num_batches, result
    assert result["num_batches"] == plan.num_batches and result["metrics"]["sum_cls"] == N * (N - 1) // 2
    files = batch_files(spec["storage"])
    assert sorted(files) == list(range(plan.num_batches))
    for batch_idx, values in files.items():  # the same plan in both attempts, on 2 and on 3 ranks
        assert values == plan.batch_indices(batch_idx), batch_idx
        assert len(values) * max(LENGTHS[i] for i in values) <= MAX_TOKENS or len(values) == 1
    assert_exactly_once(per_batch_values(spec["storage"]), N)
    assert_exactly_once(buffered_values(spec["storage"]), N)


class Indices(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        assert [int(v) for v in batch] == list(self.context.batch_indices)
        with self.context.upload_path() as path:
            (path / f"batch_{batch_idx}.json").write_text(json.dumps(list(self.context.batch_indices)))


@pytest.mark.parametrize(
    "change",
    [{"bucket_by": [n + 1 for n in LENGTHS]}, {"bucket_window": WINDOW + 1}, {"max_tokens": MAX_TOKENS * 2},
     {"bucket_by": None, "bucket_window": 100, "max_tokens": None}],
    ids=["other lengths", "other window", "other max_tokens", "no bucketing"],
)
def test_a_resume_with_another_plan_is_refused_and_nothing_changes(tmp_path, change):
    storage = str(tmp_path / "store")
    options = {"bucket_by": LENGTHS, "bucket_window": WINDOW, "max_tokens": MAX_TOKENS}
    result = torch_batch_process(Indices, list(range(N)), batch_size=BATCH, max_batches=5, storage_path=storage,
                                 progress=False, **options)
    assert result.finished and result.batches_committed == 5
    before = tree_digest(storage)
    with pytest.raises(JobMismatchError) as info:
        torch_batch_process(Indices, list(range(N)), batch_size=BATCH, max_batches=5, storage_path=storage,
                            progress=False, **{**options, **change})
    assert "resume=False" in str(info.value)
    assert tree_digest(storage) == before, "nothing changed"
    same = torch_batch_process(Indices, list(range(N)), batch_size=BATCH, max_batches=5, storage_path=storage,
                               progress=False, **options)
    assert same.already_finished
