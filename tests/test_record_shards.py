"""Record shards proportional to bytes (DESIGN §14, issue 28 item 1): segments per commit, shards rolled over by size.

Checks the protocol of :mod:`torch_batch_process.outputs.segments`: a finished job leaves about one shard per rank
and ``TBP_SHARD_BYTES``; at every moment ``read_outputs`` sees every committed row exactly once and a glob over
``outputs/`` at most once; after a kill -9 at each moment of a roll-over (before its record, between the record and
the publication, in the middle of deleting the segments, during the roll-over of leftovers at the next start) and a
resume (with the same or another world size), both see every row exactly once; a job stored by the previous layout
(a shard per commit, no segments) resumes and reads back.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import signal
import tarfile
import time
from collections import Counter
from pathlib import Path

import pytest
from harness import JOBS, assert_exactly_once, latest_commit_record, spawn_ranks, storage_fs, wait_all

from torch_batch_process import TorchBatchProcessor, iter_outputs, read_outputs, torch_batch_process
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.outputs.readback import OUTPUTS_GLOB

pa = pytest.importorskip("pyarrow")

RECORDS_JOB = JOBS / "records_job.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


class Small(TorchBatchProcessor):
    """One small row per example; ``check_every``: reads the job's own outputs back mid-job (see below)."""

    check_every = 0
    seen: list[int] = []

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        self.context.write({"value": [i * 2 for i in ids], "name": [f"r{i}" for i in ids]})
        if Small.check_every and batch_idx % Small.check_every == 0:
            _check_mid_job(self.context, batch_idx)


def _log_stages(storage, rank: int) -> list[int]:
    """The stages of the record batches of rows in rank ``rank``'s segment logs (a torn last batch ends a log; each
    append's seal, a batch of no rows holding its checksum, is left out)."""
    stages = []
    for path in sorted(glob.glob(os.path.join(storage, "_tbp", "segments", f"*-rank_{rank}-*.arrows"))):
        try:
            reader = pa.ipc.open_stream(Path(path).read_bytes())
            while True:
                metadata = reader.read_next_batch_with_custom_metadata()[1]
                if b"tbp_crc32" not in metadata:
                    stages.append(int(metadata[b"tbp_stage"]))
        except (StopIteration, pa.ArrowException, OSError):
            continue
    return stages


def _check_mid_job(context, batch_idx):
    """read_outputs mid-job: every committed row once (a prefix of the dataset: one process, static order); the
    documented glob: each row at most once, all of them among those."""
    path = Path(context.storage_path)
    table = read_outputs(str(path))
    index = table.column("index").to_pylist()
    assert index == list(range(len(index))), index[:20]
    assert len(index) <= batch_idx * 4
    globbed = _glob_index(str(path), "parquet")
    assert len(globbed) == len(set(globbed)) and set(globbed) <= set(index)
    Small.seen.append(len(index))


def _glob_index(storage: str, fmt: str) -> list[int]:
    """The ``index`` column of every shard the documented glob finds (local storage), read by pyarrow.dataset."""
    import pyarrow.dataset as ds

    files = sorted(glob.glob(os.path.join(storage, OUTPUTS_GLOB + "." + fmt)))
    if not files:
        return []
    if fmt == "jsonl":
        import pyarrow.json as pj

        return [i for f in files for i in pj.read_json(f).column("index").to_pylist()]
    return ds.dataset(files, format="parquet").to_table(columns=["index"]).column("index").to_pylist()


def _run(tmp_path, n=400, batch_size=4, checkpoint_interval=1, **kwargs):
    kwargs.setdefault("storage_path", str(tmp_path / "storage"))
    return torch_batch_process(
        Small, list(range(n)), batch_size=batch_size, checkpoint_interval=checkpoint_interval, progress=False, **kwargs
    )


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_finished_job_has_a_shard_per_rank_and_shard_bytes_not_per_commit(tmp_path, monkeypatch, fmt):
    limit = 4000
    monkeypatch.setenv("TBP_SHARD_BYTES", str(limit))
    result = _run(tmp_path, output_format=fmt)  # 100 commits
    storage = result.storage_path
    shards = glob.glob(os.path.join(storage, OUTPUTS_GLOB + "." + fmt))
    table = read_outputs(storage)
    assert table.column("index").to_pylist() == list(range(400))
    written = table.get_total_buffer_size()  # the rows' bytes as the writer counted them (same Arrow types)
    assert 1 < len(shards) <= math.ceil(written / limit) + 1, (len(shards), written)
    assert sorted(_glob_index(storage, fmt)) == list(range(400))
    assert not os.listdir(os.path.join(storage, "_tbp", "segments"))  # every segment is in a published shard


