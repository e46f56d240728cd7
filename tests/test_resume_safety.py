"""Resume safety: a finished job is repaired before its result is returned, damaged progress is refused,
jobs are told apart by their fingerprint, and processor states survive a world-size change."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from harness import (
    GENERIC_JOB,
    JOBS,
    assert_exactly_once,
    base_env,
    job_spec,
    per_batch_values,
    run_generic,
    run_process,
    spawn_ranks,
    tree_digest,
    wait_all,
)

from torch_batch_process import (
    CheckpointCorruptError,
    JobMismatchError,
    TorchBatchProcessor,
    torch_batch_process,
)
from torch_batch_process.observe.status import read_status


class Writer(TorchBatchProcessor):
    """Writes one file per batch and one in on_finish(); sends itself SIGTERM at ``stop_at``."""

    stop_at: int | None = None

    def __init__(self, context):
        self.context = context
        self.total = context.wrap_reducer(lambda values: sum(values), name="total")

    def process_batch(self, batch, batch_idx):
        values = [int(v) for v in batch]
        self.total.update(sum(values))
        with self.context.upload_path() as path:
            (path / f"batch_{batch_idx}.json").write_text(json.dumps(values))
        if batch_idx == type(self).stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_finish(self):
        with self.context.upload_path() as path:
            (path / "finish.txt").write_text("done")


class Stopping(Writer):
    stop_at = 3


Stopping.__qualname__ = "Writer"


def _committed(storage: Path) -> list[str]:
    return sorted(p.name for p in (storage / "outputs").rglob("*") if p.is_file())


def test_a_finished_job_killed_while_publishing_is_published_before_its_result_is_returned(tmp_path):
    storage = tmp_path / "store"
    first = torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=str(storage))
    assert first.finished
    # The state a kill leaves between the final record (and result.json) and the publication of the last
    # stage: the files of the last commit are still staged.
    last = sorted((storage / "outputs").iterdir())[-1]
    number = last.name.split("_", 1)[1]
    staged = storage / "_tbp" / "staging" / number
    staged.mkdir(parents=True, exist_ok=True)
    shutil.move(str(last / "rank_0"), str(staged / "rank_0"))
    last.rmdir()
    assert "finish.txt" not in _committed(storage)
    status = read_status(str(storage))
    assert status["state"] == "unpublished" and status["unpublished_commits"] == [int(number)]

    again = torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=str(storage))
    assert again.already_finished and again.metrics == {"total": sum(range(40))}
    files = _committed(storage)
    assert "finish.txt" in files and sorted(f for f in files if f.startswith("batch_")) == sorted(
        f"batch_{g}.json" for g in range(10)
    )
    assert not any((storage / "_tbp" / "staging").glob("*/rank_*"))
    assert read_status(str(storage))["state"] == "finished"


@pytest.mark.slow
def test_kill_as_soon_as_the_result_appears_then_rerun_gives_every_output_once(tmp_path):
    spec = job_spec(tmp_path, n=400, batch_size=4, checkpoint_interval=5, outputs="both")
    procs = spawn_ranks(2, GENERIC_JOB, json.dumps(dict(spec, attempt=1)))
    result = Path(spec["storage"]) / "result.json"
    deadline = time.monotonic() + 120
    while not result.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.001)
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    wait_all(procs, timeout=30)
    outcomes, reports = run_generic(spec, nproc=2, attempt=2, launcher="plain")
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    assert reports[0]["result"]["metrics"]["sum_cls"] == sum(range(400))
    assert_exactly_once(per_batch_values(Path(spec["storage"])), 400)


def test_missing_commit_records_are_refused_and_nothing_changes(tmp_path):
    storage = tmp_path / "store"
    result = torch_batch_process(
        Stopping, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage)
    )
    assert result.preempted and _committed(storage)
    shutil.rmtree(storage / "_tbp" / "commits")  # a partial copy: outputs and job file, no records
    before = tree_digest(storage)
    with pytest.raises(CheckpointCorruptError, match="commit records") as info:
        torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    assert "resume=False" in str(info.value)
    assert tree_digest(storage) == before, "nothing changed"
    fresh = torch_batch_process(Writer, list(range(40)), batch_size=4, storage_path=str(storage), resume=False)
    assert fresh.finished and fresh.batches_skipped == 0


def test_a_missing_state_file_is_refused_at_start(tmp_path):
    storage = tmp_path / "store"
    torch_batch_process(Stopping, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    state_file = next((storage / "_tbp" / "states").rglob("*.pt"))
    state_file.unlink()
    before = tree_digest(storage)
    with pytest.raises(CheckpointCorruptError, match="state file"):
        torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    assert tree_digest(storage) == before


class Other:  # a namespace standing for another module
    class Writer(Writer):
        pass


def test_the_fingerprint_tells_apart_classes_of_other_modules_and_other_dataset_types(tmp_path):
    import types

    storage = str(tmp_path / "store")
    torch_batch_process(Writer, list(range(20)), batch_size=4, storage_path=storage)
    module = types.ModuleType("another_module")
    clone = type("Writer", (Writer,), {"__module__": "another_module", "__qualname__": "Writer"})
    module.Writer = clone
    with pytest.raises(JobMismatchError, match="processor"):
        torch_batch_process(clone, list(range(20)), batch_size=4, storage_path=storage)
    with pytest.raises(JobMismatchError, match="dataset_type"):
        torch_batch_process(Writer, tuple(range(20)), batch_size=4, storage_path=storage)
    assert torch_batch_process(Writer, list(range(20)), batch_size=4, storage_path=storage).already_finished


def _python_c(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=base_env(**env), capture_output=True, text=True, timeout=120
    )


_INTERACTIVE_JOB = """
from torch_batch_process import TorchBatchProcessor, torch_batch_process
class P(TorchBatchProcessor):
    def process_batch(self, batch, batch_idx):
        pass
