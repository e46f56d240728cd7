"""Preemption and failure handling with real processes and real signals."""

from __future__ import annotations

import json
import math
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
    committed_batches,
    free_port,
    job_spec,
    per_batch_values,
    read_reports,
    run_generic,
    spawn_ranks,
    start_process,
    wait_all,
    wait_for,
    wait_for_progress,
)

from torch_batch_process import TorchBatchProcessor, torch_batch_process
from torch_batch_process.engine.schedule.agreement import AGREEMENT_S

# ----------------------------------------------------------------------------- in one process

CALLS: list[int] = []


class SelfPreempting(TorchBatchProcessor):
    signal_at: int | None = 3

    def __init__(self, context):
        self.context = context
        self.total = context.wrap_reducer(lambda values: sum(values), name="total")

    def process_batch(self, batch, batch_idx):
        CALLS.append(batch_idx)
        self.total.update(sum(batch))
        if batch_idx == type(self).signal_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_finish(self):
        CALLS.append(-1)


class Plain(SelfPreempting):
    signal_at = None


Plain.__qualname__ = "SelfPreempting"


@pytest.mark.parametrize("checkpoint_interval", [100, 1, 2])
def test_sigterm_commits_returns_preempted_and_restores_user_handler(tmp_path, checkpoint_interval):
    seen = []

    def user_handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, user_handler)
    try:
        CALLS.clear()
        result = torch_batch_process(
            SelfPreempting, list(range(40)), batch_size=4, checkpoint_interval=checkpoint_interval, storage_path=str(tmp_path)
        )
        assert result.preempted and not result.finished
        assert CALLS == [0, 1, 2, 3], "one process stops right after the step in which the signal came; no on_finish"
        assert result.batches_committed == 4 and result.metrics == {"total": sum(range(16))}
        assert signal.getsignal(signal.SIGTERM) is user_handler, "the user's handler is back"
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        CALLS.clear()
        result = torch_batch_process(Plain, list(range(40)), batch_size=4, checkpoint_interval=100, storage_path=str(tmp_path))
        assert CALLS == [4, 5, 6, 7, 8, 9, -1] and result.finished and result.batches_skipped == 4
        assert result.metrics == {"total": sum(range(40))}
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- real processes