def test_the_default_shard_bytes_gives_one_shard_for_a_small_job(tmp_path):
    result = _run(tmp_path, n=1000, checkpoint_interval=1)  # 250 commits
    assert len(glob.glob(os.path.join(result.storage_path, OUTPUTS_GLOB + ".parquet"))) == 1
    assert len(read_outputs(result.storage_path)) == 1000


def test_iter_outputs_coalesces_tiny_commits_to_batch_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TBP_SHARD_BYTES", "1")  # a shard per commit, 4 rows each
    result = _run(tmp_path, n=200, checkpoint_interval=1)
    sizes = [batch.num_rows for batch in iter_outputs(result.storage_path, batch_rows=64)]
    assert sizes == [64, 64, 64, 8]


def test_read_outputs_sees_committed_rows_exactly_once_while_the_job_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("TBP_SHARD_BYTES", "600")  # roll-overs every few commits, segments in between
    monkeypatch.setattr(Small, "check_every", 7)
    monkeypatch.setattr(Small, "seen", [])
    result = _run(tmp_path, n=480, checkpoint_interval=2)
    assert result.finished and len(Small.seen) == 18 and Small.seen[-1] > 300  # saw rows in shards and segments
    assert read_outputs(result.storage_path).column("index").to_pylist() == list(range(480))


def test_a_bad_shard_bytes_setting_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("TBP_SHARD_BYTES", "lots")
    with pytest.raises(InvalidArgumentError, match="TBP_SHARD_BYTES='lots'"):
        _run(tmp_path)
    assert not (tmp_path / "storage").exists()


def test_a_shard_bytes_setting_with_a_suffix(tmp_path, monkeypatch):
    from torch_batch_process.outputs.segments import shard_bytes

    monkeypatch.setenv("TBP_SHARD_BYTES", "64M")
    assert shard_bytes() == 64 << 20
    monkeypatch.delenv("TBP_SHARD_BYTES")
    assert shard_bytes() == 128 << 20


# ----------------------------------------------------------------------------- kill -9 during roll-overs


def _spec(tmp_path, **extra):
    spec = {"n": 240, "batch_size": 4, "checkpoint_interval": 2, "storage": str(tmp_path / "storage"),
            "report_dir": str(tmp_path / "reports")}
    spec.update(extra)
    return spec


def _env(shard_bytes: int = 900):
    from harness import base_env

    return base_env(TBP_SHARD_BYTES=str(shard_bytes))


def _committed_examples(storage: str, batch_size: int, n: int) -> set[int]:
    """The examples of the batches the latest commit record commits (none before the first record: under load the
    kill may come before rank 0's queued record writes, though after the stages' rows were appended, so that
    ``_tbp/commits`` does not exist yet)."""
    record = latest_commit_record(storage)
    batches = [g for a, b in record["committed"] for g in range(a, b)] if record else []
    return {i for g in batches for i in range(g * batch_size, min((g + 1) * batch_size, n))}


class _StopsAt6(Small):
    def process_batch(self, batch, batch_idx):
        if batch_idx == 6:
            raise RuntimeError("stops at batch 6")
        super().process_batch(batch, batch_idx)


def test_the_committed_examples_of_a_job_killed_before_its_first_record_are_none(tmp_path):
    """Issue 49: killed after the stages' rows were appended but before rank 0's first record, a job has no
    ``_tbp/commits`` folder; the helper that the kill tests check read-back against counts nothing then."""
    storage = tmp_path / "storage"
    with pytest.raises(RuntimeError, match="stops at batch 6"):
        torch_batch_process(_StopsAt6, list(range(40)), batch_size=4, checkpoint_interval=1, progress=False,
                            storage_path=str(storage))  # rows of 6 commits in a segment log
    shutil.rmtree(storage / "_tbp" / "commits")  # as if killed before rank 0 wrote any of them
    assert list((storage / "_tbp" / "segments").iterdir())
    assert _committed_examples(str(storage), 4, 40) == set()
    assert read_outputs(str(storage)).num_rows == 0


