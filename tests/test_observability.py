"""Observability: progress display (terminal and logs), stragglers, timings, JSONL and TensorBoard
metrics, profiler, and ``tbp status`` on running, preempted and finished jobs."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import filelock
import fsspec
import pytest
from harness import GENERIC_JOB, REPO, base_env, job_spec, read_reports, run_generic, spawn_ranks, wait_all

from torch_batch_process import InvalidArgumentError, TorchBatchProcessor, torch_batch_process
from torch_batch_process.jobstore.job_lock import flock_held
from torch_batch_process.launch import cli
from torch_batch_process.observe.options import ProfileOptions, resolve_observe_options, tensorboard_installed
from torch_batch_process.observe.progress import format_duration
from torch_batch_process.observe.status import read_status
from torch_batch_process.observe.stragglers import RankInterval, StragglerDetector
from torch_batch_process.observe.summary import summary_line
from torch_batch_process.result import BatchProcessResult

needs_tensorboard = pytest.mark.skipif(not tensorboard_installed(), reason="tensorboard is not installed")


def _scalar_tags(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``folder``, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _jsonl(storage: Path) -> list[dict]:
    return [json.loads(line) for line in (storage / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------ units


def test_options_come_from_arguments_then_environment_and_bad_values_are_named(monkeypatch):
    options = resolve_observe_options()
    assert options.progress == "auto" and options.progress_interval == 30.0 and options.profile is None
    assert options.tensorboard == tensorboard_installed()
    monkeypatch.setenv("TBP_PROGRESS", "0")
    monkeypatch.setenv("TBP_PROGRESS_INTERVAL", "2.5")
    monkeypatch.setenv("TBP_PROFILE", '{"ranks": [1, 0], "active": 2}')
    monkeypatch.setenv("TBP_METRICS_INTERVAL", "0")
    monkeypatch.setenv("TBP_TENSORBOARD", "0")
    options = resolve_observe_options()
    assert options.progress == "off" and options.progress_interval == 2.5 and not options.tensorboard
    assert options.profile == ProfileOptions(ranks=(0, 1), active=2) and options.metrics_interval == 0
    options = resolve_observe_options(progress="log", progress_interval=1, profile=False, tensorboard=False)
    assert options.progress == "log" and options.progress_interval == 1.0 and options.profile is None
    assert resolve_observe_options(profile=True).profile == ProfileOptions()
    assert resolve_observe_options(profile={"ranks": "all"}).profile.covers(7)

    for kwargs, needle in [
        ({"progress": "fancy"}, "progress must be"),
        ({"progress_interval": 0}, "progress_interval must be > 0"),
        ({"progress_interval": "5"}, "progress_interval must be a number"),
        ({"tensorboard": "yes"}, "tensorboard must be"),
        ({"profile": {"steps": 3}}, "unknown key(s) ['steps']"),
        ({"profile": {"active": 0}}, "profile['active'] must be an int >= 1"),
        ({"profile": {"ranks": [-1]}}, "profile['ranks']"),
        ({"profile": "on"}, "profile must be"),
    ]:
        with pytest.raises(InvalidArgumentError, match=__import__("re").escape(needle)):
            resolve_observe_options(**kwargs)
    monkeypatch.setenv("TBP_PROGRESS_INTERVAL", "soon")
    with pytest.raises(InvalidArgumentError, match="TBP_PROGRESS_INTERVAL"):
        resolve_observe_options()
    monkeypatch.delenv("TBP_PROGRESS_INTERVAL")
    monkeypatch.setenv("TBP_STRAGGLER_RATIO", "2")
    with pytest.raises(InvalidArgumentError, match="TBP_STRAGGLER_RATIO"):
        resolve_observe_options()


def test_bad_observability_argument_fails_before_any_storage_access(tmp_path):
    class Never(TorchBatchProcessor):
        def process_batch(self, batch, batch_idx):
            raise AssertionError("never called")

    with pytest.raises(InvalidArgumentError, match="progress_interval"):
        torch_batch_process(Never, [1, 2], storage_path=str(tmp_path / "s"), progress_interval=-1)
    assert not (tmp_path / "s").exists()


def test_straggler_detector_waits_for_a_meaningful_window_and_names_the_slow_rank():
    detector = StragglerDetector(0.5, min_batches=4, min_busy_s=1.0, repeat_s=300)
    fast = RankInterval(2, 20, {"data": 0.01, "process": 0.19})
    slow = RankInterval(2, 20, {"data": 0.01, "process": 0.99})
    assert detector.add([fast, slow, fast]) is None, "2 batches per rank: too few to judge"
    found = detector.add([fast, slow, fast])
    assert found is not None and found.rank == 1 and found.batches == 4
    assert found.rate == pytest.approx(40 / 2.0) and found.median_others == pytest.approx(40 / 0.4)
    assert "rank 1 is a straggler" in found.describe()
    for _ in range(2):
        assert detector.add([fast, slow, fast]) is None  # judged again, but named at most every repeat_s
    even = RankInterval(4, 40, {"process": 1.0})
    assert StragglerDetector(0.5).add([even, RankInterval(4, 40, {"process": 1.5})]) is None, "1.5x is not markedly"
    assert StragglerDetector(0.5).add([even]) is None, "one rank has no peers"
    idle = RankInterval(0, 0, {})
    assert StragglerDetector(0.5).add([even, idle]) is None, "an idle rank (end of the job) is not judged"


def test_summary_line_and_durations():
    result = BatchProcessResult(
        metrics={},
        preempted=False,
        finished=True,
        storage_path="s",
        outputs_path="s/outputs",
        num_batches=10,
        num_examples=100,
        batches_committed=10,
        examples_committed=100,
        batches_processed=10,
        examples_processed=100,
        batches_skipped=0,
        attempt=1,
        world_size=2,
        commits=3,
        elapsed_s=2.0,
        timings={"data": 0.5, "process": 3.0, "commit": 0.2, "hooks": 0.0},
        timings_per_rank=[{"data": 0.2, "process": 1.0}, {"data": 0.3, "process": 2.0, "commit": 0.2}],
    )
    line = summary_line(result)
    assert line.startswith("finished: 100 examples (10 batches) processed in 2.0 s on 2 rank(s), 50.0 examples/s")
    assert "data 0.50/0.30, process 3.00/2.00, commit 0.20/0.20" in line and "busiest rank 1" in line
    assert format_duration(3725.4) == "1:02:05" and format_duration(90061) == "1 day, 1:01:01"


def test_lock_detection_reads_proc_locks_without_taking_the_lock(tmp_path):
    path = tmp_path / "lock"
    lock = filelock.FileLock(str(path), timeout=0)
    with lock:
        assert flock_held(str(path)) in (True, None)  # None: no /proc/locks on this platform
    assert flock_held(str(path)) in (False, None)


# -------------------------------------------------------------------- in-process jobs


class Reporting(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.total = context.wrap_reducer(lambda values: sum(values), name="total")

    def process_batch(self, batch, batch_idx):
        values = [int(v) for v in batch]
        self.total.update(sum(values))
        self.context.report_metrics("inference", batch_idx + 1, {"mean": sum(values) / len(values), "tag": "x"})
        time.sleep(0.005)


@needs_tensorboard
def test_metrics_jsonl_tensorboard_profiler_and_timings_of_a_local_job(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TBP_METRICS_INTERVAL", "0.05")  # reduced metrics "so far" at (nearly) every commit
    caplog.set_level(logging.INFO, logger="torch_batch_process")
    storage = tmp_path / "storage"
    result = torch_batch_process(
        Reporting,
        list(range(120)),
        batch_size=4,
        checkpoint_interval=3,
        storage_path=str(storage),
        tensorboard=True,
        profile={"wait": 1, "warmup": 1, "active": 2},
        progress="log",
        progress_interval=0.05,
    )
    assert result.finished and result.metrics == {"total": sum(range(120))}
    assert len(result.timings_per_rank) == 1 and result.timings_per_rank[0]["process"] > 0.005 * 30
    assert set(result.timings) == {"data", "process", "commit", "hooks"}
    assert result.timings["process"] == pytest.approx(result.timings_per_rank[0]["process"], abs=1e-5)

    records = _jsonl(storage)
    reported = [r for r in records if r["group"] == "inference"]
    assert sorted(r["steps_completed"] for r in reported) == list(range(1, 31))
    assert all(set(r) == {"group", "steps_completed", "rank", "metrics", "time", "commit", "attempt"} for r in records)
    reduced = [r for r in records if r["group"] == "reduced"]
    assert reduced[-1]["steps_completed"] == 30 and reduced[-1]["metrics"] == {"total": sum(range(120))}
    interim = [r for r in reduced if r["steps_completed"] < 30]
    assert interim, "reduced metrics so far were computed at commits"
    for record in interim:  # exact: the sum of the examples of the batches committed then
        assert record["metrics"]["total"] == sum(range(record["steps_completed"] * 4))
    progress = [r for r in records if r["group"] == "progress"]
    assert progress[-1]["metrics"]["fraction_done"] == 1.0 and progress[-1]["metrics"]["examples_committed"] == 120

    scalars = _scalar_tags(storage / "tensorboard" / "rank_0")
    assert {"inference/mean", "reduced/total", "progress/examples_per_s", "progress/fraction_done"} <= set(scalars)
    assert {"throughput/examples_per_s", "time/data_s", "time/process_s", "time/commit_s"} <= set(scalars)
    assert "inference/tag" not in scalars, "strings stay in JSONL"
    assert [step for step, _ in scalars["inference/mean"]] == list(range(1, 31))
    assert scalars["inference/mean"][0][1] == pytest.approx(1.5)
    assert scalars["reduced/total"][-1] == (30, float(sum(range(120))))
    assert scalars["progress/fraction_done"][-1] == (30, 1.0)
    traces = list((storage / "tensorboard" / "rank_0").glob("rank_0.*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"], "one profiler trace, readable"

    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("progress: ") and "examples/s" in m and "ETA" in m for m in messages)
    summary = [m for m in messages if m.startswith("finished: 120 examples (30 batches)")]
    assert len(summary) == 1 and "data " in summary[0] and "process " in summary[0] and "commit " in summary[0]


class WritesOwnTensorBoardFile(Reporting):
    folders: list[Path] = []

    def on_finish(self):
        folder = self.context.get_tensorboard_path()
        type(self).folders.append(folder)
        (folder / "notes.txt").write_text("written by the processor")


WritesOwnTensorBoardFile.__qualname__ = "Reporting"


@needs_tensorboard
def test_tensorboard_files_of_remote_storage_are_uploaded_through_storage(tmp_path):
    url = f"memory://tbp-observe-{os.getpid()}-{time.time_ns()}/job"
    result = torch_batch_process(
        WritesOwnTensorBoardFile, list(range(40)), batch_size=4, storage_path=url, tensorboard=True, progress=False
    )
    assert result.finished
    fs = fsspec.filesystem("memory")
    root = url[len("memory://") :]
    events = [p for p in fs.find(f"{root}/tensorboard/rank_0") if "tfevents" in p]
    assert len(events) == 1
    assert fs.cat_file(f"{root}/tensorboard/rank_0/notes.txt") == b"written by the processor"
    (folder,) = WritesOwnTensorBoardFile.folders
    assert not folder.exists(), "the local temporary folder is removed once uploaded"
    local = tmp_path / "download"
    local.mkdir()
    fs.get_file(events[0], str(local / Path(events[0]).name))
    assert "inference/mean" in _scalar_tags(local) and "reduced/total" in _scalar_tags(local)


def test_progress_off_and_tensorboard_off_write_no_display_and_no_event_files(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="torch_batch_process")
    storage = tmp_path / "storage"
    result = torch_batch_process(
        Reporting, list(range(40)), batch_size=4, storage_path=str(storage), progress=False, tensorboard=False,
        progress_interval=0.001,
    )
    assert result.finished and not (storage / "tensorboard").exists()
    assert not any(r.getMessage().startswith("progress: ") for r in caplog.records)
    assert any(r["group"] == "progress" for r in _jsonl(storage)), "the JSONL progress records stay"


# ------------------------------------------------------------------ terminal and pipes


def _run_in_pty(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    """Runs a command with stdin, stdout and stderr on a pseudo-terminal; returns (exit code, output)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=str(REPO), close_fds=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the other side is closed
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    return proc.returncode, b"".join(chunks).decode("utf-8", "replace")


