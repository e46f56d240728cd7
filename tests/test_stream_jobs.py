"""Jobs over streaming sources (DESIGN §12): the engine's plan of row ranges inside shards, exactly-once
outputs across kill -9 and resumes with other world sizes (local and S3 on moto), Hugging Face iterable
datasets (rows counted once per job), ``schedule="dynamic"``, DataLoader workers, and a resume at ~90%
that reads few rows again (counted by :class:`~torch_batch_process.sources.RowsReadLog`)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import (
    JOBS,
    assert_exactly_once,
    committed_batches,
    read_outputs,
    read_reports,
    spawn_ranks,
    stop_with_stacks,
    storage_fs,
    tree_digest,
    wait_all,
)
from torch.utils.data import default_collate

import torch_batch_process as tbp
from torch_batch_process import TorchBatchProcessor, sources, torch_batch_process
from torch_batch_process.engine.plan.streamed import StreamPlan
from torch_batch_process.errors import InvalidArgumentError, JobMismatchError

STREAM_JOB = JOBS / "stream_job.py"


def write_parquet_files(folder: str, counts: list[int], row_group: int) -> list[str]:
    """Files ``part-<k>.parquet`` (local folder or fsspec URL) whose ``id`` column is the global row number."""
    fs, root = storage_fs(folder)
    fs.makedirs(root, exist_ok=True)
    urls, base = [], 0
    for k, n in enumerate(counts):
        ids, xs = pa.array(range(base, base + n), pa.int64()), pa.array([float(i) for i in range(n)])
        table = pa.table({"id": ids, "x": xs})
        path = f"{root.rstrip('/')}/part-{k}.parquet"
        with fs.open(path, "wb") as f:
            pq.write_table(table, f, row_group_size=row_group)
        urls.append(path if "://" not in folder else f"{folder.split('://')[0]}://{path}")
        base += n
    return urls


def batch_records(storage: str) -> dict[int, dict[str, Any]]:
    """The committed ``batch_<idx>.json`` records, by batch index (each batch at most once, or it fails)."""
    records: dict[int, dict[str, Any]] = {}
    for rel, data in read_outputs(storage, "batch_*.json").items():
        idx = int(rel.rsplit("batch_", 1)[1].split(".")[0])
        assert idx not in records, f"batch {idx} committed twice"
        records[idx] = json.loads(data)
    return records


def check_outputs(storage: str, n: int, plan: StreamPlan | None = None) -> None:
    """Every row's output exactly once; ``context.batch_indices`` are the global row numbers (= ids)."""
    records = batch_records(storage)
    ids: Counter[int] = Counter()
    for idx, record in records.items():
        ids.update(record["ids"])
        assert record["indices"] == record["ids"], idx
        if plan is not None:
            assert record["indices"] == list(plan.batch_indices(idx))
    assert_exactly_once(ids, n)


# ====================================================================== one process, in-process


class Collect(TorchBatchProcessor):
    fail_at: int | None = None

    def __init__(self, context):
        self.context = context
        self.calls: list[int] = []
        self.total = context.wrap_reducer(lambda values: sum(values), name="id_sum")

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch["id"]]
        assert ids == list(self.context.batch_indices)
        self.total.update(sum(ids))
        with self.context.upload_path() as path:
            (path / f"batch_{batch_idx}.json").write_text(json.dumps({"ids": ids, "indices": ids}))
        if batch_idx == type(self).fail_at:
            raise RuntimeError(f"stop at {batch_idx}")


class CollectFails(Collect):
    fail_at = 0


CollectFails.__qualname__ = "Collect"  # the same job, as if the user fixed the bug and re-ran