result = torch_batch_process(P, list(range(8)), batch_size=4, progress=False, tensorboard=False{extra})
print("storage", result.storage_path)
"""


def test_interactive_use_needs_a_storage_path_or_job_name(tmp_path):
    proc = _python_c(_INTERACTIVE_JOB.format(extra=""), tmp_path)
    assert proc.returncode != 0 and "storage_path is required in an interactive session" in proc.stderr
    assert not (tmp_path / "tbp_runs").exists(), "nothing was written"
    proc = _python_c(_INTERACTIVE_JOB.format(extra=", job_name='embeddings'"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(str(Path("tbp_runs") / "embeddings"))
    proc = _python_c(_INTERACTIVE_JOB.format(extra=""), tmp_path, TBP_STORAGE_PATH=str(tmp_path / "env_store"))
    assert proc.returncode == 0, proc.stderr


_SAME_STEM_JOB = """
import json, sys
from torch_batch_process import TorchBatchProcessor, torch_batch_process
class P(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.seen = context.wrap_reducer(lambda values: sorted(sum(values, [])), name="seen")
    def process_batch(self, batch, batch_idx):
        self.seen.update([int(v) for v in batch])
result = torch_batch_process(P, [{scale} * i for i in range(10)], batch_size=5, progress=False, tensorboard=False)
print(json.dumps({{"seen": result.metrics["seen"], "already_finished": result.already_finished}}))
"""


def _run_script(cwd: Path, *command: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *command], cwd=cwd, env=base_env(**env), capture_output=True, text=True, timeout=120
    )


def _run_forked_script(cwd: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT`` from ``cwd``, forked by the suite's fork server (torch already imported: a test whose claim
    is not how the interpreter starts; see the next test for ``python -m`` and moved checkouts, executed)."""
    return run_process([sys.executable, script], base_env(**env), 120, cwd=cwd)


def test_a_job_started_by_another_script_of_the_same_name_is_refused_before_any_write(tmp_path):
    """Issue 26 item 1: a/job.py and b/job.py, started from one folder, share ./tbp_runs/job by default; the
    processor (__main__.P) and the dataset's length are the same, so the fingerprint cannot tell them apart. The
    second used to return the first one's result (already_finished=True, the first one's rows)."""
    for name, scale in (("a", 1), ("b", 100)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.py").write_text(_SAME_STEM_JOB.format(scale=scale))
    first = _run_forked_script(tmp_path, "a/job.py")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.splitlines()[-1]) == {"seen": list(range(10)), "already_finished": False}
    stored = tree_digest(tmp_path / "tbp_runs" / "job")
    second = _run_forked_script(tmp_path, "b/job.py")
    assert second.returncode != 0 and second.stdout == "", second.stdout
    assert "JobMismatchError" in second.stderr
    message = second.stderr.strip().splitlines()[-1]
    for needle in (str(tmp_path / "a" / "job.py"), str(tmp_path / "b" / "job.py"), "storage_path", "job_name",
                   "resume=False"):
        assert needle in message, message
    assert tree_digest(tmp_path / "tbp_runs" / "job") == stored, "nothing stored was changed"
    job_file = json.loads((tmp_path / "tbp_runs" / "job" / "_tbp" / "job.json").read_text())
    assert job_file["script"] == str((tmp_path / "a" / "job.py").resolve())

    again = _run_forked_script(tmp_path, "a/job.py")  # the first script still gets its own job back
    assert json.loads(again.stdout.splitlines()[-1]) == {"seen": list(range(10)), "already_finished": True}
    fresh = _run_forked_script(tmp_path, "b/job.py", TBP_JOB_NAME="b_job")  # the fix the message names
    expected = {"seen": [100 * i for i in range(10)], "already_finished": False}
    assert json.loads(fresh.stdout.splitlines()[-1]) == expected
    adopted = _run_forked_script(tmp_path, "b/job.py", TBP_ALLOW_SCRIPT_CHANGE="1")
    assert adopted.returncode == 0 and "resuming it from" in adopted.stderr, adopted.stderr[-2000:]


def test_the_same_script_moved_with_its_checkout_or_run_as_a_module_resumes_its_job(tmp_path):
    """The script's path from the working directory identifies it too: a moved checkout (or a cluster that copies
    the code to a new folder for each run) resumes; ``python -m`` runs the same file as ``python``. A job file
    written before scripts were recorded resumes from any script."""
    checkout = tmp_path / "checkout"
    (checkout / "pkg").mkdir(parents=True)
    (checkout / "pkg" / "__init__.py").write_text("")
    (checkout / "pkg" / "job.py").write_text(_SAME_STEM_JOB.format(scale=1))
    storage = str(tmp_path / "explicit_storage")
    first = _run_script(checkout, "pkg/job.py", TBP_STORAGE_PATH=storage)
    assert json.loads(first.stdout.splitlines()[-1])["already_finished"] is False, first.stderr[-3000:]
    as_module = _run_script(checkout, "-m", "pkg.job", TBP_STORAGE_PATH=storage)
    assert json.loads(as_module.stdout.splitlines()[-1])["already_finished"] is True, as_module.stderr[-3000:]
    moved = tmp_path / "moved"
    shutil.move(str(checkout), str(moved))
    again = _run_script(moved, "pkg/job.py", TBP_STORAGE_PATH=storage)
    assert json.loads(again.stdout.splitlines()[-1])["already_finished"] is True, again.stderr[-3000:]

    job_file = Path(storage, "_tbp", "job.json")
    older = json.loads(job_file.read_text())
    older.pop("script", None), older.pop("workdir", None)  # as written before this check existed
    job_file.write_text(json.dumps(older))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "job.py").write_text(_SAME_STEM_JOB.format(scale=1))
    other = _run_script(tmp_path / "other", "job.py", TBP_STORAGE_PATH=storage)
    assert json.loads(other.stdout.splitlines()[-1])["already_finished"] is True, other.stderr[-3000:]


