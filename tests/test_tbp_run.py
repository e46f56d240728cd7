"""``tbp run CONFIG.yaml`` end to end: hyperparameters and storage reach the job; a killed worker is restarted
by torchrun and the job resumes from its last commit, every example exactly once."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import yaml
from harness import (
    GENERIC_JOB,
    assert_exactly_once,
    base_env,
    commit_records,
    committed_values,
    job_spec,
    kill_tree,
    read_pid,
    read_reports,
    start_process,
    tbp_cmd,
    wait_for,
)

pytestmark = pytest.mark.slow

HPARAMS = {"model": "tiny", "threshold": 0.5, "layers": {"type": "const", "val": [1, 2]}}


@pytest.mark.timeout(300)
def test_tbp_run_hparams_storage_and_a_worker_killed_once_is_restarted_exactly_once(tmp_path):
    n = 200
    spec = job_spec(
        tmp_path,
        n=n,
        batch_size=2,
        checkpoint_interval=3,
        sleep=0.05,
        pid_dir=str(tmp_path / "pids"),
        report_env=["TBP_JOB_NAME", "TBP_TEST_MARK"],
        attempt=1,
    )
    del spec["storage"]  # the job gets its storage from the config, through the environment
    config = {
        "name": "tbp-run-test",
        "entrypoint": ["python3", str(GENERIC_JOB), json.dumps(spec)],
        "resources": {"slots_per_trial": 2},
        "checkpoint_storage": {"type": "local", "path": "storage"},  # relative to the config's directory
        "max_restarts": 2,
        "hyperparameters": HPARAMS,
        "environment": {"variables": {"TBP_TEST_MARK": 42}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    storage = tmp_path / "storage"

    proc = start_process(tbp_cmd("run", str(path)), base_env())
    try:
        wait_for(lambda: commit_records(storage) or proc.poll() is not None, 120, "the first commit")
        assert proc.poll() is None, "the job ended before a worker could be killed"
        victim = read_pid(tmp_path / "pids", 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)

    assert proc.returncode == 0, err[-4000:]
    assert "[tbp] job 'tbp-run-test' from" in err and "2 worker(s) per node on 1 node(s), max_restarts 2" in err
    reports = read_reports(spec, 1)  # written by the restarted workers
    assert sorted(reports) == [0, 1]
    expected_hparams = {"model": "tiny", "threshold": 0.5, "layers": [1, 2]}
    for report in reports.values():
        assert report["restart"] >= 1, "the workers were not restarted"
        assert report["hparams"] == expected_hparams
        assert report["env"] == {"TBP_JOB_NAME": "tbp-run-test", "TBP_TEST_MARK": "42"}
        result = report["result"]
        assert result["storage_path"] == str(storage) and result["finished"] and not result["preempted"]
        assert result["batches_skipped"] > 0  # it resumed from a commit
    # The log says which attempt, which torchrun restart, and from which batch the job resumes.
    assert re.search(r"\[rank 0\] .*job 'tbp-run-test' attempt 2 \(torchrun restart 1\): resuming at batch \d+", err), (
        err[-4000:]
    )
    assert_exactly_once(committed_values(storage), n)
