"""Failing examples (DESIGN §11): on_error="skip", bisection, failures committed exactly once, max_failures,
batch_timeout, retry_failed. Real worker processes (tests/jobs/failing_job.py), real kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from harness import JOBS, base_env, spawn_ranks, storage_fs, tree_digest, wait_all

import torch_batch_process as tbp
from torch_batch_process import InvalidArgumentError, JobMismatchError, TorchBatchProcessor, tables, torch_batch_process
from torch_batch_process.launch.cli import main as cli_main
from torch_batch_process.observe.failures import read_failures
from torch_batch_process.observe.status import format_status, read_status

FAILING_JOB = JOBS / "failing_job.py"

N, BATCH = 120, 4
BAD_LOAD = [5, 41, 77]
BAD_PROCESS = [13, 14, 62, 99]
BAD = sorted(BAD_LOAD + BAD_PROCESS)
GOOD = [i for i in range(N) if i not in BAD]


def spec_for(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    spec = {
        "storage": str(tmp_path / "storage"),
        "report_dir": str(tmp_path / "reports"),
        "n": N,
        "batch_size": BATCH,
        "bad_load": BAD_LOAD,
        "bad_process": BAD_PROCESS,
        "on_error": "skip",
        "checkpoint_interval": 2,
    }
    spec.update(extra)
    return spec


def run_job(spec: dict[str, Any], world_size: int, timeout: float = 150) -> list[tuple[int | None, str, str]]:
    return wait_all(spawn_ranks(world_size, FAILING_JOB, json.dumps(spec)), timeout)


def report(spec: dict[str, Any], rank: int, attempt: int = 1) -> dict[str, Any]:
    return json.loads(Path(spec["report_dir"], f"attempt{attempt}_rank{rank}.json").read_text())


def output_counts(storage: str) -> Counter[int]:
    """How often each dataset index appears in the committed vals_<batch_idx>.json files (parts included)."""
    fs, root = storage_fs(storage)
    counts: Counter[int] = Counter()
    for path in fs.find(f"{root}/outputs"):
        if path.rsplit("/", 1)[-1].startswith("vals_"):
            counts.update(json.loads(fs.cat_file(path)))
    return counts


def check_complete(spec: dict[str, Any], result: dict[str, Any]) -> None:
    """Every good example's output exactly once, the failures file lists exactly the bad ones once, reducers
    count only the good ones."""
    storage = spec["storage"]
    assert output_counts(storage) == Counter(GOOD)
    failures = read_failures(storage)
    assert tbp.read_failures(storage) == failures  # the public name, next to read_outputs
    assert sorted(f["index"] for f in failures) == BAD
    phases = {f["index"]: f["phase"] for f in failures}
    assert {i for i, phase in phases.items() if phase == "load"} == set(BAD_LOAD)
    for f in failures:
        assert f["batch_idx"] == f["index"] // BATCH
        assert set(f) >= {"attempt", "rank", "error_type", "message", "traceback", "time"}
    assert result["finished"] and result["failed_examples"] == len(BAD)
    assert result["metrics"]["sum"] == sum(GOOD) and result["metrics"]["count"] == len(GOOD)
    assert result["metrics"]["seen"] == GOOD
    fs, root = storage_fs(storage)
    assert not fs.find(f"{root}/_tbp/staging"), "nothing left staged"


@pytest.mark.slow
def test_skip_two_ranks_records_exactly_the_bad_examples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = spec_for(tmp_path, num_workers=1)
    results = run_job(spec, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    result = report(spec, 0)["result"]
    other = report(spec, 1)["result"]
    assert (other["failed_examples"], other["metrics"]) == (result["failed_examples"], result["metrics"])
    check_complete(spec, result)
    # the parts of a split batch write under part_<first index>/: batch 3 = [12..15] with 13 and 14 bad
    outputs = Path(spec["storage"], "outputs")
    names = {p.relative_to(outputs).as_posix().split("/", 2)[2] for p in outputs.rglob("vals_3.json")}
    assert names == {"part_12/vals_3.json", "part_15/vals_3.json"}
    # tbp failures lists them
    assert cli_main(["failures", spec["storage"]]) == 0
    table = capsys.readouterr().out
    assert table.startswith(f"{len(BAD)} failed example(s)") and "cannot load item 41" in table
    assert cli_main(["failures", "--json", spec["storage"]]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == BAD and all(line["traceback"] for line in lines)
    # a finished job re-run does nothing and reports the same failures
    again = run_job(dict(spec, attempt=2), 1)
    assert again[0][0] == 0
    assert report(spec, 0, attempt=2)["result"]["failed_examples"] == len(BAD)


@pytest.mark.slow
@pytest.mark.s3
def test_skip_dynamic_on_s3(tmp_path: Path, s3_url: str) -> None:
    """The dynamic schedule, and failure records published on an object store."""
    spec = spec_for(tmp_path, storage=s3_url, schedule="dynamic")
    results = run_job(spec, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    check_complete(spec, report(spec, 0)["result"])
    fs, root = storage_fs(s3_url)
    assert not [p for p in fs.find(f"{root}/outputs") if "_tbp_failures" in p], "failure records stay out of outputs/"


@pytest.mark.slow
def test_kill_and_resume_with_another_world_size(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, sleep=0.15)
    failures_dir = Path(spec["storage"], "failures")
    procs = spawn_ranks(2, FAILING_JOB, json.dumps(spec))
    deadline = time.monotonic() + 120
    while not (failures_dir.exists() and any(failures_dir.iterdir())):  # some failures committed
        assert time.monotonic() < deadline, "no failure was ever committed"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.02)
    time.sleep(0.4)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    wait_all(procs, 30)
    committed = json.loads(sorted(Path(spec["storage"], "_tbp", "commits").glob("*.json"))[-1].read_text())
    assert not committed["finished"], "the kill came too late to test a resume"

    resumed = dict(spec, sleep=0.0, attempt=2)
    results = run_job(resumed, 3)
    assert [rc for rc, _, _ in results] == [0, 0, 0], results[0][2][-3000:]
    result = report(resumed, 0, attempt=2)["result"]
    assert result["attempt"] == 2 and result["batches_skipped"] > 0
    check_complete(resumed, result)


@pytest.mark.slow
def test_max_failures_exceeded_fails_the_job_and_resumes(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, max_failures=3)
    results = run_job(spec, 1)
    assert results[0][0] == 1
    error = report(spec, 0)["error"]
    assert error["type"] == "TooManyFailuresError"
    assert "max_failures" in error["message"] and str(Path(spec["storage"], "failures")) in error["message"]
    assert len(read_failures(spec["storage"])) <= 3  # only committed failures are listed

    fraction = dict(spec, max_failures=0.1, attempt=2)  # 10% of 120 = 12 >= 7: resumes and finishes
    results = run_job(fraction, 1)
    assert results[0][0] == 0, results[0][2][-3000:]
    check_complete(fraction, report(fraction, 0, attempt=2)["result"])


class _FailsOnSevens(TorchBatchProcessor):
    """Raises for a batch that holds an example ``i`` with ``i % 7 == 3``."""

    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        if any(int(v) % 7 == 3 for v in batch):
            raise ValueError(f"bad value in {[int(v) for v in batch]}")


def test_max_failures_exceeded_before_the_first_commit_names_the_examples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26 item 4: the limit is passed before any commit, so nothing lists the failures yet (`tbp failures`
    says 0); the error used to send the user there. It names the examples, in a short message of its own."""
    from torch_batch_process import TooManyFailuresError

    storage = str(tmp_path / "s")
    with pytest.raises(TooManyFailuresError) as raised:
        torch_batch_process(
            _FailsOnSevens, list(range(40)), batch_size=4, storage_path=storage, on_error="skip", max_failures=2,
            checkpoint_interval=5, progress=False,
        )
    message = str(raised.value)
    assert "example 3 (batch 0, ValueError: bad value in [3])" in message, message
    assert "example 10 (batch 2," in message and "example 17 (batch 4," in message, message
    assert "before committing them" in message and len(message) < 600, message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__, "no chain of the examples' tracebacks"
    assert cli_main(["failures", storage]) == 0
    assert capsys.readouterr().out.startswith("0 failed example(s)"), "indeed nothing is committed yet"