@pytest.mark.slow
def test_processor_states_are_merged_on_a_resume_with_another_world_size(tmp_path):
    spec = {"n": 120, "batch_size": 4, "storage": str(tmp_path / "store"), "report_dir": str(tmp_path / "reports")}
    job = JOBS / "stateful_job.py"

    def reports(attempt: int) -> dict[int, dict]:
        return {
            int(p.stem.rsplit("rank", 1)[1]): json.loads(p.read_text())
            for p in Path(spec["report_dir"]).glob(f"attempt{attempt}_rank*.json")
        }

    outcomes = wait_all(spawn_ranks(2, job, json.dumps(dict(spec, attempt=1, sigterm_at=10))), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    first = reports(1)
    assert first[0]["result"]["preempted"]
    committed = first[0]["result"]["batches_committed"]
    assert committed == first[0]["count"] + first[1]["count"]

    outcomes = wait_all(spawn_ranks(3, job, json.dumps(dict(spec, attempt=2))), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0, 0], outcomes
    second = reports(2)
    for rank in range(3):  # every new rank received the merged state of the two earlier ranks
        assert second[rank]["loaded"] == {"count": committed, "merged_from": 2}
    assert sum(second[rank]["count"] for rank in range(3)) == 120 // 4, "the counters survived the world-size change"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_the_commit_record_is_a_prompt_error_not_a_hang(tmp_path):
    storage = tmp_path / "store"
    torch_batch_process(Stopping, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    record = sorted((storage / "_tbp" / "commits").glob("*.json"))[-1]
    record.unlink()
    os.mkfifo(record)  # reading it would wait for a writer forever
    started = time.monotonic()
    with pytest.raises(CheckpointCorruptError, match="not a regular file") as info:
        torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    assert time.monotonic() - started < 30 and record.name in str(info.value) and "resume=False" in str(info.value)
    fresh = torch_batch_process(Writer, list(range(40)), batch_size=4, storage_path=str(storage), resume=False)
    assert fresh.finished and fresh.batches_skipped == 0


@pytest.mark.parametrize(
    "damage",
    [
        "state file cut short",
        "state file zeroed",
        "record without a key",
        "record of the wrong type",
        "job file",
        "a folder in place of the attempt file",
    ],
)
def test_damaged_progress_is_refused_with_what_to_do(tmp_path, damage):
    storage = tmp_path / "store"
    torch_batch_process(Stopping, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    state_file = next((storage / "_tbp" / "states").rglob("*.pt"))
    record = sorted((storage / "_tbp" / "commits").glob("*.json"))[-1]
    if damage == "state file cut short":
        state_file.write_bytes(state_file.read_bytes()[:30])
    elif damage == "state file zeroed":
        state_file.write_bytes(bytes(state_file.stat().st_size))
    elif damage == "record without a key":
        value = json.loads(record.read_text())
        del value["committed"]
        record.write_text(json.dumps(value))
    elif damage == "record of the wrong type":
        record.write_text("[1, 2, 3]")
    elif damage == "a folder in place of the attempt file":
        (storage / "_tbp" / "attempt.json").unlink()
        (storage / "_tbp" / "attempt.json").mkdir()
    else:
        (storage / "_tbp" / "job.json").write_text('{"format": 1}')
    with pytest.raises(CheckpointCorruptError) as info:
        torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    assert "resume=False" in str(info.value) and "new storage_path" in str(info.value), str(info.value)
    fresh = torch_batch_process(Writer, list(range(40)), batch_size=4, storage_path=str(storage), resume=False)
    assert fresh.finished and fresh.batches_skipped == 0


def test_a_committed_output_folder_deleted_by_hand_is_refused_at_resume_and_only_warned_about_once_finished(
    tmp_path, caplog
):
    storage = tmp_path / "store"
    result = torch_batch_process(
        Stopping, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage)
    )
    assert result.preempted
    folders = sorted((storage / "outputs").glob("commit_*"))
    assert len(folders) >= 2
    shutil.rmtree(folders[1])
    before = tree_digest(storage)
    with pytest.raises(CheckpointCorruptError, match="committed output folder") as info:
        torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    assert folders[1].name in str(info.value) and "resume=False" in str(info.value)
    assert tree_digest(storage) == before, "nothing changed"

    other = tmp_path / "finished"
    torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(other))
    shutil.rmtree(sorted((other / "outputs").glob("commit_*"))[0])
    again = torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(other))
    assert again.already_finished
    assert "committed output folder(s) are missing" in caplog.text