def _check_exactly_once_now(storage: str, spec: dict, fmt: str) -> None:
    """After a kill: read_outputs holds every committed example once (and nothing else); the glob at most once."""
    committed = _committed_examples(storage, spec["batch_size"], spec["n"])
    index = read_outputs(storage).column("index").to_pylist()
    assert len(index) == len(set(index)) and set(index) == committed, (len(index), len(committed))
    streamed = [i for b in iter_outputs(storage, batch_rows=50) for i in b.column("index").to_pylist()]
    assert streamed == sorted(committed)
    if not storage.startswith("s3://"):
        globbed = _glob_index(storage, fmt)
        assert len(globbed) == len(set(globbed)) and set(globbed) <= committed


def _check_finished(storage: str, n: int, fmt: str) -> None:
    assert read_outputs(storage).column("index").to_pylist() == list(range(n))
    fs, root = storage_fs(storage)
    assert not fs.exists(f"{root}/_tbp/segments") or not fs.ls(f"{root}/_tbp/segments")
    if storage.startswith("s3://"):
        shards = fs.glob(f"{root}/{OUTPUTS_GLOB}.{fmt}")
        assert shards
        return
    assert_exactly_once(Counter(_glob_index(storage, fmt)), n)
    if fmt == "parquet":
        duckdb = pytest.importorskip("duckdb")
        rows = duckdb.sql(f"SELECT index FROM '{storage}/{OUTPUTS_GLOB}.parquet' ORDER BY index").fetchall()
        assert [r[0] for r in rows] == list(range(n))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("moment", "fmt", "plain"),
    [
        ("before_record", "parquet", False),
        ("before_publish", "parquet", False),
        ("mid_delete", "parquet", False),
        ("roll_at_start", "parquet", False),
        ("before_publish", "jsonl", False),
        ("mid_delete", "jsonl", False),
        # one number per example in each column: context.write's short way, a table per few batches
        ("before_record", "parquet", True),
        ("roll_at_start", "parquet", True),
        ("mid_delete", "jsonl", True),
    ],
)
def test_kill9_during_a_roll_over_then_resume_every_row_exactly_once(tmp_path, moment, fmt, plain):
    spec = _spec(tmp_path, kwargs={"output_format": fmt}, die_after=6, plain=plain)
    storage = spec["storage"]
    # roll_at_start: the first attempt dies before the roll-over's record (its shard is never committed), so the
    # committed segments stay live; the next start rolls them into a shard and dies deleting them
    first = "before_record" if moment == "roll_at_start" else moment
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(dict(spec, die_at=first)), env=_env()), timeout=120)
    assert outcomes[0][0] == -signal.SIGKILL, outcomes
    assert _log_stages(storage, 0)  # committed rows left in segment logs
    _check_exactly_once_now(storage, spec, fmt)
    if moment == "roll_at_start":
        again = dict(spec, attempt=2, die_at="roll_at_start")
        outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(again), env=_env()), timeout=120)
        assert outcomes[0][0] == -signal.SIGKILL, outcomes
        _check_exactly_once_now(storage, spec, fmt)  # the rolled shard is published, its segments not deleted
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(dict(spec, attempt=3)), env=_env()), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0], outcomes
    _check_finished(storage, spec["n"], fmt)
    shards = glob.glob(os.path.join(storage, OUTPUTS_GLOB + "." + fmt))
    assert len(shards) < 60 / 2  # 60 batches, 30 commits: shards by size


