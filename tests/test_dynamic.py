"""schedule="dynamic": ranks take batches on demand; every promise of DESIGN §3 still holds (real processes)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from harness import (
    GENERIC_JOB,
    assert_exactly_once,
    base_env,
    buffered_values,
    job_spec,
    per_batch_values,
    read_reports,
    run_generic,
    spawn_ranks,
    wait_all,
    wait_for_progress,
)

from torch_batch_process.engine.schedule.liveness import SILENCE_S

pytestmark = pytest.mark.slow

DYNAMIC = {"schedule": "dynamic"}


def _calls(reports: dict[int, dict]) -> list[int]:
    return [g for rank in sorted(reports) for g in reports[rank].get("calls", [])]


def test_a_slow_rank_takes_fewer_batches_and_every_output_is_committed_once(tmp_path):
    n, b, interval = 600, 5, 4
    spec = job_spec(tmp_path, n=n, batch_size=b, checkpoint_interval=interval, outputs="both", sleep=0.004,
                    sleep_rank={"1": 0.03}, kwargs=DYNAMIC)
    outcomes, reports = run_generic(spec, nproc=2, launcher="plain", timeout=180)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    calls = _calls(reports)
    assert sorted(calls) == list(range(n // b)), "every batch processed once"
    fast, slow = len(reports[0]["calls"]), len(reports[1]["calls"])
    assert fast > 2 * slow, f"the fast rank took {fast} batches, the slow one {slow}"
    for rank in (0, 1):
        result = reports[rank]["result"]
        exact = {"sum_fn": n * (n - 1) // 2, "sum_cls": n * (n - 1) // 2, "count_cls": n}
        assert result["finished"] and result["metrics"] == exact
        mine = len(reports[rank]["calls"])
        # on_checkpoint_start() before each of this rank's commits: one per `interval` of its batches
        assert reports[rank]["checkpoints"] == -(-mine // interval), (rank, mine, reports[rank]["checkpoints"])
        assert reports[rank]["finishes"] == 1
    assert reports[0]["result"] == reports[1]["result"], "the same result on every rank"
    assert_exactly_once(per_batch_values(Path(spec["storage"])), n)
    assert_exactly_once(buffered_values(Path(spec["storage"])), n)


def test_dynamic_under_torchrun_and_a_resume_with_the_static_schedule(tmp_path):
    n = 400
    spec = job_spec(tmp_path, n=n, batch_size=4, checkpoint_interval=3, outputs="per_batch", kwargs=DYNAMIC,
                    max_batches=30)
    proc, reports = run_generic(spec, nproc=2, launcher="torchrun", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(_calls(reports)) == list(range(60)), "max_batches caps the job at 30 batches per rank"
    assert reports[0]["result"]["num_batches"] == 60
    # The schedule is not part of the job's fingerprint: the same job resumes (and re-runs) with the other one.
    static = dict(spec, kwargs={"schedule": "static"})
    proc, reports = run_generic(static, nproc=2, attempt=2, launcher="ranks", timeout=180)  # the resume: plain ranks
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert reports[0]["result"]["already_finished"]


@pytest.mark.parametrize("target_rank", [0, 1])
def test_sigterm_stops_every_rank_within_one_batch_and_a_resume_on_three_ranks_completes(tmp_path, target_rank):
    n, b = 2000, 5
    spec = job_spec(tmp_path, n=n, batch_size=b, checkpoint_interval=7, sleep=0.02, outputs="both", kwargs=DYNAMIC,
                    progress_file=str(tmp_path / "progress"))
    procs = spawn_ranks(2, GENERIC_JOB, json.dumps(dict(spec, attempt=1)))
    wait_for_progress(Path(spec["progress_file"]), procs)
    time.sleep(0.5)
    sent = time.time()
    os.kill(procs[target_rank].pid, signal.SIGTERM)
    outcomes = wait_all(procs, timeout=60)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    reports = read_reports(spec, 1)
    for rank in (0, 1):
        result = reports[rank]["result"]
        assert result["preempted"] and not result["finished"] and reports[rank]["finishes"] == 0
        late = [t for t in reports[rank]["call_times"] if t > sent]
        assert len(late) <= 2, f"rank {rank} ran {len(late)} batches after SIGTERM"
    first = _calls(reports)
    assert reports[0]["result"]["batches_committed"] == len(first), "everything processed was committed"
    assert len(first) < n // b

    outcomes, second = run_generic(spec, nproc=3, attempt=2, launcher="plain", timeout=180)
    assert [rc for rc, _, _ in outcomes] == [0, 0, 0], outcomes
    assert sorted(first + _calls(second)) == list(range(n // b)), "each batch processed once across both runs"
    assert second[0]["result"]["metrics"]["sum_cls"] == n * (n - 1) // 2
    assert_exactly_once(per_batch_values(Path(spec["storage"])), n)
    assert_exactly_once(buffered_values(Path(spec["storage"])), n)


@pytest.mark.parametrize("failure", [{"fail_batch": 37}, {"bad_items": [183]}, {"fail_checkpoint_rank": 1}],
                         ids=["process_batch", "dataset", "on_checkpoint_start"])
def test_a_failure_makes_every_rank_raise_promptly_and_a_rerun_resumes(tmp_path, failure):
    n = 400
    spec = job_spec(tmp_path, n=n, batch_size=2, checkpoint_interval=3, outputs="both", sleep=0.005, kwargs=DYNAMIC,
                    **failure)
    started = time.monotonic()
    outcomes, reports = run_generic(spec, nproc=2, launcher="plain", timeout=90)
    assert all(rc not in (None, 0) for rc, _, _ in outcomes), outcomes
    assert time.monotonic() - started < 60
    errors = {rank: reports[rank]["error"] for rank in (0, 1)}
    failing = [rank for rank, error in errors.items() if error["type"] != "WorkerFailedError"]
    assert len(failing) == 1, errors
    other = 1 - failing[0]
    assert f"rank {failing[0]}" in errors[other]["message"] and "Traceback" in errors[other]["message"]
    clean = {k: v for k, v in spec.items() if k not in failure}
    outcomes, reports = run_generic(clean, nproc=2, attempt=2, launcher="plain", timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    assert reports[0]["result"]["metrics"]["sum_cls"] == sum(range(n))
    assert_exactly_once(per_batch_values(Path(spec["storage"])), n)
    assert_exactly_once(buffered_values(Path(spec["storage"])), n)


@pytest.mark.parametrize("victim", [1, 2])
def test_a_killed_rank_makes_the_others_exit_within_the_heartbeat_silence(tmp_path, victim):
    # 15,000 batches of 10 ms: the survivors alone would need minutes; they must stop within SILENCE_S instead
    spec = job_spec(
        tmp_path, n=30000, batch_size=2, sleep=0.01, kwargs=DYNAMIC, progress_file=str(tmp_path / "progress")
    )
    procs = spawn_ranks(3, GENERIC_JOB, json.dumps(dict(spec, attempt=1)))
    wait_for_progress(Path(spec["progress_file"]), procs)
    os.kill(procs[victim].pid, signal.SIGKILL)
    started = time.monotonic()
    outcomes = wait_all(procs, timeout=120)
    took = time.monotonic() - started
    survivors = [rank for rank in range(3) if rank != victim]
    assert all(outcomes[rank][0] not in (None, 0) for rank in survivors), outcomes
    assert took < SILENCE_S + 25, f"the survivors took {took:.0f} s to stop"
    reports = read_reports(spec, 1)
    assert {reports[rank]["error"]["type"] for rank in survivors} == {"WorkerLostError"}, reports
    assert f"rank {victim} stopped answering" in "".join(err for _, _, err in outcomes), "rank 0 names the lost rank"
    calls = sum(len(reports[rank]["calls"]) for rank in survivors)
    assert calls < 15000 // 2, f"the survivors went on with {calls} batches"


def test_a_rank_suspended_longer_than_the_default_silence_goes_on_when_the_silence_is_raised(tmp_path):
    # a rank that does not run Python for 18 s (suspended here; a long GIL-holding C call looks the same) is not
    # lost when $TBP_HEARTBEAT_SILENCE_S allows it: the job completes, every example once
    # rank 0 alone would need 30 s: it is still taking batches (and watching) when the default silence ends, 3 s
    # before the suspension does (rank 0 checks its peers every heartbeat, 1 s)
    progress = str(tmp_path / "progress")
    spec = job_spec(tmp_path, n=3000, batch_size=2, sleep=0.02, kwargs=DYNAMIC, progress_file=progress)
    env = base_env(TBP_HEARTBEAT_SILENCE_S="60")
    procs = spawn_ranks(2, GENERIC_JOB, json.dumps(dict(spec, attempt=1)), env=env)
    wait_for_progress(Path(spec["progress_file"]), procs)
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        time.sleep(SILENCE_S + 3)
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    outcomes = wait_all(procs, timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    assert read_reports(spec, 1)[0]["result"]["metrics"]["sum_cls"] == sum(range(3000))
    assert_exactly_once(per_batch_values(Path(spec["storage"])), 3000)