def test_output_folders_and_record_names_the_job_did_not_write_are_left_alone(tmp_path, caplog):
    """A ``commit_<s>`` folder that no record covers is named in a warning (globs of outputs/ would see it) and
    left; a file in the records' folder whose name is not a record's (``99.json``) is not read as one."""
    storage = tmp_path / "store"
    assert torch_batch_process(
        Stopping, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage)
    ).preempted
    stray = storage / "outputs" / "commit_98" / "rank_0" / "batch_999.json"
    stray.parent.mkdir(parents=True)
    stray.write_text("[]")
    (storage / "_tbp" / "commits" / "99.json").write_text("{not a record")
    result = torch_batch_process(
        Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage)
    )
    assert result.finished and result.batches_skipped > 0
    assert "not covered by the job's commit records" in caplog.text and "commit_98" in caplog.text
    assert stray.exists()
    stray.unlink()
    counts = Counter()
    for path in (storage / "outputs").rglob("batch_*.json"):
        counts.update(json.loads(path.read_text()))
    assert_exactly_once(counts, 40)
    assert result.metrics["total"] == sum(range(40))


class RowWriter(TorchBatchProcessor):
    """Writes one record row per example; raises at batch ``fail_at`` (its committed rows stay in segments)."""

    fail_at: int | None = None

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        if batch_idx == type(self).fail_at:
            raise RuntimeError("failing on purpose")
        self.context.write({"value": [int(v) for v in batch]})