def test_profiling_only_ranks_the_job_does_not_have_is_a_warning_not_silence(tmp_path, caplog):
    """profile={'ranks': [5]} on a one-rank job profiled nothing and said nothing."""
    caplog.set_level(logging.WARNING, logger="torch_batch_process")
    result = torch_batch_process(
        Reporting, list(range(8)), batch_size=2, storage_path=str(tmp_path / "s"), progress=False,
        profile={"ranks": [5]}, tensorboard=False,
    )
    assert result.finished
    assert any(
        "profile['ranks'] names rank(s) [5], which this job of 1 rank(s) does not have; nothing is profiled"
        in r.getMessage() for r in caplog.records
    )


@pytest.mark.slow
def test_a_terminal_shows_a_tqdm_bar_with_examples_per_second(tmp_path):
    spec = job_spec(tmp_path, n=400, batch_size=4, sleep=0.02, outputs="none", attempt=1)
    code, output = _run_in_pty([sys.executable, str(GENERIC_JOB), json.dumps(spec)], base_env())
    assert code == 0, output[-3000:]
    assert "\r" in output and "examples/s" in output, output[-3000:]
    assert "%|" in output and "batches]" in output, "a tqdm bar with the batches in its postfix"
    assert "| 400/400 [" in output and "100/100 batches" in output, "the bar ends at the exact committed count"
    assert "progress: " not in output, "no plain lines on a terminal"
    assert "finished: 400 examples (100 batches)" in output