@pytest.mark.parametrize("num_workers, collate", [(0, None), (2, None), (0, default_collate)])
def test_parquet_job_outputs_every_row_once(tmp_path: Path, num_workers: int, collate: Any) -> None:
    counts = [95, 0, 130, 41]
    write_parquet_files(str(tmp_path / "data"), counts, row_group=32)
    source = sources.parquet(str(tmp_path / "data" / "*.parquet"))
    log = sources.RowsReadLog(tmp_path / "reads")
    source.on_rows_read = log
    storage = str(tmp_path / "storage")
    result = torch_batch_process(
        Collect, source, batch_size=16, checkpoint_interval=3, storage_path=storage,
        dataloader_kwargs={"num_workers": num_workers, "collate_fn": collate},  # collate_fn given: rows are collated
    )
    n = sum(counts)
    plan = StreamPlan(source.fingerprint(), counts, 16)
    assert result.finished and result.num_batches == plan.num_batches == 6 + 0 + 9 + 3
    assert result.metrics == {"id_sum": n * (n - 1) // 2}
    check_outputs(storage, n, plan)
    # one pass; with workers, each row group is read by one worker (but for a last one or two)
    assert n <= log.total() <= n + num_workers * 32


def test_max_batches_keeps_the_first_batches(tmp_path: Path) -> None:
    write_parquet_files(str(tmp_path / "data"), [20, 20], row_group=10)
    storage = str(tmp_path / "storage")
    with pytest.warns(UserWarning, match="max_batches"):
        torch_batch_process(Collect, sources.parquet(str(tmp_path / "data")), batch_size=8, max_batches=9,
                            storage_path=str(tmp_path / "other"))
    result = torch_batch_process(Collect, sources.parquet(str(tmp_path / "data")), batch_size=8, max_batches=4,
                                 storage_path=storage)
    assert result.finished and result.num_batches == 4 and result.examples_processed == 8 + 8 + 4 + 8
    assert sorted(batch_records(storage)) == [0, 1, 2, 3]


def test_resume_at_90_percent_reads_few_rows_again(tmp_path: Path) -> None:
    counts = [2000] * 4
    write_parquet_files(str(tmp_path / "data"), counts, row_group=100)
    n = sum(counts)
    source = sources.parquet(str(tmp_path / "data"))
    log = sources.RowsReadLog(tmp_path / "reads")
    source.on_rows_read = log
    storage = str(tmp_path / "storage")
    stop_at = int(0.9 * n) // 50  # batch 144 of 160: 90% of the rows
    Failing = type("Collect", (Collect,), {"fail_at": stop_at, "__module__": Collect.__module__})
    with pytest.raises(RuntimeError, match=f"stop at {stop_at}"):
        torch_batch_process(Failing, source, batch_size=50, checkpoint_interval=4, storage_path=storage)
    first = log.total()
    log.reset()
    result = torch_batch_process(Collect, source, batch_size=50, checkpoint_interval=4, storage_path=storage)
    again = log.total()
    assert result.finished and result.batches_skipped == stop_at  # commits every 4 batches: 144 committed
    assert result.metrics == {"id_sum": n * (n - 1) // 2}
    check_outputs(storage, n)
    remaining = n - stop_at * 50
    assert remaining <= again <= remaining + 100, (first, again)  # at most one row group before the offset
    assert again <= 0.15 * n


def test_resume_with_other_files_is_refused(tmp_path: Path) -> None:
    write_parquet_files(str(tmp_path / "data"), [40, 40], row_group=10)
    storage = str(tmp_path / "storage")
    with pytest.raises(RuntimeError, match="stop at 0"):
        torch_batch_process(CollectFails, sources.parquet(str(tmp_path / "data")), batch_size=8, storage_path=storage)
    write_parquet_files(str(tmp_path / "data"), [40, 41], row_group=10)
    with pytest.raises(JobMismatchError):
        torch_batch_process(Collect, sources.parquet(str(tmp_path / "data")), batch_size=8, storage_path=storage)


def test_bucket_by_with_a_source_is_refused(tmp_path: Path) -> None:
    write_parquet_files(str(tmp_path / "data"), [10], row_group=10)
    with pytest.raises(InvalidArgumentError, match="bucket_by"):
        torch_batch_process(
            Collect, sources.parquet(str(tmp_path / "data")), batch_size=4, bucket_by=[1] * 10,
            storage_path=str(tmp_path / "storage"),
        )
    assert not (tmp_path / "storage").exists()


def _gen(starts: list[int], size: int):
    for start in starts:
        for i in range(size):
            yield {"id": start * size + i}


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_hf_iterable_rows_counted_once_and_kept_for_resumes(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.IterableDataset.from_generator(_gen, gen_kwargs={"starts": list(range(4)), "size": 25})
    source = sources.from_hf(ds)
    assert source.num_rows is None and source.num_shards == 4
    log = sources.RowsReadLog(tmp_path / "reads")
    source.on_rows_read = log
    storage = str(tmp_path / "storage")
    with pytest.raises(RuntimeError, match="stop at 0"):
        torch_batch_process(CollectFails, source, batch_size=10, storage_path=storage)
    assert 100 + 10 <= log.total() <= 100 + 25  # the counting pass, then batch 0 (from a chunk of shard 0)
    stored = list((tmp_path / "storage" / "_tbp" / "source_rows").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text()) == [25] * 4
    log.reset()
    result = torch_batch_process(Collect, source, batch_size=10, storage_path=storage)
    assert 90 <= log.total() <= 100  # the counts were read back: no second counting pass
    assert result.finished and result.num_batches == 4 * 3  # a batch never spans two shards
    assert result.metrics == {"id_sum": 100 * 99 // 2}
    check_outputs(storage, 100)


def open_range_shard(shard: tuple[int, int]):
    start, stop = shard
    return ({"id": i} for i in range(start, stop))


@pytest.mark.parametrize("kind", ["jsonl", "jsonl_counted", "sharded"])
def test_jsonl_and_sharded_jobs(tmp_path: Path, kind: str) -> None:
    bounds = [(0, 33), (33, 33), (33, 90)]
    if kind == "sharded":
        source = sources.Sharded(bounds, open_range_shard, names=[f"r{a}-{b}" for a, b in bounds])
    else:
        for k, (a, b) in enumerate(bounds):
            (tmp_path / f"d{k}.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(a, b)))
        source = sources.jsonl(str(tmp_path / "d*.jsonl"), count_rows=kind == "jsonl_counted")
    storage = str(tmp_path / "storage")
    result = torch_batch_process(Collect, source, batch_size=8, checkpoint_interval=2, storage_path=storage)
    assert result.finished and result.num_batches == 5 + 0 + 8
    assert result.metrics == {"id_sum": 90 * 89 // 2}
    check_outputs(storage, 90)
    counted = list((tmp_path / "storage" / "_tbp" / "source_rows").glob("*.json"))
    assert len(counted) == (0 if kind == "jsonl_counted" else 1)  # counted once unless the source knows


BAD_ROWS = {3, 41, 42, 97, 180}  # failing rows of the on_error="skip" stream jobs (global row numbers)


class SkipBad(Collect):
    """Fails on the rows of BAD_ROWS (while ``fail`` is set) after writing a file: a failed part leaves nothing."""

    fail = True

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch["id"]]
        assert ids == list(self.context.batch_indices)
        with self.context.upload_path() as path:
            (path / f"batch_{batch_idx}.json").write_text(json.dumps({"ids": ids, "indices": ids}))
        if type(self).fail and BAD_ROWS.intersection(ids):
            raise ValueError(f"bad rows in {ids}")
        self.total.update(sum(ids))


class SkipFixed(SkipBad):
    fail = False


SkipFixed.__qualname__ = "SkipBad"  # the same job, as if the user fixed the bug: retry_failed


def collate_refusing_bad(rows: list[dict[str, Any]]) -> Any:
    """A collate_fn that fails on the rows of BAD_ROWS: their failures are recorded as ``phase="load"``."""
    bad = BAD_ROWS.intersection(int(row["id"]) for row in rows)
    if bad:
        raise ValueError(f"cannot collate rows {sorted(bad)}")
    return default_collate(rows)


def write_jsonl_files(folder: Path, counts: list[int], broken: set[int] = frozenset()) -> str:
    """Files ``part-<k>.jsonl`` whose ``id`` is the global row number (the rows of ``broken``: a line that is not
    JSON); returns their glob."""
    folder.mkdir(parents=True)
    base = 0
    for k, n in enumerate(counts):
        rows = ("{not json" if base + i in broken else json.dumps({"id": base + i, "x": float(i)}) for i in range(n))
        lines = "".join(line + "\n" for line in rows)
        (folder / f"part-{k}.jsonl").write_text(lines)
        base += n
    return str(folder / "*.jsonl")


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
@pytest.mark.parametrize("kind, num_workers", [("parquet", 0), ("parquet", 2), ("jsonl", 0), ("jsonl_broken", 2)])
def test_on_error_skip_with_a_source(tmp_path: Path, kind: str, num_workers: int) -> None:
    """A stream job with failing rows (DESIGN §11 with §12): parts of a failing batch are read again by row
    number (Parquet: as Arrow, collated from columns), the failing rows are recorded by global row number
    and skipped, every other row's output is committed once; retry_failed clears them."""
    counts = [60, 0, 70, 75]
    n = sum(counts)
    if kind == "parquet":
        write_parquet_files(str(tmp_path / "data"), counts, row_group=16)
        source = sources.parquet(str(tmp_path / "data" / "*.parquet"))
        loader: dict[str, Any] = {"num_workers": num_workers}
    elif kind == "jsonl":  # the collate_fn refuses the bad rows
        source = sources.jsonl(write_jsonl_files(tmp_path / "data", counts))
        loader = {"num_workers": num_workers, "collate_fn": collate_refusing_bad}
    else:  # the bad rows' lines are not JSON: the source fails to read them (SourceDataError), a row's failure
        source = sources.jsonl(write_jsonl_files(tmp_path / "data", counts, broken=BAD_ROWS))
        loader = {"num_workers": num_workers}
    storage = str(tmp_path / "storage")
    processor = SkipBad if kind == "parquet" else SkipFixed  # jsonl: loading fails instead
    result = torch_batch_process(
        processor, source, batch_size=8, checkpoint_interval=3, on_error="skip", max_failures=10,
        dataloader_kwargs=loader, storage_path=storage,
    )
    good = [i for i in range(n) if i not in BAD_ROWS]
    assert result.finished and result.failed_examples == len(BAD_ROWS)
    assert result.metrics == {"id_sum": sum(good)}
    failures = tbp.read_failures(storage)
    assert [f["index"] for f in failures] == sorted(BAD_ROWS)
    assert {f["phase"] for f in failures} == {"process" if kind == "parquet" else "load"}
    ids: Counter[int] = Counter()
    for data in read_outputs(storage, "batch_*.json").values():  # the parts' files included (part_<first>/)
        ids.update(json.loads(data)["ids"])
    assert ids == Counter(good), "a failed part's file is never committed; every good row's once"

    if kind == "parquet":  # the user fixes the bug: only the failed rows run again, by row number
        retry = torch_batch_process(
            SkipFixed, source, batch_size=8, checkpoint_interval=3, on_error="skip", retry_failed=True,
            dataloader_kwargs=loader, storage_path=storage,
        )
        assert retry.finished and retry.failed_examples == 0
        assert retry.metrics == {"id_sum": sum(BAD_ROWS)}
        assert tbp.read_failures(storage) == []


def test_a_shard_shorter_than_counted_fails_the_job_even_with_on_error_skip(tmp_path: Path) -> None:
    """A shard that ends before its declared row count is no row's fault: the job fails (SourceChangedError),
    nothing is recorded as a failure, and the error names the shard."""
    source = sources.Sharded([(0, 16), (16, 30)], open_range_shard, num_rows=[16, 20], names=["a", "b"])
    storage = str(tmp_path / "storage")
    with pytest.raises(sources.SourceChangedError, match="'b' ended after 14 rows but num_rows says 20"):
        torch_batch_process(Collect, source, batch_size=4, on_error="skip", storage_path=storage)
    assert tbp.read_failures(storage) == []


def test_a_refused_job_leaves_storage_unchanged_even_after_counting(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    write_parquet_files(str(tmp_path / "data"), [30], row_group=10)
    storage = str(tmp_path / "storage")
    torch_batch_process(Collect, sources.parquet(str(tmp_path / "data")), batch_size=8, storage_path=storage)
    before = tree_digest(storage)
    ds = datasets.IterableDataset.from_generator(_gen, gen_kwargs={"starts": [0, 1], "size": 15})
    with pytest.raises(JobMismatchError):
        torch_batch_process(Collect, sources.from_hf(ds), batch_size=8, storage_path=storage)
    assert tree_digest(storage) == before


# ====================================================================== several processes, kill -9


def _attempt_killed(spec: dict[str, Any], world_size: int, attempt: int, rng: random.Random, total: int) -> None:
    """Starts an attempt, waits until it has committed something, SIGKILLs one rank at a random moment."""
    before = committed_batches(spec["storage"])
    procs = spawn_ranks(world_size, STREAM_JOB, json.dumps(dict(spec, attempt=attempt)))
    deadline = time.monotonic() + 120
    while committed_batches(spec["storage"]) <= before:
        if time.monotonic() > deadline:  # show where each rank is
            stacks = [stop_with_stacks(p)[1][-6000:] for p in procs]
            pytest.fail("the attempt never committed; the ranks' stderr and stacks:\n" + "\n----\n".join(stacks))
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.5))
    victim = rng.randrange(world_size)
    assert procs[victim].poll() is None, "the job ended before the kill"
    os.kill(procs[victim].pid, signal.SIGKILL)
    outcomes = wait_all(procs, timeout=90)  # the survivors notice and exit, never hang
    assert all(rc is not None for rc, _, _ in outcomes), "a surviving rank hung"
    assert outcomes[victim][0] == -signal.SIGKILL
    assert committed_batches(spec["storage"]) < total, "the job finished before the kill"


def run_kill_resume(
    tmp_path: Path, storage: str, source: dict[str, Any], counts: list[int], batch_size: int, **extra: Any
) -> dict:
    """2 processes killed with SIGKILL mid-run, then 3 processes (killed again, unless the job is short), then
    1 to the end: every row exactly once, exact metrics."""
    rng = random.Random(7)
    spec = {
        "source": source,
        "batch_size": batch_size,
        "checkpoint_interval": 3,
        "sleep": 0.02,
        "storage": storage,
        "report_dir": str(tmp_path / "reports"),
        **extra,
    }
    n, total = sum(counts), sum(-(-c // batch_size) for c in counts)
    _attempt_killed(spec, 2, 1, rng, total)
    _attempt_killed(spec, 3, 2, rng, total)
    # the last attempt is not killed: its batches need not be slow
    outcomes = wait_all(spawn_ranks(1, STREAM_JOB, json.dumps(dict(spec, attempt=3, sleep=0))), timeout=180)
    assert outcomes[0][0] == 0, outcomes[0][2][-3000:]
    result = read_reports(spec, 3)[0]["result"]
    assert result["finished"] and result["attempt"] == 3 and result["batches_skipped"] > 0
    assert result["metrics"] == {"id_sum": n * (n - 1) // 2}
    check_outputs(storage, n)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_parquet_kill9_resume_with_3_then_1(tmp_path: Path, schedule: str) -> None:
    counts = [300, 250, 0, 310, 140]
    write_parquet_files(str(tmp_path / "data"), counts, row_group=40)
    run_kill_resume(
        tmp_path, str(tmp_path / "storage"), {"kind": "parquet", "url": str(tmp_path / "data" / "*.parquet")},
        counts, 10, kwargs={"schedule": schedule}, dataloader_kwargs={"num_workers": 2},
    )


@pytest.mark.slow
def test_parquet_on_error_skip_kill9_resume_with_3_then_1(tmp_path: Path) -> None:
    """Failing rows of a stream, kill -9 twice and other world sizes: every good row's output once, every failing
    row listed once (by global row number), exact metrics. (The static schedule: with the dynamic one the
    survivors of a kill go on until the heartbeats' silence, longer than this job.)"""
    counts = [300, 250, 310]
    n, batch_size = sum(counts), 10
    bad = [7, 8, 299, 300, 555, 801]
    write_parquet_files(str(tmp_path / "data"), counts, row_group=40)
    rng = random.Random(11)
    spec = {
        "source": {"kind": "parquet", "url": str(tmp_path / "data" / "*.parquet")},
        "batch_size": batch_size, "checkpoint_interval": 3, "sleep": 0.05, "fail_rows": bad,
        "kwargs": {"on_error": "skip"}, "dataloader_kwargs": {"num_workers": 1},
        "storage": str(tmp_path / "storage"), "report_dir": str(tmp_path / "reports"),
    }
    total = sum(-(-c // batch_size) for c in counts)
    _attempt_killed(spec, 2, 1, rng, total)
    _attempt_killed(spec, 3, 2, rng, total)
    # the last attempt is not killed: its batches need not be slow
    outcomes = wait_all(spawn_ranks(1, STREAM_JOB, json.dumps(dict(spec, attempt=3, sleep=0))), timeout=180)
    assert outcomes[0][0] == 0, outcomes[0][2][-3000:]
    result = read_reports(spec, 3)[0]["result"]
    good = [i for i in range(n) if i not in bad]
    assert result["finished"] and result["failed_examples"] == len(bad)
    assert result["metrics"] == {"id_sum": sum(good)}
    assert [f["index"] for f in tbp.read_failures(spec["storage"])] == bad
    ids: Counter[int] = Counter()
    for data in read_outputs(spec["storage"], "batch_*.json").values():
        ids.update(json.loads(data)["ids"])
    assert ids == Counter(good)


@pytest.mark.slow
@pytest.mark.s3
def test_parquet_on_s3_kill9_resume_with_3_then_1(tmp_path: Path, s3_url: str) -> None:
    counts = [200, 160, 240]
    write_parquet_files(f"{s3_url}/data", counts, row_group=30)
    run_kill_resume(
        tmp_path, f"{s3_url}/storage", {"kind": "parquet", "url": f"{s3_url}/data/*.parquet"}, counts, 10,
        sleep=0.5,  # slow enough that the test's look at the S3 commit records (a second or more under load) and
    )  # the kill after it land before 3 ranks finish the remaining batches


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_hf_iterable_kill9_resume_with_3_then_1(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    counts = [200, 170, 230, 150]
    files = write_parquet_files(str(tmp_path / "data"), counts, row_group=50)
    run_kill_resume(
        tmp_path, str(tmp_path / "storage"), {"kind": "hf_parquet", "files": files}, counts, 10,
        dataloader_kwargs={"num_workers": 1},
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