class FailingRowWriter(RowWriter):
    fail_at = 9


class FailingAtOnce(RowWriter):
    fail_at = 8  # the first batch of a resume after FailingRowWriter: no commit


FailingRowWriter.__qualname__ = FailingAtOnce.__qualname__ = "RowWriter"


def _cut(path: Path, keep: float) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


@pytest.mark.parametrize("damage", ["log cut short", "log emptied", "log deleted", "segment file deleted"])
def test_committed_record_segments_lost_are_refused_not_resumed_with_rows_missing(tmp_path, damage):
    """A failure leaves the committed rows of a rank in its segments (a log on local storage, a file per commit on
    object stores) until the next start rolls them into a shard. When they are gone or cut short, a torn tail and a
    loss look alike in the log itself; the commit record's count of the rows in segments tells them apart, so the
    resume is refused instead of finishing the job with committed rows missing."""
    import fsspec

    from torch_batch_process import read_outputs

    url = str(tmp_path / "store") if damage.startswith("log") else f"memory://tbp-{tmp_path.name}/job"
    run = dict(batch_size=4, checkpoint_interval=2, storage_path=url, progress=False)
    with pytest.raises(RuntimeError, match="failing on purpose"):
        torch_batch_process(FailingRowWriter, list(range(80)), **run)
    fs, root = fsspec.core.url_to_fs(url)
    segments = sorted(fs.ls(f"{root}/_tbp/segments", detail=False))
    assert segments, "the committed rows are in segments"
    if damage == "log cut short":
        _cut(Path(segments[0]), 0.6)
    elif damage == "log emptied":
        _cut(Path(segments[0]), 0)
    else:
        fs.rm(segments[0])
    with pytest.raises(CheckpointCorruptError, match="rank 0") as info:
        torch_batch_process(RowWriter, list(range(80)), **run)
    assert "committed record rows" in str(info.value) and "resume=False" in str(info.value), str(info.value)
    assert not fs.exists(f"{root}/result.json"), "the job did not finish"
    fresh = torch_batch_process(RowWriter, list(range(80)), **run, resume=False)
    assert fresh.finished and fresh.batches_skipped == 0
    assert read_outputs(url).column("value").to_pylist() == list(range(80))


def test_record_segments_left_by_a_failure_resume_exactly_once(tmp_path):
    """The undamaged counterpart: the rows counted in the record are found, rolled over, and the job finishes
    with every row once, also when the start that rolled them is followed by another before any commit."""
    from torch_batch_process import read_outputs

    run = dict(batch_size=4, checkpoint_interval=2, storage_path=str(tmp_path / "store"), progress=False)
    with pytest.raises(RuntimeError, match="failing on purpose"):
        torch_batch_process(FailingRowWriter, list(range(80)), **run)
    with pytest.raises(RuntimeError, match="failing on purpose"):  # rolls the leftovers, then fails at once
        torch_batch_process(FailingAtOnce, list(range(80)), **run)
    assert torch_batch_process(RowWriter, list(range(80)), **run).finished
    assert read_outputs(run["storage_path"]).column("value").to_pylist() == list(range(80))