@pytest.mark.slow
def test_piped_output_gets_periodic_plain_lines_and_no_carriage_returns(tmp_path):
    spec = job_spec(tmp_path, n=400, batch_size=4, sleep=0.02, outputs="none", kwargs={"progress_interval": 0.4})
    proc, reports = run_generic(spec, nproc=1, launcher="plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "\r" not in output
    lines = [line for line in output.splitlines() if "INFO progress: " in line]
    assert len(lines) >= 3, output[-3000:]
    assert all("examples/s" in line and "ETA" in line and "[tbp rank 0]" in line for line in lines)
    assert "finished: 400 examples (100 batches)" in output


# ------------------------------------------------------------------------- many ranks


@pytest.mark.slow
def test_straggler_is_named_and_timings_are_per_rank(tmp_path):
    spec = job_spec(
        tmp_path, n=240, batch_size=4, checkpoint_interval=5, outputs="none", sleep_rank={"1": 0.05},
        report_metrics=True, kwargs={"progress": "log", "progress_interval": 0.5},
    )
    proc, reports = run_generic(spec, nproc=2, launcher="ranks")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING rank 1 is a straggler" in proc.stderr, proc.stderr[-4000:]
    assert "rank 0 is a straggler" not in proc.stderr
    result = reports[0]["result"]
    assert result == reports[1]["result"] | {"elapsed_s": result["elapsed_s"]}, "the same result on every rank"
    per_rank = result["timings_per_rank"]
    assert len(per_rank) == 2 and per_rank[1]["process"] > 1.2 and per_rank[1]["process"] > 5 * per_rank[0]["process"]
    assert sum(t["process"] for t in per_rank) == pytest.approx(result["timings"]["process"], abs=1e-4)
    assert "finished: 240 examples (60 batches) processed" in proc.stderr
    storage = Path(spec["storage"])
    reported = [r for r in _jsonl(storage) if r["group"] == "inference"]
    assert sorted((r["rank"], r["steps_completed"]) for r in reported) == sorted(
        (g % 2, g + 1) for g in range(60)
    ), "every rank's report_metrics records, with their steps"
    if tensorboard_installed():
        for rank in (0, 1):
            scalars = _scalar_tags(storage / "tensorboard" / f"rank_{rank}")
            assert "inference/batch_sum" in scalars and "throughput/examples_per_s" in scalars
        assert "progress/fraction_done" in _scalar_tags(storage / "tensorboard" / "rank_0")


# ---------------------------------------------------------------------------- tbp status


def _status_json(path: Path, capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["status", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_status_of_a_running_then_preempted_then_finished_job(tmp_path, capsys):
    n, b = 400, 2  # 200 batches
    spec = job_spec(tmp_path, n=n, batch_size=b, checkpoint_interval=2, outputs="none", sleep=0.03, attempt=1)
    storage = Path(spec["storage"])
    env = base_env(TBP_METRICS_INTERVAL="0.3", TBP_PROGRESS="off")
    (proc,) = spawn_ranks(1, GENERIC_JOB, json.dumps(spec), env=env)
    try:
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline:
            if (storage / "_tbp" / "job.json").exists():
                status = read_status(str(storage))
                if status["state"] == "running" and status["metrics"] and 10 <= status["batches_committed"] < 150:
                    break
            time.sleep(0.2)
        assert status is not None and status["state"] == "running", status
        assert status["running"] is True and status["holder"]["pid"] == proc.pid
        assert 0 < status["percent"] < 100 and status["batches_total"] == 200 and status["examples_total"] == n
        assert status["examples_committed"] == b * status["batches_committed"]
        assert status["percent"] == pytest.approx(100 * status["examples_committed"] / n, abs=0.01)
        assert status["throughput"]["examples_per_s"] > 0 and status["eta_s"] > 0 and status["attempts"] == 1
        so_far = status["metrics_batches_committed"]
        assert not status["metrics_final"] and 0 < so_far <= status["batches_committed"]
        assert status["metrics"]["sum_fn"] == sum(range(so_far * b)), "reduced metrics so far are exact"
        live = _status_json(storage, capsys)  # the command itself, while the job runs
        assert live["state"] == "running" and live["batches_committed"] >= status["batches_committed"]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
    ((code, out, err),) = wait_all([proc], timeout=60)
    assert code == 0, err[-3000:]
    preempted = read_reports(spec, 1)[0]["result"]
    assert preempted["preempted"]

    status = _status_json(storage, capsys)
    assert status["state"] == "preempted" and status["running"] is False
    assert status["batches_committed"] == preempted["batches_committed"] < 200
    assert status["examples_committed"] == preempted["examples_committed"]
    assert status["metrics"] == preempted["metrics"] and not status["metrics_final"]
    assert status["throughput"]["examples_processed"] == preempted["examples_processed"]
    assert status["last_commit"]["attempt"] == 1 and status["eta_s"] is None
    assert cli.main(["status", str(storage)]) == 0
    text = capsys.readouterr().out
    assert "preempted; run the same command again to resume" in text
    assert f"{preempted['batches_committed']}/200 batches" in text and "so far" in text

    spec2 = dict(spec, sleep=0)
    done, reports = run_generic(spec2, nproc=1, attempt=2, launcher="plain")
    assert done.returncode == 0, done.stderr[-3000:]
    final = reports[0]["result"]
    check = subprocess.run(
        [sys.executable, "-m", "torch_batch_process.launch.cli", "status", str(storage), "--json"],
        env=base_env(), capture_output=True, text=True, timeout=120, cwd=str(REPO),
    )
    assert check.returncode == 0, check.stderr
    status = json.loads(check.stdout)
    assert status["state"] == "finished" and status["percent"] == 100.0 and status["attempts"] == 2
    assert status["batches_committed"] == 200 and status["examples_committed"] == n
    assert status["metrics"] == final["metrics"] and status["metrics_final"] is True
    assert status["metrics"]["sum_fn"] == sum(range(n))
    throughput = status["throughput"]
    assert throughput["attempt"] == 2 and throughput["examples_processed"] == final["examples_processed"]
    assert status["result_path"] == str(storage / "result.json") and status["outputs_path"] == str(storage / "outputs")
    assert set(status) == set(live), "stable keys"


def test_status_of_an_empty_path_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path / "nothing")]) == 1
    assert "no job is stored at" in capsys.readouterr().err