@pytest.mark.slow
@pytest.mark.parametrize("plain", [False, True])
def test_one_process_a_record_waits_for_the_rows_it_commits_appended_off_the_batch_thread(tmp_path, plain):
    # one process: a seal queues its append, which the record writer makes; slowed down, the record still waits for it
    spec = _spec(tmp_path, die_after=6, die_at="after_slow_append", plain=plain)
    storage = spec["storage"]
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(spec), env=_env(1 << 20)), timeout=120)
    assert outcomes[0][0] == -signal.SIGKILL, outcomes
    committed = _committed_examples(storage, spec["batch_size"], spec["n"])
    assert len(committed) > 6 * 2 * spec["batch_size"]  # a record past commit 6 is durable
    _check_exactly_once_now(storage, spec, "parquet")  # and every row it commits is in the log


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "plain"), [("parquet", False), ("jsonl", False), ("parquet", True)])
def test_kill9_mid_append_to_a_segment_log_then_resume_every_row_exactly_once(tmp_path, fmt, plain):
    # a shard of 1 MB: the job's rows stay in one segment log, appended at every commit
    spec = _spec(tmp_path, kwargs={"output_format": fmt}, die_after=6, die_at="mid_append", plain=plain)
    storage = spec["storage"]
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(spec), env=_env(1 << 20)), timeout=120)
    assert outcomes[0][0] == -signal.SIGKILL, outcomes
    (log,) = glob.glob(os.path.join(storage, "_tbp", "segments", "*.arrows"))
    with pytest.raises((pa.ArrowException, OSError)):  # the log ends inside a record batch
        reader = pa.ipc.open_stream(Path(log).read_bytes())
        while True:
            reader.read_next_batch()
    stages = _log_stages(storage, 0)
    assert stages and max(stages) == 6  # stages 1-6 are whole; stage 7's first batch is cut off, before its vote
    _check_exactly_once_now(storage, spec, fmt)  # a torn tail counts nothing and fails no read
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(dict(spec, attempt=2, die_at=None)), env=_env()), 120)
    assert [rc for rc, _, _ in outcomes] == [0], outcomes
    _check_finished(storage, spec["n"], fmt)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "schedule", "plain"),
    [(1, "static", False), (3, "static", False), (3, "dynamic", False), (1, "dynamic", True)],
)
def test_two_ranks_killed_then_resumed_with_another_world_size(tmp_path, world, schedule, plain):
    progress = tmp_path / "progress"
    spec = _spec(tmp_path, n=600, kwargs={"schedule": schedule}, sleep=0.02, progress_file=str(progress), plain=plain)
    storage = spec["storage"]
    procs = spawn_ranks(2, RECORDS_JOB, json.dumps(spec), env=_env(1500))
    deadline = time.monotonic() + 90
    while len(set(_log_stages(storage, 1))) < 2:
        assert time.monotonic() < deadline, "the job never committed segments"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.02)
    time.sleep(0.3)
    os.kill(procs[1].pid, signal.SIGKILL)
    if schedule == "dynamic":
        time.sleep(0.2)
        os.kill(procs[0].pid, signal.SIGKILL)
    outcomes = wait_all(procs, timeout=60)
    assert outcomes[1][0] == -signal.SIGKILL and outcomes[0][0] not in (0, None), outcomes
    _check_exactly_once_now(storage, spec, "parquet")
    resumed = spawn_ranks(world, RECORDS_JOB, json.dumps(dict(spec, attempt=2, sleep=0)), env=_env(1500))
    outcomes = wait_all(resumed, timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0] * world, outcomes
    _check_finished(storage, spec["n"], "parquet")


@pytest.mark.slow
@pytest.mark.s3
def test_kill9_during_a_roll_over_on_s3(tmp_path, s3_url):
    spec = _spec(tmp_path, storage=s3_url, n=120, die_after=4)
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(dict(spec, die_at="mid_delete")), env=_env()), 180)
    assert outcomes[0][0] == -signal.SIGKILL, outcomes
    _check_exactly_once_now(s3_url, spec, "parquet")
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(dict(spec, attempt=2)), env=_env()), timeout=180)
    assert [rc for rc, _, _ in outcomes] == [0], outcomes
    _check_finished(s3_url, spec["n"], "parquet")


# ----------------------------------------------------------------------------- the previous layout