def test_an_exception_in_process_batch_of_a_one_process_job_is_logged_with_its_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 26 item 10: with one process the user's own exception is re-raised, which does not say which batch
    failed; a log line does (with several ranks the others' WorkerFailedError did already)."""
    with pytest.raises(ValueError, match="bad value"):
        torch_batch_process(_FailsOnSevens, list(range(40)), batch_size=4, storage_path=str(tmp_path / "s"),
                            progress=False)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    line = "rank 0: process_batch(batch_idx=0) raised ValueError: bad value in [0, 1, 2, 3]"
    assert any(line in m for m in errors), errors


class _HangsInBatchOne(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        pass

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            time.sleep(120)  # the watchdog interrupts it


def test_a_batch_timeout_is_logged_once_saying_the_job_stops(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The log line of a rank's failure added "the job stops (...)" to a BatchTimeoutError whose message says it
    already: the line said it twice. One clear line: the batch, the timeout, the job stopping, how to resume."""
    from torch_batch_process import BatchTimeoutError

    started = time.monotonic()
    with pytest.raises(BatchTimeoutError, match="batch 1 on rank 0 ran longer than batch_timeout=1s"):
        torch_batch_process(_HangsInBatchOne, list(range(12)), batch_size=4, storage_path=str(tmp_path / "s"),
                            batch_timeout=1.0, progress=False)
    assert time.monotonic() - started < 60
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    failure = [m for m in errors if "raised BatchTimeoutError" in m]
    assert len(failure) == 1, [r.getMessage()[:300] for r in caplog.records]
    assert failure[0].count("the job stops") == 1 and failure[0].count("resume") == 1, failure[0]
    assert "(the last commit is intact: run it again to resume)" in failure[0], failure[0]


@pytest.mark.slow
def test_max_failures_counts_all_ranks(tmp_path: Path) -> None:
    """Each rank stays under the limit on its own; together they exceed it: the closing check fails the job."""
    spec = spec_for(tmp_path, bad_load=[1], bad_process=[6], max_failures=1)  # batch 0 on rank 0, batch 1 on rank 1
    results = run_job(spec, 2)
    assert [rc for rc, _, _ in results] == [1, 1]
    for rank in (0, 1):
        assert report(spec, rank)["error"]["type"] == "TooManyFailuresError"
    assert sorted(f["index"] for f in read_failures(spec["storage"])) == [1, 6]
    # every batch is committed now: a re-run with the same limit fails again without doing any work
    again = dict(spec, attempt=2)
    assert run_job(again, 1)[0][0] == 1
    assert report(again, 0, attempt=2)["error"]["type"] == "TooManyFailuresError"


def _run_until_stuck(spec: dict[str, Any], within: float, what: str) -> list[tuple[int | None, str, str]]:
    """Runs ``spec`` on 2 ranks, whose batch or load gets stuck (it writes ``stuck_at``); asserts that every rank
    ended within ``within`` seconds of that; returns the ranks' outcomes."""
    results = run_job(spec, 2, timeout=120)
    ended = time.time()
    stuck_at = float(Path(spec["report_dir"], "stuck_at").read_text())
    print(f"{what}: every rank ended {ended - stuck_at:.1f} s after the batch or load got stuck")
    assert ended - stuck_at < within, f"ranks ended {ended - stuck_at:.1f}s after the batch or load got stuck"
    return results


@pytest.mark.slow
def test_stuck_batch_ends_every_rank(tmp_path: Path) -> None:
    timeout = 3.0
    spec = spec_for(tmp_path, bad_load=[], bad_process=[], stuck_batch=9, batch_timeout=timeout, sleep=0.05)
    results = _run_until_stuck(spec, within=timeout + 10, what=f"batch_timeout={timeout}")
    assert [rc for rc, _, _ in results] == [1, 1]
    assert report(spec, 1)["error"]["type"] == "BatchTimeoutError"  # batch 9 runs on rank 1
    assert "batch 9 on rank 1" in report(spec, 1)["error"]["message"]
    assert report(spec, 0)["error"]["type"] == "WorkerFailedError"
    assert "BatchTimeoutError" in report(spec, 0)["error"]["message"]
    for _, _, err in results:  # every rank dumped its stacks to the log
        assert "Stacks of rank" in err or "stacks of rank" in err
    assert "time.sleep(3600)" in results[1][2] or "in process_batch" in results[1][2]

    resumed = dict(spec, stuck_batch=None, attempt=2)
    results = run_job(resumed, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    assert output_counts(spec["storage"]) == Counter(range(N))


@pytest.mark.slow
@pytest.mark.parametrize(("num_workers", "schedule"), [(0, "static"), (2, "dynamic")])
def test_a_batch_whose_loading_hangs_ends_every_rank(tmp_path: Path, num_workers: int, schedule: str) -> None:
    """batch_timeout covers loading: a hang in the dataset's __getitem__ (in the main process, or in a DataLoader
    worker, which ignores SIGTERM while the job runs) fails the job promptly on every rank, never a hang."""
    timeout = 3.0
    spec = spec_for(
        tmp_path, bad_load=[], bad_process=[], stuck_load=37, batch_timeout=timeout, num_workers=num_workers,
        schedule=schedule, sleep=0.02,
    )
    results = _run_until_stuck(spec, within=timeout + 20, what=f"workers={num_workers}, a stuck load")
    assert [rc for rc, _, _ in results] == [1, 1]
    errors = [report(spec, rank)["error"] for rank in (0, 1)]
    assert sorted(e["type"] for e in errors) == ["BatchTimeoutError", "WorkerFailedError"], errors
    stuck = next(e for e in errors if e["type"] == "BatchTimeoutError")["message"]
    assert f"loading batch {37 // BATCH} on rank" in stuck, stuck
    for rc, out, err in results:  # every rank dumped its stacks to the log
        assert "Stacks of rank" in err or "stacks of rank" in err, (rc, out[-2000:], err[-3000:])

    resumed = dict(spec, stuck_load=None, attempt=2)
    results = run_job(resumed, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    assert output_counts(spec["storage"]) == Counter(range(N))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill -9", "SIGTERM twice"])
def test_a_loader_worker_stuck_in_a_load_does_not_outlive_its_rank(tmp_path: Path, how: str) -> None:
    """DataLoader workers ignore SIGTERM while the job runs and a worker stuck in a load never checks on its
    parent: when the rank ends at once (kill -9, or a second SIGTERM), the worker must end with it."""
    spec = spec_for(tmp_path, bad_load=[], bad_process=[], stuck_load=37, num_workers=2, on_error="raise")
    (proc,) = spawn_ranks(1, FAILING_JOB, json.dumps(spec))
    stuck = Path(spec["report_dir"], "stuck_at")
    deadline = time.monotonic() + 90
    while not stuck.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stuck.exists(), wait_all([proc], 5)[0][2][-3000:]
    worker = int(Path(spec["report_dir"], "stuck_pid").read_text())
    assert worker != proc.pid, "the stuck load runs in a DataLoader worker"
    if how == "kill -9":
        proc.kill()
    else:
        proc.send_signal(signal.SIGTERM)
        time.sleep(3)  # the second one, after the window in which a repeat counts as the same request
        proc.send_signal(signal.SIGTERM)
    ((rc, _, err),) = wait_all([proc], 30)
    assert rc is not None and rc != 0, err[-3000:]
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, f"the DataLoader worker {worker} outlived its rank ({how})"

    resumed = dict(spec, stuck_load=None, attempt=2)
    assert run_job(resumed, 1)[0][0] == 0
    assert output_counts(spec["storage"]) == Counter(range(N))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_dead_loader_worker_fails_the_job_even_when_skipping_and_is_no_example_s_failure(tmp_path: Path) -> None:
    """A DataLoader worker killed (the out-of-memory killer) is reported by the loader wherever the main thread is
    (its next batch, or process_batch, or a commit, through its SIGCHLD handler): it must fail the job with a clear
    error, not be bisected as if examples had failed, and a re-run resumes."""
    spec = spec_for(tmp_path, bad_load=[], bad_process=[], kill_worker_at=37, num_workers=2, sleep=0.01)
    results = run_job(spec, 2, timeout=120)
    assert [rc for rc, _, _ in results] == [1, 1], results[0][2][-3000:]
    errors = [report(spec, rank)["error"] for rank in (0, 1)]
    assert sorted(e["type"] for e in errors) == ["LoaderWorkerDiedError", "WorkerFailedError"], errors
    died = next(e for e in errors if e["type"] == "LoaderWorkerDiedError")["message"]
    assert "DataLoader worker (pid" in died and "out-of-memory" in died, died  # killed by signal / exited
    assert read_failures(spec["storage"]) == []  # no example was blamed

    resumed = dict(spec, kill_worker_at=None, attempt=2)
    results = run_job(resumed, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    assert report(resumed, 0, attempt=2)["result"]["failed_examples"] == 0
    assert output_counts(spec["storage"]) == Counter(range(N))


@pytest.mark.slow
def test_stuck_batch_blocking_the_signal_exits_the_process(tmp_path: Path) -> None:
    """A batch the watchdog cannot interrupt: the rank ends itself after the grace period, the other follows."""
    timeout = 2.0
    spec = spec_for(tmp_path, bad_load=[], bad_process=[], stuck_batch=8, stuck_mode="blocked", batch_timeout=timeout)
    results = _run_until_stuck(spec, within=timeout + 25, what=f"batch_timeout={timeout}, signal blocked")
    assert all(rc not in (0, None) for rc, _, _ in results), [rc for rc, _, _ in results]
    assert "ending the process" in results[0][2]  # batch 8 runs on rank 0
    assert list(Path(spec["storage"], "_tbp", "commits").glob("*.json")), "the commits before it stay"

    resumed = dict(spec, stuck_batch=None, attempt=2)
    results = run_job(resumed, 1)
    assert results[0][0] == 0, results[0][2][-3000:]
    assert report(resumed, 0, attempt=2)["result"]["batches_skipped"] > 0
    assert output_counts(spec["storage"]) == Counter(range(N))


def batch_files(storage: str) -> Counter[str]:
    """How often each ``[part_<i>/]vals_<batch_idx>.json`` appears in the committed outputs, whatever commit and
    rank folder holds it (a name used twice in a job's life: a batch_idx used twice)."""
    fs, root = storage_fs(storage)
    names = [p.split("/rank_", 1)[1].split("/", 1)[1] for p in fs.find(f"{root}/outputs")]
    return Counter(name for name in names if name.rsplit("/", 1)[-1].startswith("vals_"))


def batch_numbers(storage: str) -> set[int]:
    return {int(name.rsplit("/", 1)[-1][len("vals_") : -len(".json")]) for name in batch_files(storage)}


@pytest.mark.slow
def test_retry_failed_processes_only_the_failures(tmp_path: Path) -> None:
    """Issue 26 item 2: a retry's outputs go to the job's outputs/ (the documented glob sees them, once), its
    batches are numbered after every batch used before, and the failures keep their original batch."""
    spec = spec_for(tmp_path)
    assert run_job(spec, 1)[0][0] == 0
    main_outputs = output_counts(spec["storage"])
    assert main_outputs == Counter(GOOD)
    planned = N // BATCH

    # the data of most bad examples got fixed: the retry processes the 7 failures only and clears those that pass
    retry = dict(spec, bad_load=[41], bad_process=[99], retry_failed=True, attempt=2)
    results = run_job(retry, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    result = report(retry, 0, attempt=2)["result"]
    assert result["failed_examples"] == 2 and result["num_examples"] == len(BAD)
    assert result["metrics"]["seen"] == [5, 13, 14, 62, 77] and result["metrics"]["count"] == 5
    assert result["outputs_path"] == str(Path(spec["storage"], "outputs"))
    failures = read_failures(spec["storage"])
    assert sorted(f["index"] for f in failures) == [41, 99]
    for f in failures:  # the batch it failed in, in the job; the retry's batch comes after the job's
        assert f["batch_idx"] == f["index"] // BATCH and f["retry_batch_idx"] >= planned, f
    assert output_counts(spec["storage"]) == Counter(GOOD + [5, 13, 14, 62, 77]), "recovered outputs in outputs/"
    assert not Path(spec["storage"], "retries", "1", "outputs").exists()
    first_retry = batch_numbers(spec["storage"]) - set(range(planned))
    assert first_retry and min(first_retry) == planned, "the retry's batches are numbered after the job's"
    assert max(batch_files(spec["storage"]).values()) == 1, "no batch_idx used twice"

    fixed = dict(spec, bad_load=[], bad_process=[], retry_failed=True, attempt=3)
    assert run_job(fixed, 1)[0][0] == 0
    assert report(fixed, 0, attempt=3)["result"]["failed_examples"] == 0
    assert read_failures(spec["storage"]) == []
    assert output_counts(spec["storage"]) == Counter(range(N)), "each example's output once, over the job and retries"
    second_retry = batch_numbers(spec["storage"]) - set(range(planned)) - first_retry
    assert second_retry and min(second_retry) > max(first_retry), "the second retry's after the first one's"
    assert max(batch_files(spec["storage"]).values()) == 1, "no batch_idx used twice"
    cli = subprocess.run(
        [sys.executable, "-m", "torch_batch_process.launch.cli", "failures", spec["storage"]],
        capture_output=True, text=True, timeout=60, env=base_env(),
    )
    assert cli.returncode == 0 and cli.stdout.startswith("0 failed example(s)"), cli.stderr

    nothing = dict(fixed, attempt=4)  # no failure left: an empty retry
    assert run_job(nothing, 1)[0][0] == 0
    assert report(nothing, 0, attempt=4)["result"]["num_examples"] == 0


@pytest.mark.slow
def test_a_retry_killed_after_a_commit_and_resumed_with_another_world_size_publishes_every_output_once(
    tmp_path: Path,
) -> None:
    """kill -9 of a retry between a commit record and the publication of its stage, then a resume of the retry on
    another world size: every example's output exactly once in the job's outputs/, no batch_idx twice, and a
    plain re-run of the job still returns its original result."""
    spec = spec_for(tmp_path, checkpoint_interval=1)
    assert run_job(spec, 1)[0][0] == 0
    retry = dict(spec, bad_load=[], bad_process=[], retry_failed=True, kill_at_publish=2, attempt=2)
    results = run_job(retry, 1)
    assert results[0][0] == -signal.SIGKILL, results[0][2][-3000:]
    staged = list(Path(spec["storage"], "retries", "1", "_tbp", "staging").glob("*/rank_*"))
    assert staged, "the killed retry left a committed stage unpublished"
    resumed = dict(retry, kill_at_publish=None, attempt=3)
    results = run_job(resumed, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    assert report(resumed, 0, attempt=3)["result"]["failed_examples"] == 0
    assert output_counts(spec["storage"]) == Counter(range(N))
    assert max(batch_files(spec["storage"]).values()) == 1, "no batch_idx used twice"
    assert min(batch_numbers(spec["storage"]) - set(range(N // BATCH))) == N // BATCH
    assert read_failures(spec["storage"]) == []
    rerun = dict(spec, attempt=4)
    assert run_job(rerun, 1)[0][0] == 0
    assert report(rerun, 0, attempt=4)["result"]["already_finished"]
    assert output_counts(spec["storage"]) == Counter(range(N))


def final_record(storage: Path) -> dict[str, Any]:
    """The latest commit record of the job stored at ``storage``."""
    return json.loads(max(Path(storage, "_tbp", "commits").glob("*.json")).read_text())


@pytest.mark.slow
@pytest.mark.parametrize("then", ["rerun", "retry"])
def test_kill_between_the_final_record_and_result_json(tmp_path: Path, then: str) -> None:
    """The final commit record makes a job finished; result.json is a copy that the next start writes (a plain
    re-run, or a retry_failed call right away)."""
    spec = spec_for(tmp_path, kill_before_result=True)
    storage = Path(spec["storage"])
    assert run_job(spec, 1)[0][0] == -signal.SIGKILL
    record = final_record(storage)
    assert record["finished"] and not (storage / "result.json").exists()
    status = read_status(str(storage))
    assert status["state"] == "finished" and status["result_path"] is None
    assert "result.json is not written yet" in format_status(status)
    assert [f["index"] for f in read_failures(str(storage))] == BAD

    if then == "rerun":
        rerun = dict(spec, kill_before_result=False, attempt=2)
        assert run_job(rerun, 1)[0][0] == 0
        result = report(rerun, 0, attempt=2)["result"]
        assert result["already_finished"] and result["failed_examples"] == len(BAD)
        assert json.loads((storage / "result.json").read_text()) == record["result"]
        status = read_status(str(storage))
        assert status["state"] == "finished" and status["result_path"] == str(storage / "result.json")

    retry = dict(spec, kill_before_result=False, bad_load=[], bad_process=[], retry_failed=True, attempt=3)
    results = run_job(retry, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    result = report(retry, 0, attempt=3)["result"]
    assert result["num_examples"] == len(BAD) and result["failed_examples"] == 0
    assert json.loads((storage / "result.json").read_text()) == record["result"]
    assert read_failures(str(storage)) == []
    assert output_counts(str(storage)) == Counter(range(N)), "every example's output once, over the job and its retry"


@pytest.mark.slow
def test_kill_between_a_retrys_final_record_and_its_result_json(tmp_path: Path) -> None:
    """A retry killed after its final record is finished: its failures are the current ones, the next
    retry_failed call starts a new retry of them (and writes the killed one's result.json)."""
    spec = spec_for(tmp_path)
    storage = Path(spec["storage"])
    assert run_job(spec, 1)[0][0] == 0
    retry = dict(spec, bad_load=[41], bad_process=[99], retry_failed=True, kill_before_result=True, attempt=2)
    assert run_job(retry, 1)[0][0] == -signal.SIGKILL
    first = final_record(storage / "retries" / "1")
    assert first["finished"] and not (storage / "retries" / "1" / "result.json").exists()
    assert [f["index"] for f in read_failures(str(storage))] == [41, 99], "the killed retry's failures"

    again = dict(retry, bad_load=[], bad_process=[], kill_before_result=False, attempt=3)
    results = run_job(again, 2)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    result = report(again, 0, attempt=3)["result"]
    assert not result["already_finished"] and result["num_examples"] == 2 and result["failed_examples"] == 0
    assert json.loads((storage / "retries" / "1" / "result.json").read_text()) == first["result"]
    assert (storage / "retries" / "2" / "result.json").exists()
    assert read_failures(str(storage)) == []
    assert output_counts(str(storage)) == Counter(range(N)), "every example's output once, over the job and its retries"

    last = dict(again, attempt=4)  # retry 2 is finished: a new, empty retry (neither 1 nor 2 is reopened)
    assert run_job(last, 1)[0][0] == 0
    result = report(last, 0, attempt=4)["result"]
    assert not result["already_finished"] and result["num_examples"] == 0
    assert (storage / "retries" / "3" / "result.json").exists()


class _Noop(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        pass

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        pass


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"on_error": "ignore"}, "on_error"),
        ({"max_failures": 3}, "needs on_error='skip'"),
        ({"on_error": "skip", "max_failures": -1}, "max_failures"),
        ({"on_error": "skip", "max_failures": 1.5}, "fraction"),
        ({"on_error": "skip", "max_failures": True}, "max_failures"),
        ({"batch_timeout": 0}, "batch_timeout"),
        ({"batch_timeout": float("inf")}, "batch_timeout"),
        ({"batch_timeout": "10"}, "batch_timeout"),
        ({"retry_failed": 1}, "retry_failed"),
        ({"retry_failed": True, "resume": False}, "resume=False would erase it"),
    ],
)
def test_bad_failure_options_are_refused_before_any_work(tmp_path: Path, options: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        torch_batch_process(_Noop, list(range(8)), batch_size=2, storage_path=str(tmp_path / "s"), **options)
    assert not (tmp_path / "s").exists()


def test_tbp_failures_on_a_path_with_no_job_is_the_error_of_tbp_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nothing = str(tmp_path / "nothing")
    assert cli_main(["status", nothing]) == 1
    status_error = capsys.readouterr().err
    assert cli_main(["failures", nothing]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == status_error.replace("tbp status:", "tbp failures:")
    assert "no job is stored at" in captured.err and not (tmp_path / "nothing").exists()
    torch_batch_process(_Noop, list(range(8)), batch_size=2, storage_path=str(tmp_path / "s"), progress=False)
    assert read_failures(str(tmp_path / "s")) == []  # a job without failures: none, no error
    assert cli_main(["failures", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out.startswith("0 failed example(s)")


class _FailsOnThree(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        if 3 in [int(v) for v in batch]:
            raise ValueError("three")


def test_a_damaged_failures_file_is_named_by_read_failures_tbp_failures_and_retry_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch_batch_process import OutputCorruptError

    storage = str(tmp_path / "s")
    result = torch_batch_process(_FailsOnThree, list(range(8)), batch_size=2, storage_path=storage, on_error="skip")
    assert result.failed_examples == 1 and [r["index"] for r in read_failures(storage)] == [3]
    (failures_file,) = Path(storage, "failures").glob("*.jsonl")
    failures_file.write_text('{"index": 3, "message": "cut sho')  # a copy that lost its end
    with pytest.raises(OutputCorruptError, match=f"{failures_file.name}.*cannot be read.*damaged"):
        read_failures(storage)
    assert cli_main(["failures", storage]) == 1
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(OutputCorruptError, match=failures_file.name):
        torch_batch_process(_Noop, list(range(8)), batch_size=2, storage_path=storage, retry_failed=True)
    assert not Path(storage, "retries").exists() or not any(Path(storage, "retries").iterdir())


def test_a_deleted_failures_file_is_an_error_not_a_shorter_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished job's records count its failures: a file gone would make read_failures list fewer, and
    retry_failed=True forget the missing examples for good."""
    from torch_batch_process import OutputCorruptError

    storage = str(tmp_path / "s")
    dataset = list(range(12))
    result = torch_batch_process(_FailsOnThree, dataset, batch_size=2, storage_path=storage, on_error="skip")
    assert result.failed_examples == 1
    (failures_file,) = Path(storage, "failures").glob("*.jsonl")
    failures_file.unlink()
    with pytest.raises(OutputCorruptError, match="committed 1 failure record.*hold 0"):
        read_failures(storage)
    assert cli_main(["failures", storage]) == 1
    assert "committed 1 failure record" in capsys.readouterr().err
    with pytest.raises(OutputCorruptError, match="committed 1 failure record"):
        torch_batch_process(_Noop, dataset, batch_size=2, storage_path=storage, retry_failed=True)
    assert not Path(storage, "retries").exists() or not any(Path(storage, "retries").iterdir())


def test_failures_a_kill_left_staged_are_named_by_a_warning_then_published_by_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = Path(tmp_path / "s")
    torch_batch_process(_FailsOnThree, list(range(8)), batch_size=2, storage_path=str(storage), on_error="skip")
    (failures_file,) = Path(storage, "failures").glob("*.jsonl")
    stage = failures_file.stem.split("-")[0]  # <stage>-rank_<r>.jsonl
    staged = storage / "_tbp" / "staging" / stage / "rank_0"
    staged.mkdir(parents=True)
    os.rename(failures_file, staged / "_tbp_failures.jsonl")  # as if killed before this stage was published
    assert read_failures(str(storage)) == [] and "committed failure records are still staged" in caplog.text
    again = torch_batch_process(_FailsOnThree, list(range(8)), batch_size=2, storage_path=str(storage), on_error="skip")
    assert again.already_finished
    assert [r["index"] for r in read_failures(str(storage))] == [3]


class _FailsOnOdd(TorchBatchProcessor):
    """Fails every batch holding an odd example while ``_FIXED`` is empty (the 'bug' fixed before the retry)."""

    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        if not _FIXED and any(int(i) % 2 for i in self.context.batch_indices):
            raise ValueError("odd")


_FIXED: list[bool] = []


def test_a_retry_says_bucket_by_is_not_applied_and_refuses_max_batches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry dropped max_batches and bucket_by/max_tokens silently: a capped retry would forget the failures it
    left (they are refused before any work), bucketing is said by a warning."""
    options: dict[str, Any] = {
        "batch_size": 2, "storage_path": str(tmp_path / "s"), "progress": False, "bucket_by": [1, 2, 3] * 2 + [1, 2],
    }
    _FIXED.clear()
    assert torch_batch_process(_FailsOnOdd, list(range(8)), on_error="skip", **options).failed_examples > 0
    with pytest.raises(InvalidArgumentError, match="max_batches=1 cannot cap a retry_failed=True run"):
        torch_batch_process(_FailsOnOdd, list(range(8)), retry_failed=True, max_batches=1, **options)
    _FIXED.append(True)
    done = torch_batch_process(_FailsOnOdd, list(range(8)), retry_failed=True, **options)
    assert done.failed_examples == 0 and "bucket_by (and max_tokens) are not applied to a retry" in caplog.text


class _WritesUnlessOdd(_FailsOnOdd):
    """:class:`_FailsOnOdd` writing one row per example."""

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        super().process_batch(batch, batch_idx)
        self.context.write({"x": [int(i) for i in self.context.batch_indices]})


def test_a_retry_with_another_output_format_or_table_than_its_job_is_refused_before_any_work(tmp_path: Path) -> None:
    """A retry's rows are published with the job's: one called with another output_format was accepted and wrote its
    rows in the other format (read_outputs then failed on 'record shards of several formats'), one called with a
    table= wrote them into that table, away from the job's shards. Both are refused before anything is written, naming
    the argument; with the job's own, the retry runs."""
    storage = tmp_path / "s"
    options: dict[str, Any] = {"batch_size": 2, "storage_path": str(storage), "progress": False, "on_error": "skip"}
    _FIXED.clear()
    assert torch_batch_process(_WritesUnlessOdd, list(range(8)), **options).failed_examples == 4
    _FIXED.append(True)
    try:
        before = tree_digest(storage)
        for other, needle in (
            ({"output_format": "jsonl"}, r"output_format: the job's 'parquet', this call's 'jsonl'"),
            ({"table": tables.delta(str(tmp_path / "t"))}, r"table: the job's None, this call's \{'format': 'delta'"),
        ):
            with pytest.raises(JobMismatchError, match=needle):
                torch_batch_process(_WritesUnlessOdd, list(range(8)), retry_failed=True, **options, **other)
            assert tree_digest(storage) == before and not (tmp_path / "t").exists()
        assert torch_batch_process(_WritesUnlessOdd, list(range(8)), retry_failed=True, **options).failed_examples == 0
        assert tbp.read_outputs(storage).column("x").to_pylist() == list(range(8))
    finally:
        _FIXED.clear()



_LOADER_WORKERS_STARTING = """
import errno, json, multiprocessing, os, signal, sys
from multiprocessing.context import ForkContext
from torch.utils.data._utils import signal_handling
from torch_batch_process import TorchBatchProcessor, torch_batch_process

storage, flag, mode = sys.argv[1:4]
torch_set = signal_handling._set_worker_signal_handlers


def once():
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def worker_starting(*args):
    # In a starting DataLoader worker, after torch set its SIGTERM handler and before the worker_init_fn: a
    # preemption's SIGTERM to the job's process group (Kubernetes, Slurm) arrives now, once.
    torch_set(*args)
    if once():
        os.killpg(0, signal.SIGTERM)


class SecondForkFails(ForkContext):  # the second worker's fork fails, as at a container's process limit
    class Process(ForkContext.Process):
        def start(self):
            if multiprocessing.active_children() and once():
                raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
            super().start()


kwargs = {"num_workers": 2}
if mode == "sigterm":
    signal_handling._set_worker_signal_handlers = worker_starting
elif mode == "fork fails":
    kwargs["multiprocessing_context"] = SecondForkFails()


class Rows(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        self.context.write({"value": batch})


result = torch_batch_process(Rows, list(range(24)), batch_size=4, checkpoint_interval=1, storage_path=storage,
                             dataloader_kwargs=kwargs, progress=False)
print(json.dumps({"preempted": result.preempted, "finished": result.finished}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("what", ["sigterm", "fork fails"])
def test_loader_workers_that_meet_trouble_while_they_start_neither_fail_nor_hang_the_job(tmp_path: Path, what: str):
    """While a rank's DataLoader workers start: a preemption's SIGTERM to the job's process group that reaches a
    worker after torch set its own SIGTERM handler (which ends the worker) and before the library's worker_init_fn
    must not kill it: the rank commits and returns preempted=True (it failed with LoaderWorkerDiedError, or hung
    at exit). A worker whose fork fails fails the job with that error, promptly: the workers started before it are
    ended (they ignore SIGTERM, so the interpreter's exit waited for them forever). A re-run finishes, each example
    once."""
    storage, flag = str(tmp_path / "storage"), str(tmp_path / "flag")

    def run(mode: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _LOADER_WORKERS_STARTING, storage, flag, mode], env=base_env(),
            capture_output=True, text=True, timeout=120, start_new_session=True,  # the group is the job's alone
        )

    first = run(what)
    assert Path(flag).exists(), "the trouble happened"
    if what == "sigterm":
        assert first.returncode == 0, first.stderr[-3000:]
        assert json.loads(first.stdout.strip().splitlines()[-1]) == {"preempted": True, "finished": False}
    else:
        assert first.returncode == 1, first.stderr[-3000:]
        assert "[Errno 11] Resource temporarily unavailable" in first.stderr, first.stderr[-3000:]
    second = run("plain")
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads(second.stdout.strip().splitlines()[-1]) == {"preempted": False, "finished": True}
    values = tbp.read_outputs(storage)["value"].to_pylist()
    assert sorted(values) == list(range(24)), values