def test_event_file_holds_the_scalars_added_as_tensorboard_reads_them(tmp_path):
    pytest.importorskip("tensorboard")
    from torch_batch_process.observe.tensorboard import TensorBoardLog

    log = TensorBoardLog(tmp_path / "tb")
    log.scalars({"a": 1.5, "nested": {"b": 2}, "text": "skipped", "flag": True}, step=3, prefix="g")
    log.records([{"group": "h", "steps_completed": 7, "metrics": {"c": 4.0}}])
    log.flush()
    assert _scalar_tags(tmp_path / "tb") == {"g/a": [(3, 1.5)], "g/nested/b": [(3, 2.0)], "h/c": [(7, 4.0)]}
    log.scalars({"a": -2.25}, step=9, prefix="g")
    log.close()
    assert _scalar_tags(tmp_path / "tb")["g/a"] == [(3, 1.5), (9, -2.25)]


def test_event_file_records_are_framed_with_masked_crc32c(tmp_path):
    pytest.importorskip("tensorboard")
    from torch_batch_process.observe.event_file import EventFile, masked_crc32c

    # CRC-32C("123456789") is 0xe3069283 (the standard check value); masked: rotated right 15, plus 0xa282ead8
    crc = 0xE3069283
    assert masked_crc32c(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    file = EventFile(tmp_path)
    file.scalar("x", 1.0, 1)
    file.close()
    data, records = file.path.read_bytes(), 0
    while data:
        (length,) = struct.unpack("<Q", data[:8])
        assert struct.unpack("<I", data[8:12])[0] == masked_crc32c(data[:8])
        body = data[12 : 12 + length]
        assert struct.unpack("<I", data[12 + length : 16 + length])[0] == masked_crc32c(body)
        data, records = data[16 + length :], records + 1
    assert records == 2 and "tfevents" in file.path.name  # the file version, then the scalar


def test_event_file_scalars_are_the_bytes_tensorboards_protocol_buffers_make(tmp_path):
    """The file version and scalars are encoded without importing the protocol buffer classes (35 ms of CPU at a
    call's first scalars, before): each record's bytes are those the classes make for the same values."""
    pytest.importorskip("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from torch_batch_process.observe.event_file import EventFile

    added = [("a", 1.5, 0), ("reduced/ü-x", -2.25, 3), ("t" * 200, 3e38, 2**40), ("n", 0.0, -7)]
    file = EventFile(tmp_path)
    for tag, value, step in added:
        file.scalar(tag, value, step)
    file.close()
    data, bodies = file.path.read_bytes(), []
    while data:
        (length,) = struct.unpack("<Q", data[:8])
        bodies.append(data[12 : 12 + length])
        data = data[16 + length :]
    version = event_pb2.Event.FromString(bodies[0])
    assert bodies[0] == event_pb2.Event(wall_time=version.wall_time, file_version="brain.Event:2").SerializeToString()
    for body, (tag, value, step) in zip(bodies[1:], added, strict=True):
        value_pb = summary_pb2.Summary.Value(tag=tag, simple_value=value)
        wall_time = event_pb2.Event.FromString(body).wall_time
        expected = event_pb2.Event(wall_time=wall_time, step=step, summary=summary_pb2.Summary(value=[value_pb]))
        assert body == expected.SerializeToString(), (tag, value, step)


def test_event_file_without_the_tensorboard_package_turns_event_files_off(tmp_path, monkeypatch, caplog):
    """A missing package raises at the first use; the feed then turns event files off with a warning."""
    from torch_batch_process.observe.tensorboard import TensorBoardLog
    from torch_batch_process.observe.tensorboard_feed import TensorBoardFeed

    monkeypatch.setitem(sys.modules, "tensorboard.compat.proto", None)  # makes the import fail
    log = TensorBoardLog(tmp_path / "tb")
    with pytest.raises(ImportError):
        log.scalars({"a": 1.0}, step=1)
    feed = TensorBoardFeed(tmp_path / "tb2", 0, None)
    feed.hparams({"lr": 0.1}, 0)
    assert not feed.active and "event files failed" in caplog.text


@needs_tensorboard
def test_a_job_writes_event_files_without_importing_tensorboards_writer(tmp_path):
    """Importing torch.utils.tensorboard (and boto3 through it) cost 0.2-0.3 s of every short job."""
    script = textwrap.dedent(
        f"""
        import sys
        from torch_batch_process import TorchBatchProcessor, torch_batch_process

        class P(TorchBatchProcessor):
            def __init__(self, context):
                self.context = context

            def process_batch(self, batch, batch_idx):
                self.context.report_metrics("m", batch_idx + 1, {{"x": float(batch_idx)}})

        torch_batch_process(P, list(range(8)), batch_size=2, storage_path={str(tmp_path / "s")!r},
                            tensorboard=True, progress=False)
        print(sorted(m for m in ("torch.utils.tensorboard", "boto3") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=base_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert [step for step, _ in _scalar_tags(tmp_path / "s" / "tensorboard" / "rank_0")["m/x"]] == [1, 2, 3, 4]


def test_event_file_takes_names_and_texts_utf8_cannot_hold(tmp_path):
    """A metric name, hyperparameter or text with a lone surrogate (decoded from bad bytes with ``surrogateescape``)
    turned the run's event files off; it is written with ``?`` in its place and the next scalars still land."""
    pytest.importorskip("tensorboard")
    from torch_batch_process.observe.tensorboard import TensorBoardLog

    log = TensorBoardLog(tmp_path / "tb")
    log.hparams({"model\udcff": "name\udcfe", "lr": 0.1}, step=0)
    log.scalars({"loss\udcff": 1.5}, step=1, prefix="g")
    log.scalars({"ok": 2.0}, step=2, prefix="g")
    log.close()
    assert _scalar_tags(tmp_path / "tb") == {"g/loss?": [(1, 1.5)], "g/ok": [(2, 2.0)]}