@pytest.mark.parametrize("damage", ["a preempted job's shard deleted", "a failed job's segment log cut short"])
def test_reading_a_stopped_job_with_committed_rows_lost_is_an_error_not_a_short_table(tmp_path, damage):
    """read_outputs of a job that is not finished compares the rows found (published shards and the committed rows
    still in segments) with its latest record's count, as it does for a finished job."""
    from torch_batch_process import OutputCorruptError, iter_outputs, read_outputs

    storage = tmp_path / "store"
    run = dict(batch_size=4, checkpoint_interval=2, storage_path=str(storage), progress=False)
    if damage.startswith("a preempted"):
        with_stop = type("RowWriter", (RowWriter,), {"process_batch": _stopping_rows})
        assert torch_batch_process(with_stop, list(range(80)), **run).preempted
        assert len(read_outputs(storage)) == 24
        next((storage / "outputs").rglob("*.parquet")).unlink()
    else:
        with pytest.raises(RuntimeError, match="failing on purpose"):
            torch_batch_process(FailingRowWriter, list(range(80)), **run)
        assert len(read_outputs(storage)) == 32, "the committed rows are read from the segment log"
        _cut(next((storage / "_tbp" / "segments").glob("*.arrows")), 0.6)
    with pytest.raises(OutputCorruptError, match="committed 2[4|8]|committed 32") as info:
        read_outputs(storage)
    assert "missing" in str(info.value)
    with pytest.raises(OutputCorruptError, match="missing"):
        next(iter_outputs(storage))


def _stopping_rows(self, batch, batch_idx):
    RowWriter.process_batch(self, batch, batch_idx)
    if batch_idx == 5:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_shard_whose_compressed_bytes_are_damaged_is_named_in_the_error(tmp_path):
    """pyarrow reports a damaged compressed page as a plain OSError naming no file; the read names the shard."""
    import pyarrow.parquet as pq

    from torch_batch_process import OutputCorruptError, iter_outputs, read_outputs

    storage = tmp_path / "store"
    torch_batch_process(RowWriter, list(range(80)), batch_size=4, storage_path=str(storage), progress=False)
    shard = next((storage / "outputs").rglob("*.parquet"))
    chunk = pq.read_metadata(shard).row_group(0).column(1)  # "value": index is column 0
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    end = start + chunk.total_compressed_size
    middle = (start + end) // 2
    data = bytearray(shard.read_bytes())
    data[middle:end] = bytes(end - middle)  # the page's compressed bytes, not its header
    shard.write_bytes(bytes(data))
    for read in (read_outputs, lambda path: next(iter_outputs(path))):
        with pytest.raises(OutputCorruptError, match="cannot be read") as info:
            read(storage)
        assert shard.name in str(info.value)


