"""Chaos: SIGKILL a random worker at a random moment, three times, resuming with world sizes 2 -> 3 -> 1 -> 2.

After the last (uninterrupted) attempt, the committed outputs must hold every example exactly once, written
both ways (per batch in process_batch, and buffered then written in on_checkpoint_start with rank-named
files), and the reducers must equal the uninterrupted sum.
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
    per_batch_values,
    read_reports,
    spawn_ranks,
    wait_all,
)

pytestmark = pytest.mark.slow

N, BATCH = 3000, 10
WORLD_SIZES = [2, 3, 1, 2]


def committed_batches(storage: Path) -> int:
    records = sorted((storage / "_tbp" / "commits").glob("*.json"))
    if not records:
        return 0
    return sum(b - a for a, b in json.loads(records[-1].read_text())["committed"])


def run_attempt_with_kill(spec: dict[str, Any], world_size: int, attempt: int, rng: random.Random) -> dict[str, Any]:
    """Starts an attempt, waits until it processes batches, SIGKILLs one worker at a random moment."""
    progress = Path(spec["progress_file"])
    progress.unlink(missing_ok=True)
    procs = spawn_ranks(world_size, GENERIC_JOB, json.dumps(dict(spec, attempt=attempt)))
    deadline = time.monotonic() + 90
    while not progress.exists():
        assert time.monotonic() < deadline, "the attempt never started processing"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.8))
    victim = rng.randrange(world_size)
    alive_before = procs[victim].poll() is None
    os.kill(procs[victim].pid, signal.SIGKILL)
    outcomes = wait_all(procs, timeout=60)  # the survivors must notice and exit, not hang
    assert all(rc is not None for rc, _, _ in outcomes), "a surviving rank hung after its peer was killed"
    return {
        "victim": victim,
        "alive_before": alive_before,
        "victim_rc": outcomes[victim][0],
        "survivor_rcs": [rc for i, (rc, _, _) in enumerate(outcomes) if i != victim],
        "committed_after": committed_batches(Path(spec["storage"])),
        "finished": any("result" in r for r in read_reports(spec, attempt).values()),
    }


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill9_chaos_exactly_once(tmp_path, seed):
    rng = random.Random(seed)
    spec = {
        "n": N,
        "batch_size": BATCH,
        "checkpoint_interval": rng.choice([1, 3, 7]),
        "sleep": 0.01,
        "outputs": "both",
        "storage": str(tmp_path / "storage"),
        "report_dir": str(tmp_path / "reports"),
        "progress_file": str(tmp_path / "progress"),
    }
    kills = []
    for attempt, world_size in enumerate(WORLD_SIZES[:-1], start=1):
        kill = run_attempt_with_kill(spec, world_size, attempt, rng)
        kills.append(kill)
        # The kill really hit a running worker of an unfinished job.
        assert kill["alive_before"] and kill["victim_rc"] == -signal.SIGKILL, kill
        assert not kill["finished"] and kill["committed_after"] < N // BATCH, kill
        assert all(rc != 0 for rc in kill["survivor_rcs"]), kill

    final_attempt = len(WORLD_SIZES)
    outcomes, reports = run_generic_plain(spec, WORLD_SIZES[-1], final_attempt)
    assert [rc for rc, _, _ in outcomes] == [0] * WORLD_SIZES[-1], outcomes
    result = reports[0]["result"]
    assert result["finished"] and result["batches_committed"] == N // BATCH
    assert result["attempt"] == final_attempt
    storage = Path(spec["storage"])
    assert_exactly_once(per_batch_values(storage), N)
    assert_exactly_once(buffered_values(storage), N)
    total = N * (N - 1) // 2
    assert result["metrics"] == {"sum_fn": total, "sum_cls": total, "count_cls": N}
    assert not (storage / "_tbp" / "staging").exists() or not any((storage / "_tbp" / "staging").rglob("*.json"))
    print(f"seed {seed}: kills {[(k['victim'], k['committed_after']) for k in kills]}, duplicates 0, missing 0")


def run_generic_plain(spec: dict[str, Any], world_size: int, attempt: int):
    procs = spawn_ranks(world_size, GENERIC_JOB, json.dumps(dict(spec, attempt=attempt)))
    return wait_all(procs, timeout=180), read_reports(spec, attempt)
