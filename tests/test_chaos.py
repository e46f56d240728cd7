"""Chaos: SIGKILL a random worker at a random moment, three times, resuming with world sizes 2 -> 3 -> 1 -> 2.

After the last (uninterrupted) attempt, the committed outputs must hold every example exactly once, written
both ways (per batch in process_batch, and buffered then written in on_checkpoint_start with rank-named
files), and the reducers must equal the uninterrupted sum. Runs on local storage and on S3 (moto).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from harness import (
    GENERIC_JOB,
    assert_exactly_once,
    buffered_values,
    committed_batches,
    per_batch_values,
    read_reports,
    spawn_ranks,
    storage_fs,
    wait_all,
    wait_for_progress,
)

pytestmark = pytest.mark.slow

N, BATCH = 3000, 10
WORLD_SIZES = [2, 3, 1, 2]


def run_attempt_with_kill(spec: dict[str, Any], world_size: int, attempt: int, rng: random.Random) -> dict[str, Any]:
    """Starts an attempt, waits until it processes batches, SIGKILLs one worker at a random moment."""
    progress = Path(spec["progress_file"])
    progress.unlink(missing_ok=True)
    procs = spawn_ranks(world_size, GENERIC_JOB, json.dumps(dict(spec, attempt=attempt)))
    wait_for_progress(progress, procs)
    time.sleep(rng.uniform(0.0, 0.8))
    victim = rng.randrange(world_size)
    alive_before = procs[victim].poll() is None
    os.kill(procs[victim].pid, signal.SIGKILL)
    if spec["kwargs"]["schedule"] == "dynamic":
        # Dynamic survivors stop only when rank 0 finds the victim's heartbeats silent (engine/schedule/liveness.py, see
        # test_dynamic.py), so meanwhile they would do much of the work; as torchrun's agent does when a worker
        # dies, the others are killed too, a moment later (mid-commit, mid-batch...).
        time.sleep(rng.uniform(0.0, 0.5))
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
    outcomes = wait_all(procs, timeout=60)  # the survivors must notice and exit, not hang
    hung = {rank: err[-12000:] for rank, (rc, _, err) in enumerate(outcomes) if rc is None}
    assert not hung, f"a surviving rank hung after rank {victim} was killed; their stacks and logs: {hung}"
    return {
        "victim": victim,
        "alive_before": alive_before,
        "victim_rc": outcomes[victim][0],
        "survivor_rcs": [rc for i, (rc, _, _) in enumerate(outcomes) if i != victim],
        "committed_after": committed_batches(spec["storage"]),
        "finished": any("result" in r for r in read_reports(spec, attempt).values()),
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill9_chaos_exactly_once(tmp_path, seed):
    run_chaos(tmp_path, str(tmp_path / "storage"), seed, intervals=[1, 3, 7])


@pytest.mark.parametrize("seed", [5, 6])
def test_kill9_chaos_exactly_once_dynamic(tmp_path, seed):
    # slower batches: the survivors of a kill go on for up to 0.5 s, which must not finish the job
    run_chaos(tmp_path, str(tmp_path / "storage"), seed, intervals=[1, 3, 7], schedule="dynamic", sleep=0.04)


@pytest.mark.s3
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_kill9_chaos_exactly_once_on_s3(tmp_path, s3_url, schedule):
    run_chaos(tmp_path, s3_url, 4, intervals=[3, 7], n=1000, schedule=schedule)  # shorter: many HTTP requests per commit


def run_chaos(
    tmp_path: Path,
    storage: str,
    seed: int,
    intervals: list[int],
    n: int = N,
    schedule: str = "static",
    sleep: float = 0.01,
) -> None:
    rng = random.Random(seed)
    spec = {
        "kwargs": {"schedule": schedule},
        "n": n,
        "batch_size": BATCH,
        "checkpoint_interval": rng.choice(intervals),
        "sleep": sleep,
        "outputs": "both",
        "storage": storage,
        "report_dir": str(tmp_path / "reports"),
        "progress_file": str(tmp_path / "progress"),
    }
    kills = []
    for attempt, world_size in enumerate(WORLD_SIZES[:-1], start=1):
        kill = run_attempt_with_kill(spec, world_size, attempt, rng)
        kills.append(kill)
        # The kill really hit a running worker of an unfinished job.
        assert kill["alive_before"] and kill["victim_rc"] == -signal.SIGKILL, kill
        assert not kill["finished"] and kill["committed_after"] < n // BATCH, kill
        assert all(rc != 0 for rc in kill["survivor_rcs"]), kill

    final_attempt = len(WORLD_SIZES)
    outcomes, reports = run_generic_plain(spec, WORLD_SIZES[-1], final_attempt)
    assert [rc for rc, _, _ in outcomes] == [0] * WORLD_SIZES[-1], outcomes
    result = reports[0]["result"]
    assert result["finished"] and result["batches_committed"] == n // BATCH
    assert result["attempt"] == final_attempt
    assert_exactly_once(per_batch_values(storage), n)
    assert_exactly_once(buffered_values(storage), n)
    total = n * (n - 1) // 2
    assert result["metrics"] == {"sum_fn": total, "sum_cls": total, "count_cls": n}
    fs, root = storage_fs(storage)
    staged = fs.find(f"{root}/_tbp/staging") if fs.exists(f"{root}/_tbp/staging") else []
    assert not [p for p in staged if p.endswith(".json")], staged
    print(f"seed {seed}: kills {[(k['victim'], k['committed_after']) for k in kills]}, duplicates 0, missing 0")


def run_generic_plain(spec: dict[str, Any], world_size: int, attempt: int):
    procs = spawn_ranks(world_size, GENERIC_JOB, json.dumps(dict(spec, attempt=attempt)))
    return wait_all(procs, timeout=180), read_reports(spec, attempt)