class NoiseWriter(TorchBatchProcessor):
    """Writes one random float per example (incompressible: snappy keeps the bytes as they are)."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        import random

        noise = random.Random(batch_idx)
        self.context.write({"value": [noise.random() for _ in batch]})


def test_a_byte_changed_inside_a_shard_page_is_an_error_not_a_wrong_value(tmp_path):
    """Shards carry a CRC per page: a byte changed in storage (a bit flip in a value, which decodes fine) is found by
    the read side and named, instead of coming back as a different number."""
    import pyarrow.parquet as pq

    from torch_batch_process import OutputCorruptError, iter_outputs, read_outputs

    storage = tmp_path / "store"
    torch_batch_process(NoiseWriter, list(range(80)), batch_size=80, storage_path=str(storage), progress=False)
    good = read_outputs(storage).column("value").to_pylist()
    shard = next((storage / "outputs").rglob("*.parquet"))
    chunk = pq.read_metadata(shard).row_group(0).column(1)  # "value": index is column 0
    end = chunk.data_page_offset + chunk.total_compressed_size
    data = bytearray(shard.read_bytes())
    data[end - 5] ^= 0x01  # a bit of the page's last value
    shard.write_bytes(bytes(data))
    unchecked = pq.ParquetFile(shard).read().column("value").to_pylist()
    assert unchecked != good and len(unchecked) == len(good)  # without the checksum: a wrong value, no error
    for read in (read_outputs, lambda path: next(iter_outputs(path))):
        with pytest.raises(OutputCorruptError, match="cannot be read.*CRC") as info:
            read(storage)
        assert shard.name in str(info.value)


def test_a_finished_job_with_its_state_files_gone_still_reports_its_stored_result(tmp_path, caplog):
    """A finished job's result is in its final record: state files deleted afterwards (a clean-up, a partial copy)
    are warned about, not a refusal to report it; a job that is not finished still refuses (see above)."""
    storage = tmp_path / "store"
    first = torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    for state in (storage / "_tbp" / "states").rglob("*.pt"):
        state.unlink()
    before = tree_digest(storage)
    again = torch_batch_process(Writer, list(range(40)), batch_size=4, checkpoint_interval=2, storage_path=str(storage))
    assert again.already_finished and again.metrics == first.metrics == {"total": sum(range(40))}
    assert "state file(s) that are missing" in caplog.text
    assert tree_digest(storage) == before, "nothing changed"


def test_a_damaged_record_segment_file_is_named_at_resume_not_a_bare_pyarrow_error(tmp_path):
    """On object stores each commit's rows are a segment file; one that does not decode (cut short, garbled) stops the
    resume's roll-over with an error naming it and what to do (pyarrow's own says "Not an Arrow file")."""
    import fsspec

    from torch_batch_process import OutputCorruptError

    url = f"memory://tbp-{tmp_path.name}/job"
    run = dict(batch_size=4, checkpoint_interval=2, storage_path=url, progress=False)
    with pytest.raises(RuntimeError, match="failing on purpose"):
        torch_batch_process(FailingRowWriter, list(range(80)), **run)
    fs, root = fsspec.core.url_to_fs(url)
    segment = sorted(fs.ls(f"{root}/_tbp/segments", detail=False))[1]
    whole = fs.cat(segment)
    middle = len(whole) // 2  # garbled: pyarrow's plain OSError "Invalid flatbuffers message" (it was raised bare)
    garbled = whole[:middle] + bytes(b ^ 0x5A for b in whole[middle:middle + 16]) + whole[middle + 16:]
    for damaged in (whole[:100], garbled):
        fs.pipe(segment, damaged)
        with pytest.raises(OutputCorruptError, match="cannot be read") as info:
            torch_batch_process(RowWriter, list(range(80)), **run)
        assert segment.rsplit("/", 1)[1] in str(info.value) and "resume=False" in str(info.value)
    fs.pipe(segment, whole)
    assert torch_batch_process(RowWriter, list(range(80)), **run).finished


_TWO_JOBS_ONE_SCRIPT = """
import sys
from torch_batch_process import JobMismatchError, TorchBatchProcessor, torch_batch_process
class Embed(TorchBatchProcessor):
    def process_batch(self, batch, batch_idx):
        pass
class Classify(TorchBatchProcessor):
    def process_batch(self, batch, batch_idx):
        pass
torch_batch_process(Embed, list(range(8)), batch_size=4, progress=False, tensorboard=False)
second = {} if sys.argv[1] == "default" else {"job_name": "classify"}
try:
    torch_batch_process(Classify, list(range(8)), batch_size=4, progress=False, tensorboard=False, **second)
    print("second job ran")
except JobMismatchError as exc:
    print("refused:", exc)
"""


def test_a_second_job_in_one_script_is_told_to_take_its_own_job_name(tmp_path):
    """Two jobs in one script (Determined code calls ``torch_batch_process`` once per experiment) share the default
    ./tbp_runs/<script stem>: the second is refused before any write, and the error names the way out."""
    (tmp_path / "jobs.py").write_text(_TWO_JOBS_ONE_SCRIPT)
    refused = _run_script(tmp_path, "jobs.py", "default")
    assert refused.returncode == 0, refused.stderr[-3000:]
    assert "refused:" in refused.stdout and "job_name" in refused.stdout, refused.stdout
    assert "a second job in the same script needs one of its own" in refused.stdout, refused.stdout
    named = _run_script(tmp_path, "jobs.py", "named")
    assert named.returncode == 0 and "second job ran" in named.stdout, (named.stdout, named.stderr[-3000:])
    assert (tmp_path / "tbp_runs" / "classify").is_dir()
