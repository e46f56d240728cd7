"""The job lock: a second job against a running job's storage path is refused; a killed job's lock does not block.

Every job here is a real process (``jobs/generic_job.py``). Local storage uses the OS file lock, S3 the
lease object with heartbeats and conditional writes. "Another host" is a process in its own UTS
namespace (``unshare -u``) with another host name, so its pid cannot be checked from here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from harness import (
    GENERIC_JOB,
    assert_exactly_once,
    base_env,
    committed_batches,
    committed_values,
    read_reports,
    start_process,
    storage_fs,
)

from torch_batch_process.errors import JobLockedError
from torch_batch_process.jobstore.layout import LEASE_FILE
from torch_batch_process.jobstore.store import take_job_lock
from torch_batch_process.storage.registry import open_storage as Storage

pytestmark = pytest.mark.slow

N, BATCH = 120, 2


def start_job(
    spec: dict[str, Any], attempt: int, *, ttl: float | None = None, host: str | None = None
) -> subprocess.Popen:
    """Starts the generic job as one plain process (optionally under another host name)."""
    env = base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    if ttl is not None:
        env["TBP_LEASE_TTL_S"] = str(ttl)
    command = [sys.executable, str(GENERIC_JOB), json.dumps(dict(spec, attempt=attempt))]
    if host is not None:
        command = ["unshare", "-u", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *command]
    return start_process(command, env)


def _port() -> int:
    from harness import free_port

    return free_port()


def hold(spec: dict[str, Any], attempt: int, **kwargs: Any) -> subprocess.Popen:
    """Starts the job and waits until it is held at its gate: after a commit, mid-run, lock held."""
    gate = Path(spec["gate_file"])
    gate.touch()
    Path(f"{gate}.reached").unlink(missing_ok=True)
    proc = start_job(spec, attempt, **kwargs)
    deadline = time.monotonic() + 120
    while not Path(f"{gate}.reached").exists():
        if proc.poll() is not None:
            raise AssertionError(f"job exited early: {proc.communicate()}")
        assert time.monotonic() < deadline, "the job never reached its gate"
        time.sleep(0.02)
    # Records are written in the background (pipelined commits): wait until the one of the commit before the
    # gate is durable (a listing can show a record's temporary file before it is renamed into place).
    while committed_batches(spec["storage"]) < COMMITTED_AT_GATE:
        assert time.monotonic() < deadline, "the job's first commit record never appeared"
        time.sleep(0.02)
    return proc


def open_gate(spec: dict[str, Any]) -> None:
    Path(spec["gate_file"]).unlink(missing_ok=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"job did not finish in {timeout}s: {err[-3000:]}") from None
    return proc.returncode, err


def kill9(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


COMMITTED_AT_GATE = 5


def make_spec(tmp_path: Path, storage: str, **extra: Any) -> dict[str, Any]:
    """A job of 60 batches committing every 5; while ``gate_file`` exists it holds after batch 7."""
    spec = {
        "n": N,
        "batch_size": BATCH,
        "checkpoint_interval": COMMITTED_AT_GATE,
        "storage": storage,
        "report_dir": str(tmp_path / "reports"),
        "gate_file": str(tmp_path / "gate"),
        "gate_batch": COMMITTED_AT_GATE + 2,
    }
    spec.update(extra)
    return spec


@pytest.fixture(params=["local", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_url")


def test_second_job_is_refused_while_the_first_runs(tmp_path, url):
    spec = make_spec(tmp_path, url)
    first = hold(spec, 1, ttl=5)  # B refuses at the first heartbeat it sees (every TTL / 5)
    second = start_job(spec, 2, ttl=5)
    rc, err = finish(second)
    report = read_reports(spec, 2)[0]
    assert rc != 0 and report["error"]["type"] == "JobLockedError", err[-3000:]
    message = report["error"]["message"]
    assert url in message and f"pid {first.pid}" in message and "another running job" in message
    assert report.get("calls", []) == []  # refused before any processing
    open_gate(spec)
    rc, err = finish(first)
    assert rc == 0, err[-3000:]  # the running job was not disturbed
    assert_exactly_once(committed_values(url), N)


def test_lock_of_a_job_killed_by_sigkill_does_not_block_its_resume(tmp_path, url):
    ttl = 60.0  # were the resume to wait for the lease to expire, it would wait 90 s
    spec = make_spec(tmp_path, url)
    first = hold(spec, 1, ttl=ttl)
    kill9(first)
    open_gate(spec)
    if not url.startswith("s3://"):
        assert (Path(url) / "_tbp" / "lock").exists()  # the lock file stays; the kernel released the lock
    else:
        fs, root = storage_fs(url)
        assert fs.exists(f"{root}/{LEASE_FILE}")  # the lease stays behind
    second = start_job(spec, 2, ttl=ttl)
    rc, err = finish(second)
    assert rc == 0, err[-3000:]
    result = read_reports(spec, 2)[0]["result"]
    assert result["finished"] and result["attempt"] == 2 and result["batches_skipped"] == COMMITTED_AT_GATE
    assert result["elapsed_s"] < ttl, result["elapsed_s"]  # no waiting for the lease to expire
    assert_exactly_once(committed_values(url), N)


def _can_unshare_uts() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-u", "sh", "-c", "hostname tbp-probe-host"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.s3
def test_lease_of_a_job_on_another_host_refuses_while_alive_and_expires_after_kill(tmp_path, s3_url):
    if not _can_unshare_uts():
        pytest.skip("needs unshare -u (root) to run a job under another host name")
    ttl = 3.0
    spec = make_spec(tmp_path, s3_url)
    first = hold(spec, 1, ttl=ttl, host="tbp-other-host")
    # Alive on another host: its heartbeat advances, so the second job is refused.
    second = start_job(spec, 2, ttl=ttl)
    rc, _ = finish(second)
    report = read_reports(spec, 2)[0]
    assert rc != 0 and report["error"]["type"] == "JobLockedError"
    assert "tbp-other-host" in report["error"]["message"]
    # Killed on another host: its pid cannot be checked from here, so the lease is taken over once its
    # heartbeat has been still for 1.5 TTL.
    kill9(first)
    open_gate(spec)
    third = start_job(spec, 3, ttl=ttl)
    rc, err = finish(third)
    assert rc == 0, err[-3000:]
    result = read_reports(spec, 3)[0]["result"]
    assert result["finished"] and result["batches_skipped"] == COMMITTED_AT_GATE
    assert "taking over the job lease" in err, err[-3000:]
    assert 1.5 * ttl * 0.8 <= result["elapsed_s"] < 1.5 * ttl + 15, (result["elapsed_s"], err[-3000:])
    assert_exactly_once(committed_values(s3_url), N)


@pytest.mark.s3
def test_a_paused_holder_that_lost_its_lease_never_commits_again(tmp_path, s3_url):
    """SIGSTOP (a frozen VM, a long pause) longer than the lease: another job takes over; the paused
    one, when resumed, finds its lease lost and fails before its next commit."""
    ttl = 2.0
    spec = make_spec(tmp_path, s3_url, outputs="none")
    first = hold(spec, 1, ttl=ttl)
    os.killpg(first.pid, signal.SIGSTOP)
    open_gate(spec)
    try:
        second = start_job(spec, 2, ttl=ttl)
        rc, err = finish(second)
        assert rc == 0, err[-3000:]
        assert read_reports(spec, 2)[0]["result"]["finished"]
        fs, root = storage_fs(s3_url)
        records = fs.ls(f"{root}/_tbp/commits", detail=False)
        assert len(records) == 1
        final_record = fs.cat_file(records[0])
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    rc, err = finish(first)
    report = read_reports(spec, 1)[0]
    assert rc != 0 and report["error"]["type"] == "JobLockedError", err[-3000:]
    assert "lease" in report["error"]["message"]
    assert fs.ls(f"{root}/_tbp/commits", detail=False) == records  # no commit after the takeover
    assert fs.cat_file(records[0]) == final_record


@pytest.mark.s3
def test_racing_jobs_cannot_both_take_the_lease(s3_url):
    """Conditional writes: of several jobs starting at the same instant, exactly one gets the lease."""
    contenders = 6
    barrier = threading.Barrier(contenders)
    outcomes: list[str] = []
    locks = []

    def contend() -> None:
        storage = Storage(s3_url)
        barrier.wait()
        try:
            locks.append(take_job_lock(storage))
            outcomes.append("won")
        except JobLockedError:
            outcomes.append("refused")

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert sorted(outcomes) == ["refused"] * (contenders - 1) + ["won"]
    finally:
        for lock in locks:
            lock.release()
    fs, root = storage_fs(s3_url)
    assert not fs.exists(f"{root}/{LEASE_FILE}")  # released


@pytest.mark.s3
def test_an_expired_lease_is_never_renewed(s3_url, monkeypatch):
    """After a pause longer than the TTL, another job may have taken the lease over and even released
    it; the heartbeat then must not renew (which could succeed) but mark the lease lost, so that the
    next commit is refused. The pause is simulated by moving the last renewal back in time."""
    monkeypatch.setenv("TBP_LEASE_TTL_S", "1")
    lock = take_job_lock(Storage(s3_url))
    try:
        lock.check()
        fs, root = storage_fs(s3_url)
        fs.rm(f"{root}/{LEASE_FILE}")  # the job that took over finished and released the lease
        lock._renewed -= 5.0  # this process was paused for 5 s
        deadline = time.monotonic() + 10
        while not lock._lost and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(JobLockedError, match="expired|not renewed"):
            lock.check()
        assert not fs.exists(f"{root}/{LEASE_FILE}"), "the expired lease was written again"
    finally:
        lock.release()