@pytest.mark.slow
@pytest.mark.parametrize("target_rank,checkpoint_interval", [(0, 50), (1, 50), (1, 1), (0, 2)])
def test_sigterm_to_one_rank_stops_all_within_one_agreement_period_and_resume_does_the_rest(
    tmp_path, target_rank, checkpoint_interval
):
    n, b = 2000, 5  # 400 batches, 200 steps of ~20 ms on 2 ranks
    spec = job_spec(tmp_path, n=n, batch_size=b, checkpoint_interval=checkpoint_interval, sleep=0.02, outputs="both",
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
        # at most the step in progress, the steps of one agreement period (every AGREEMENT_S seconds, so at most
        # ceil(AGREEMENT_S / 20 ms) steps between two agreements) and the step that reads it
        late = [t for t in reports[rank]["call_times"] if t > sent]
        bound = 2 + math.ceil(AGREEMENT_S / 0.02)
        assert len(late) <= bound, f"rank {rank} ran {len(late)} batches after SIGTERM (at most {bound})"
    assert abs(len(reports[0]["calls"]) - len(reports[1]["calls"])) <= 1, "both ranks stopped at the same boundary"
    first = reports[0]["calls"] + reports[1]["calls"]
    assert reports[0]["result"]["batches_committed"] == len(first), "everything processed was committed"
    assert len(first) < n // b

    outcomes, reports2 = run_generic(spec, nproc=2, attempt=2, launcher="plain")
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    second = reports2[0]["calls"] + reports2[1]["calls"]
    assert sorted(first + second) == list(range(n // b)), "each batch processed once across both runs"
    assert reports2[0]["result"]["metrics"]["sum_cls"] == n * (n - 1) // 2
    assert_exactly_once(per_batch_values(Path(spec["storage"])), n)
    assert_exactly_once(buffered_values(Path(spec["storage"])), n)


@pytest.mark.slow
@pytest.mark.parametrize(
    "failure,failing_rank",
    [
        ({"fail_batch": 7, "fail_rank": 1}, 1),
        ({"fail_batch": 6, "fail_rank": 0}, 0),
        ({"fail_init_rank": 1}, 1),
        ({"fail_checkpoint_rank": 0, "fail_checkpoint_at": 2}, 0),
        ({"bad_items": [39]}, 1),  # example 39 is in global batch 19, dealt to rank 1
    ],
    ids=["process_batch@rank1", "process_batch@rank0", "init@rank1", "on_checkpoint_start@rank0", "dataset@rank1"],
)
def test_a_failing_rank_makes_every_rank_exit_promptly_without_an_agent(tmp_path, failure, failing_rank):
    spec = job_spec(tmp_path, n=100, batch_size=2, checkpoint_interval=2, outputs="both", **failure)
    started = time.monotonic()
    outcomes, reports = run_generic(spec, nproc=2, launcher="plain", timeout=60)
    assert all(rc is not None and rc != 0 for rc, _, _ in outcomes), outcomes
    assert time.monotonic() - started < 60
    other = 1 - failing_rank
    assert reports[failing_rank]["error"]["type"] in ("RuntimeError", "ValueError")
    assert reports[other]["error"]["type"] == "WorkerFailedError"
    message = reports[other]["error"]["message"]
    assert f"rank {failing_rank}" in message and "Traceback" in message  # the failing rank's traceback is shown
    # the last commit is intact: a re-run without the failure completes, exactly once
    clean = {k: v for k, v in spec.items() if k not in failure}
    outcomes, reports = run_generic(clean, nproc=2, attempt=2, launcher="plain", timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    assert reports[0]["result"]["metrics"]["sum_cls"] == sum(range(100))
    assert_exactly_once(per_batch_values(Path(spec["storage"])), 100)
    assert_exactly_once(buffered_values(Path(spec["storage"])), 100)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_a_failed_background_record_write_on_rank_0_makes_both_ranks_raise_with_its_error(tmp_path, schedule):
    spec = job_spec(tmp_path, n=200, batch_size=2, checkpoint_interval=2, outputs="both", sleep=0.005,
                    block_records_at=20, kwargs={"schedule": schedule})
    started = time.monotonic()
    outcomes, reports = run_generic(spec, nproc=2, launcher="plain", timeout=90)
    assert all(rc is not None and rc != 0 for rc, _, _ in outcomes), outcomes
    assert time.monotonic() - started < 60
    assert "IsADirectoryError" in reports[0]["error"]["message"] + reports[0]["error"]["traceback"], reports[0]["error"]
    assert reports[1]["error"]["type"] == "WorkerFailedError", reports[1]["error"]
    message = reports[1]["error"]["message"]
    assert "rank 0" in message and "Traceback" in message and "IsADirectoryError" in message, message
    # every stage that a durable record commits was published before the ranks raised
    commits = Path(spec["storage"], "_tbp", "commits")
    latest = json.loads(max(p for p in commits.glob("*.json") if p.is_file()).read_text())
    staged = [int(d.parent.name) for d in Path(spec["storage"], "_tbp", "staging").glob("*/rank_*")]
    assert not [s for s in staged if any(a <= s < b for a, b in latest["stages"])], (staged, latest["stages"])
    # the storage is repaired (the folders in the way removed): a re-run resumes from the last durable record
    for blocked in commits.glob("*.json"):
        if blocked.is_dir():
            blocked.rmdir()
    clean = {k: v for k, v in spec.items() if k != "block_records_at"}
    outcomes, reports = run_generic(clean, nproc=2, attempt=2, launcher="plain", timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    assert reports[0]["result"]["metrics"]["sum_cls"] == sum(range(200))
    assert_exactly_once(per_batch_values(Path(spec["storage"])), 200)
    assert_exactly_once(buffered_values(Path(spec["storage"])), 200)


@pytest.mark.slow
def test_a_killed_rank_makes_the_other_exit_promptly(tmp_path):
    spec = job_spec(tmp_path, n=4000, batch_size=2, sleep=0.01, progress_file=str(tmp_path / "progress"))
    procs = spawn_ranks(2, GENERIC_JOB, json.dumps(dict(spec, attempt=1)))
    wait_for_progress(Path(spec["progress_file"]), procs)
    os.kill(procs[1].pid, signal.SIGKILL)
    started = time.monotonic()
    outcomes = wait_all(procs, timeout=60)
    assert outcomes[0][0] not in (None, 0) and time.monotonic() - started < 30
    assert read_reports(spec, 1)[0]["error"]["type"] == "WorkerLostError"


@pytest.mark.slow
def test_a_rank_killed_during_a_commit_makes_every_other_rank_exit_promptly(tmp_path):
    """3 ranks, a commit per step, one killed right after the first durable commit: rank 0 raises from the commit's
    gather while rank 2's vote may still be waiting to be sent to it; gloo never fails that send, so rank 2 used to
    wait for the collective timeout (in most runs) unless it waited for its flags' all_reduce too, which fails."""
    spec = job_spec(tmp_path, n=120, batch_size=4, sleep=0.3, checkpoint_interval=1)
    procs = spawn_ranks(3, GENERIC_JOB, json.dumps(dict(spec, attempt=1)))
    wait_for(lambda: committed_batches(spec["storage"]) > 0, 90, "the first commit")
    os.kill(procs[1].pid, signal.SIGKILL)
    outcomes = wait_all(procs, timeout=30)
    assert [rc for rc, _, _ in outcomes] == [1, -signal.SIGKILL, 1], [err[-3000:] for _, _, err in outcomes]
    assert {rank: report["error"]["type"] for rank, report in read_reports(spec, 1).items()} == {
        0: "WorkerLostError", 2: "WorkerLostError"
    }


class SignalledWhileBuilding(TorchBatchProcessor):
    def __init__(self, context):
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. the scheduler preempts while the model loads

    def process_batch(self, batch, batch_idx):
        CALLS.append(batch_idx)


def test_sigterm_while_building_the_processor_stops_before_the_first_step(tmp_path):
    CALLS.clear()
    result = torch_batch_process(SignalledWhileBuilding, list(range(40)), batch_size=4, storage_path=str(tmp_path))
    assert result.preempted and CALLS == [] and result.batches_committed == 0


@pytest.mark.slow
def test_sigterm_to_one_rank_while_building_stops_every_rank_before_its_first_step(tmp_path):
    spec = job_spec(tmp_path, n=400, batch_size=2, checkpoint_interval=5, sigterm_init_rank=1)
    outcomes, reports = run_generic(spec, nproc=2, launcher="plain", timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    for rank in (0, 1):
        assert reports[rank]["result"]["preempted"] and reports[rank]["calls"] == [], reports[rank]
    clean = {k: v for k, v in spec.items() if k != "sigterm_init_rank"}
    outcomes, reports = run_generic(clean, nproc=2, attempt=2, launcher="plain", timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    assert_exactly_once(per_batch_values(Path(spec["storage"])), 400)


@pytest.mark.slow
@pytest.mark.parametrize("signalled_rank,signum", [(0, signal.SIGTERM), (1, signal.SIGTERM), (1, signal.SIGINT)])
def test_a_signal_to_a_rank_waiting_for_the_others_to_join_preempts_every_rank(tmp_path, signalled_rank, signum):
    """The signal comes while the rank waits in the join for a peer that starts later (a preemption while the
    job opens): the rank used to die of it (default action; rank 1 then waited for rank 0, its store's host, up
    to the join deadline). Now it is a preemption like any other: every rank returns preempted=True before its
    first step, and the same command resumes."""
    import sys

    spec = job_spec(tmp_path, n=40, batch_size=2, checkpoint_interval=2, pid_dir=str(tmp_path / "pids"), attempt=1)
    port = free_port()

    def start(rank):
        env = base_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), TBP_JOIN_TIMEOUT_S="60")
        return start_process([sys.executable, str(GENERIC_JOB), json.dumps(spec)], env)

    first = start(signalled_rank)
    procs = [first]
    try:
        pid_file = tmp_path / "pids" / f"rank{signalled_rank}_restart0.pid"
        wait_for(lambda: pid_file.exists() or first.poll() is not None, 90, "the rank's call")
        time.sleep(1.5)  # the call checks its arguments and waits in the join for the other rank
        assert first.poll() is None, first.communicate()
        first.send_signal(signum)
        time.sleep(1.0)
        assert first.poll() is None, f"the signal ended the rank: {first.communicate()[1][-3000:]}"
        procs.append(start(1 - signalled_rank))
    finally:
        outcomes = wait_all(procs, timeout=90)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    reports = read_reports(spec, 1)
    for rank in (0, 1):
        result = reports[rank]["result"]
        assert result["preempted"] and not result["finished"] and reports[rank]["calls"] == [], reports[rank]
    outcomes, reports = run_generic(spec, nproc=2, attempt=2, launcher="plain", timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    assert reports[0]["result"]["finished"] and reports[0]["result"]["metrics"]["sum_cls"] == 40 * 39 // 2
    assert_exactly_once(per_batch_values(Path(spec["storage"])), 40)


@pytest.mark.slow
@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_a_rank_signalled_in_the_join_waits_for_ranks_that_never_come_only_the_heartbeat_silence(
    tmp_path, signalled_rank
):
    """A preemption signals every process; a rank still importing torch dies of it and never joins. The rank that
    got it while waiting in the join must not wait for it until the join deadline (600 s by default; here 300):
    it fails within TBP_HEARTBEAT_SILENCE_S of the signal, saying why, and writes nothing."""
    import sys

    spec = dict(job_spec(tmp_path, n=40, batch_size=2, pid_dir=str(tmp_path / "pids")), attempt=1)
    env = base_env(RANK=str(signalled_rank), WORLD_SIZE="2", LOCAL_RANK=str(signalled_rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), TBP_JOIN_TIMEOUT_S="300", TBP_HEARTBEAT_SILENCE_S="3")
    proc = start_process([sys.executable, str(GENERIC_JOB), json.dumps(spec)], env)
    try:
        pid_file = tmp_path / "pids" / f"rank{signalled_rank}_restart0.pid"
        wait_for(lambda: pid_file.exists() or proc.poll() is not None, 90, "the rank's call")
        time.sleep(1.5)  # in the join, waiting for the other rank
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
    finally:
        ((rc, _, err),) = wait_all([proc], timeout=120)
    assert rc == 1 and time.monotonic() - sent < 3 + 30, (rc, err[-3000:])
    assert "within 3 s (TBP_HEARTBEAT_SILENCE_S) of the preemption signal" in err, err[-3000:]
    assert not Path(spec["storage"]).exists(), "nothing was written"