@pytest.mark.slow
def test_a_job_stored_by_the_previous_layout_resumes_and_reads_back(tmp_path):
    """``fixtures/records_previous_layout.tar.gz``: tests/jobs/records_job.py (n=240, batches of 4,
    checkpoint_interval=2) run by the library before segments (main at a9daad3: a shard per commit, no
    ``_tbp/segments``) and SIGKILLed half-way."""
    with tarfile.open(FIXTURES / "records_previous_layout.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    storage = str(tmp_path / "storage")
    spec = _spec(tmp_path)
    before = glob.glob(os.path.join(storage, OUTPUTS_GLOB + ".parquet"))
    assert len(before) > 3 and not os.path.exists(os.path.join(storage, "_tbp", "segments"))
    index = read_outputs(storage).column("index").to_pylist()  # published shards (a committed stage is still staged)
    assert index == list(range(len(index))) and set(index) <= _committed_examples(storage, 4, 240)
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(dict(spec, attempt=2)), env=_env()), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0], outcomes
    _check_finished(storage, spec["n"], "parquet")
    after = glob.glob(os.path.join(storage, OUTPUTS_GLOB + ".parquet"))
    assert set(before) < set(after)  # the old shards stay where they were; the rest came in a few new ones


class LateTypes(TorchBatchProcessor):
    """A column that is all None in the first batches, typed later (the open shard is rewritten with the wider type)."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        self.context.write({"maybe": [f"m{i}" if batch_idx >= 5 else None for i in ids], "n": ids})


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_types_that_widen_after_rows_are_in_the_open_shard_and_in_segments(tmp_path, monkeypatch, fmt):
    from torch_batch_process.outputs import records

    monkeypatch.setattr(records, "ROW_GROUP_BYTES", 1)  # a row group per batch: the shard is open from the start
    storage = str(tmp_path / "storage")
    result = torch_batch_process(
        LateTypes, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=storage, progress=False,
        output_format=fmt,
    )
    assert result.finished
    table = read_outputs(storage)
    assert table.column("maybe").to_pylist() == [None] * 20 + [f"m{i}" for i in range(20, 40)]
    assert pa.types.is_string(table.schema.field("maybe").type)
    assert len(glob.glob(os.path.join(storage, OUTPUTS_GLOB + "." + fmt))) == 1
    if fmt == "parquet":
        import pyarrow.parquet as pq

        (shard,) = glob.glob(os.path.join(storage, OUTPUTS_GLOB + ".parquet"))
        assert pa.types.is_string(pq.read_schema(shard).field("maybe").type)  # rewritten with the wider type


class FailsOnce(LateTypes):
    fail_at: int | None = 8

    def process_batch(self, batch, batch_idx):
        super().process_batch(batch, batch_idx)
        if batch_idx == FailsOnce.fail_at:
            raise RuntimeError("boom")


def test_rows_left_in_segments_by_a_failure_are_rolled_over_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv("TBP_SHARD_BYTES", "1000000")
    storage = str(tmp_path / "storage")
    run = dict(batch_size=4, checkpoint_interval=2, storage_path=storage, progress=False)
    with pytest.raises(RuntimeError, match="boom"):
        torch_batch_process(FailsOnce, list(range(40)), **run)
    # the failed job's closing commit is not recorded: no shard was published
    assert not glob.glob(os.path.join(storage, OUTPUTS_GLOB + ".parquet"))
    # stages 1-4 (batches 0-7) in the rank's segment logs: a second log from stage 3, when its types widened
    logs = sorted(os.listdir(os.path.join(storage, "_tbp", "segments")))
    assert logs == ["00000001-rank_0-0.arrows", "00000003-rank_0-0.arrows"]
    assert _log_stages(storage, 0) == [1, 1, 2, 2, 3, 3, 4, 4]  # a record batch per batch (seal's two of each stage)
    index = read_outputs(storage).column("index").to_pylist()
    assert index == list(range(32))  # every committed row, from segments
    monkeypatch.setattr(FailsOnce, "fail_at", None)
    assert torch_batch_process(FailsOnce, list(range(40)), **run).finished
    table = read_outputs(storage)
    assert table.column("maybe").to_pylist() == [None] * 20 + [f"m{i}" for i in range(20, 40)]
    assert len(glob.glob(os.path.join(storage, OUTPUTS_GLOB + ".parquet"))) == 2  # the leftovers' shard, the new one
    assert not os.listdir(os.path.join(storage, "_tbp", "segments"))
