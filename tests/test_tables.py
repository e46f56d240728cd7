"""Table outputs (DESIGN §16): context.write() rows committed exactly once into Delta Lake, Iceberg and Lance tables.

Every format: rows read back in dataset order (read_outputs, iter_outputs), by the format's own reader and by polars
or DuckDB; the idempotency key in the table's own metadata; compaction; schema rules; clear errors before any write;
kill -9 around the table transaction (one process, the test hook), and 2-rank jobs killed at random moments and
resumed with other world sizes (slow), on local storage and on S3 (moto) for Delta.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import JOBS, base_env, read_reports, spawn_ranks, start_process, wait_all, wait_for_progress

from torch_batch_process import (
    InvalidArgumentError,
    JobMismatchError,
    SchemaConflictError,
    TorchBatchProcessor,
    iter_outputs,
    read_outputs,
    tables,
    torch_batch_process,
)

pa = pytest.importorskip("pyarrow")

TABLE_JOB = JOBS / "table_job.py"
FORMATS = ["delta", "iceberg", "lance"]
_MODULES = {"delta": "deltalake", "iceberg": "pyiceberg", "lance": "lance"}


def need(fmt: str) -> None:
    pytest.importorskip(_MODULES[fmt], reason=f"pip install 'torch-batch-process[{fmt}]'")


def table_spec(fmt: str, root: Path, storage_options: dict[str, str] | None = None, uri: str | None = None) -> dict:
    """The JSON description of a table target (tests/jobs/table_job.py builds it in the workers)."""
    need(fmt)
    if fmt == "iceberg":
        catalog = {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/warehouse"}
        return {"format": "iceberg", "identifier": "db.rows", "catalog": catalog}
    spec: dict[str, Any] = {"format": fmt, "uri": uri or str(root / f"rows.{fmt}")}
    if storage_options:
        spec["storage_options"] = storage_options
    return spec


def target_of(spec: dict) -> Any:
    interval = spec.get("commit_interval_s", 1.0)
    if spec["format"] == "delta":
        return tables.delta(spec["uri"], storage_options=spec.get("storage_options"), commit_interval_s=interval)
    if spec["format"] == "iceberg":
        return tables.iceberg(spec["identifier"], catalog=spec["catalog"], commit_interval_s=interval)
    return tables.lance(spec["uri"], storage_options=spec.get("storage_options"), commit_interval_s=interval)


@pytest.fixture(autouse=True)
def _quiet_polars(monkeypatch):
    monkeypatch.setenv("POLARS_ICEBERG_PLANNER", "pyiceberg")  # no plugin installed: plan with pyiceberg, silently


def own_reader_indices(spec: dict) -> list[int]:
    """The table's ``index`` column as the format's own reader returns it."""
    if spec["format"] == "delta":
        from deltalake import DeltaTable, QueryBuilder

        table = DeltaTable(spec["uri"], storage_options=spec.get("storage_options"))
        reader = QueryBuilder().register("t", table).execute('SELECT "index" FROM t')
        return [i for batch in reader for i in pa.record_batch(batch).column(0).to_pylist()]
    if spec["format"] == "iceberg":
        from pyiceberg.catalog import load_catalog

        table = load_catalog("default", **spec["catalog"]).load_table(spec["identifier"])
        return table.scan(selected_fields=("index",)).to_arrow().column("index").to_pylist()
    import lance

    return lance.dataset(spec["uri"], storage_options=spec.get("storage_options")).to_table(columns=["index"]).column(
        "index"
    ).to_pylist()


def other_reader_indices(spec: dict) -> list[int]:
    """The ``index`` column as polars (Delta, Iceberg) or DuckDB (Lance) reads the table with its own reader."""
    if spec["format"] == "delta":
        pl = pytest.importorskip("polars")
        return pl.read_delta(spec["uri"], storage_options=spec.get("storage_options"))["index"].to_list()
    if spec["format"] == "iceberg":
        pl = pytest.importorskip("polars")
        from pyiceberg.catalog import load_catalog

        table = load_catalog("default", **spec["catalog"]).load_table(spec["identifier"])
        return pl.scan_iceberg(table).select("index").collect()["index"].to_list()
    duckdb = pytest.importorskip("duckdb")
    import lance

    dataset = lance.dataset(spec["uri"], storage_options=spec.get("storage_options"))  # noqa: F841 - DuckDB scans it
    return [row[0] for row in duckdb.sql("SELECT index FROM dataset").fetchall()]


def assert_each_index_once(spec: dict, n: int) -> None:
    for reader in (own_reader_indices, other_reader_indices):
        indices = reader(spec)
        assert sorted(indices) == list(range(n)), (reader.__name__, len(indices), len(set(indices)))


class Embed(TorchBatchProcessor):
    """Example ``i`` -> ``emb=[i, i+0.5, -i]`` (float32), ``label="ex<i>"``; ``kind`` overrides per batch."""

    kind: dict[int, Any] = {}

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        rows = {"emb": torch.stack([torch.tensor([i, i + 0.5, -i]) for i in ids]), "label": [f"ex{i}" for i in ids]}
        extra = self.kind.get(batch_idx, self.kind.get(-1))
        if extra is not None:
            rows["count"] = extra(ids)
        self.context.write(rows)


def run_job(tmp_path: Path, target: Any, n: int = 60, interval: int = 1, **kwargs: Any) -> Any:
    return torch_batch_process(
        Embed, list(range(n)), batch_size=4, checkpoint_interval=interval, storage_path=str(tmp_path / "job"),
        table=target, progress=False, **kwargs,
    )


# ------------------------------------------------------------------ one process, in the test's process


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_go_into_the_table_once_and_read_back_in_order(tmp_path, fmt, monkeypatch):
    spec = table_spec(fmt, tmp_path)
    target = target_of(spec)
    result = run_job(tmp_path, target, n=60, interval=1)  # a commit per batch, then compaction
    assert result.batches_committed == 15
    assert_each_index_once(spec, 60)
    table = read_outputs(target)
    assert table.column("index").to_pylist() == list(range(60))
    assert table.column("label").to_pylist() == [f"ex{i}" for i in range(60)]
    emb = table.column("emb").to_pylist()
    assert emb[7] == [7.0, 7.5, -7.0]
    if fmt == "lance":  # fixed-shape tensors stay fixed-size lists: Lance can index them as vectors
        assert pa.types.is_fixed_size_list(table.schema.field("emb").type)
    assert read_outputs(target, columns=["label"]).column_names == ["index", "label"]
    import torch_batch_process.outputs.tables.reading as readback

    monkeypatch.setattr(readback, "WINDOW_ROWS", 16)  # several windows
    batches = list(iter_outputs(target, batch_rows=5))
    assert [i for b in batches for i in b.column(0).to_pylist()] == list(range(60))
    assert max(b.num_rows for b in batches) <= 5
    opened = target.open()
    assert opened.live_files() == 1  # compacted
    latest = json.loads(sorted((tmp_path / "job" / "_tbp" / "commits").iterdir())[-1].read_text())
    job = json.loads((tmp_path / "job" / "_tbp" / "job.json").read_text())
    job_id = f"{job['job_name']}-{int(job['created'] * 1e6):x}"
    assert 0 < opened.committed_key(job_id) <= latest["commit"]  # the idempotency key, in the table's own metadata
    assert "table" not in latest  # nothing pending: the final record's rows are in the table


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_finished_job_run_again_adds_nothing_and_compact_false_keeps_the_files(tmp_path, fmt):
    spec = table_spec(fmt, tmp_path)
    target = target_of(spec)
    target = type(target)(**{**target.__dict__, "compact": False})
    run_job(tmp_path, target, n=24, interval=1)
    files = target.open().live_files()
    assert files > 1
    again = run_job(tmp_path, target, n=24, interval=1)
    assert again.batches_committed == 6
    assert_each_index_once(spec, 24)
    assert target.open().live_files() == files


def test_the_table_is_refused_when_resuming_with_another_one(tmp_path):
    need("lance")
    run_job(tmp_path, tables.lance(tmp_path / "a.lance"), n=8)
    with pytest.raises(JobMismatchError, match="table"):
        run_job(tmp_path, tables.lance(tmp_path / "b.lance"), n=8)


def test_an_existing_table_is_appended_to_by_another_job(tmp_path):
    need("delta")
    target = tables.delta(tmp_path / "rows")
    run_job(tmp_path / "one", target, n=12)
    run_job(tmp_path / "two", target, n=12)
    assert sorted(read_outputs(target).column("index").to_pylist()) == sorted(list(range(12)) * 2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_narrower_types_are_widened_and_wider_ones_refused_before_any_write(tmp_path, fmt):
    target = target_of(table_spec(fmt, tmp_path))
    Embed.kind = {
        -1: lambda ids: torch.tensor(ids, dtype=torch.int64),
        2: lambda ids: torch.tensor(ids, dtype=torch.int32),
    }
    try:
        run_job(tmp_path, target, n=16)  # batch 2's int32 counts go into the int64 column
        table = read_outputs(target)
        assert table.schema.field("count").type == pa.int64() and table.column("count").to_pylist() == list(range(16))
        Embed.kind = {-1: lambda ids: torch.tensor(ids, dtype=torch.int64), 0: lambda ids: [float(i) for i in ids]}
        with pytest.raises(SchemaConflictError, match="'count'.*wider type"):
            run_job(tmp_path / "again", target, n=16)
        assert sorted(read_outputs(target).column("index").to_pylist()) == list(range(16))  # the refused job added none
    finally:
        Embed.kind = {}


@pytest.mark.parametrize("fmt", ["delta", "lance"])
def test_columns_the_table_cannot_type_are_refused_naming_them(tmp_path, fmt):
    target = target_of(table_spec(fmt, tmp_path))
    Embed.kind = {-1: lambda ids: [None] * len(ids)}
    try:
        with pytest.raises(SchemaConflictError, match="'count' is all None"):
            run_job(tmp_path, target, n=8)
    finally:
        Embed.kind = {}


def test_bad_targets_are_clear_errors_before_any_write(tmp_path, monkeypatch):
    need("iceberg")
    storage = tmp_path / "job"
    with pytest.raises(InvalidArgumentError, match="table must be a table target"):
        run_job(tmp_path, "delta://x")
    with pytest.raises(InvalidArgumentError, match="output_format='jsonl'.*remove output_format"):
        run_job(tmp_path, tables.lance(tmp_path / "x.lance"), output_format="jsonl")
    with pytest.raises(InvalidArgumentError, match="namespace.table"):
        tables.iceberg("rows")
    with pytest.raises(InvalidArgumentError, match="catalog cannot be used"):
        run_job(tmp_path, tables.iceberg("db.rows", catalog={"type": "nosuch"}))
    with pytest.raises(InvalidArgumentError, match="commit_interval_s must be a number of seconds"):
        tables.lance(tmp_path / "x.lance", commit_interval_s=-1)
    with pytest.raises(InvalidArgumentError, match="storage_options must be a dict of str"):
        tables.delta(tmp_path / "d", storage_options={"AWS_ALLOW_HTTP": True})
    monkeypatch.setitem(sys.modules, "deltalake", None)  # as if the extra were not installed
    from torch_batch_process.shell_commands import pip_install

    with pytest.raises(InvalidArgumentError, match=re.escape(pip_install("delta"))):  # as it runs here
        run_job(tmp_path, tables.delta(tmp_path / "d"))
    monkeypatch.setitem(sys.modules, "lance", None)
    with pytest.raises(InvalidArgumentError, match=re.escape(pip_install("lance"))):  # found, not imported
        run_job(tmp_path, tables.lance(tmp_path / "l.lance"))
    assert not storage.exists()  # nothing was written


def test_table_uris_with_a_typo_an_unknown_scheme_or_on_a_file_are_refused_before_any_write(tmp_path, monkeypatch):
    """tables.lance('s3:/b/x') wrote a local dataset ./s3:/b/x; tables.delta('bogus://x') failed only at the first
    table commit, after the job had opened its storage; a table uri on a file raised delta-rs' raw OSError."""
    need("delta")
    need("lance")
    monkeypatch.chdir(tmp_path)
    for make in (tables.delta, tables.lance):
        with pytest.raises(InvalidArgumentError, match=r"looks like a URL with a typo.*Did you mean 's3://b/x'"):
            make("s3:/b/x")
    with pytest.raises(InvalidArgumentError, match=r"tables.delta\('bogus://x/t'\): Unknown scheme: bogus"):
        run_job(tmp_path, tables.delta("bogus://x/t"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="cannot be read.*write to another table"):
        run_job(tmp_path, tables.delta(tmp_path / "file"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing was written


def test_reading_the_storage_of_a_table_job_names_the_table(tmp_path):
    need("lance")
    run_job(tmp_path, tables.lance(tmp_path / "rows.lance"), n=8)
    with pytest.raises(InvalidArgumentError, match=r"lance table .*rows.lance.*read_outputs\(tables.lance"):
        read_outputs(tmp_path / "job")


# ------------------------------------------------------------------ kill -9 around the table transaction


def run_process(spec: dict, env: dict[str, str] | None = None, timeout: float = 120) -> int | None:
    proc = start_process([sys.executable, str(TABLE_JOB), json.dumps(spec)], base_env(**(env or {})))
    (rc, _, err), = wait_all([proc], timeout=timeout)
    assert rc in (0, -signal.SIGKILL), err[-4000:]
    return rc


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.slow  # the job in a process of its own twice (a kill -9 in the compaction, then the re-run)
def test_kill9_in_the_final_compaction_then_the_rerun_compacts_the_finished_table(tmp_path, fmt):
    spec = {
        "table": dict(table_spec(fmt, tmp_path), commit_interval_s=0),  # a transaction per record: many small files
        "n": 40, "batch_size": 4, "checkpoint_interval": 1,
        "storage": str(tmp_path / "job"), "report_dir": str(tmp_path / "reports"),
    }
    assert run_process(spec, {"TBP_TEST_TABLE_KILL": "compact:1"}) == -signal.SIGKILL
    target = target_of(spec["table"])
    assert_each_index_once(spec["table"], 40)  # every row is in the table: the kill came after the final transaction
    assert target.open().live_files() > 1  # not compacted
    assert not (tmp_path / "job" / "result.json").exists()
    assert run_process(dict(spec, attempt=2)) == 0
    assert target.open().live_files() == 1  # the finished job's re-run compacted it
    assert_each_index_once(spec["table"], 40)
    assert read_outputs(target).column("index").to_pylist() == list(range(40))
    assert (tmp_path / "job" / "result.json").exists()
    assert run_process(dict(spec, attempt=3), {"TBP_TEST_TABLE_KILL": "compact:1"}) == 0  # finished: no compaction


@pytest.mark.parametrize(
    ("moment", "fmt"),
    [(moment, fmt) for moment in ("before", "after") for fmt in FORMATS],
)
@pytest.mark.slow  # each starts the job in a process of its own twice (a kill -9, then the re-run)
def test_kill9_between_the_record_and_the_table_transaction_neither_loses_nor_duplicates(tmp_path, fmt, moment):
    spec = {
        "table": dict(table_spec(fmt, tmp_path), commit_interval_s=0),  # a transaction per record: the 2nd is mid-job
        "n": 40, "batch_size": 4, "checkpoint_interval": 1, "sleep": 0.05,
        "storage": str(tmp_path / "job"), "report_dir": str(tmp_path / "reports"),
    }
    assert run_process(spec, {"TBP_TEST_TABLE_KILL": f"{moment}:2"}) == -signal.SIGKILL
    before = own_reader_indices(spec["table"]) if target_of(spec["table"]).open().exists() else []
    assert len(before) == len(set(before)) < 40, len(before)  # killed mid-job, around its 2nd table transaction
    if fmt == "delta":  # a data file of a stage never committed (as a kill mid-stage leaves), and another job's
        job = json.loads((tmp_path / "job" / "_tbp" / "job.json").read_text())
        uid = f"{job['job_name']}-{int(job['created'] * 1e6):x}"
        orphan = Path(spec["table"]["uri"], f"tbp-{uid}-s00000099-r1-a1-00000.parquet")
        foreign = Path(spec["table"]["uri"], "tbp-otherjob-1-s00000099-r1-a1-00000.parquet")
        orphan.write_bytes(b"not committed")
        foreign.write_bytes(b"another job's")
    assert run_process(dict(spec, attempt=2)) == 0
    assert_each_index_once(spec["table"], 40)
    assert read_outputs(target_of(spec["table"])).column("index").to_pylist() == list(range(40))
    if fmt == "delta":  # the data files the killed attempt wrote for stages never committed are gone
        root = Path(spec["table"]["uri"])
        added = {
            json.loads(line)["add"]["path"]
            for log in (root / "_delta_log").glob("*.json")
            for line in log.read_text().splitlines()
            if '"add"' in line
        }
        on_disk = {p.name for p in root.glob("tbp-*.parquet")}
        assert on_disk - added == {foreign.name}  # the orphan was deleted at the start, the other job's file kept


# ------------------------------------------------------------------ several processes, SIGKILL at random moments


def chaos(tmp_path: Path, spec_table: dict, seed: int, storage: str, n: int = 1200) -> None:
    """Attempts on 2, 2 and 3 ranks, each killed (a random rank at a random moment first, while most of the job is
    left; then rank 0 right after and right before a table transaction, by the hook), then one rank finishes the
    job: every index once in the table."""
    rng = random.Random(seed)
    spec = {
        "table": spec_table, "n": n, "batch_size": 5, "checkpoint_interval": rng.choice([1, 2, 3]), "sleep": 0.03,
        "storage": storage, "report_dir": str(tmp_path / "reports"), "progress_file": str(tmp_path / "progress"),
    }
    kills = [("random", 2), ("after", 2), ("before", 3)]
    for attempt, (how, world) in enumerate(kills, start=1):
        env = base_env()
        if how != "random":
            env["TBP_TEST_TABLE_KILL"] = f"{how}:{rng.randint(2, 4)}"
        Path(spec["progress_file"]).unlink(missing_ok=True)
        procs = spawn_ranks(world, TABLE_JOB, json.dumps(dict(spec, attempt=attempt)), env=env)
        if how == "random":
            try:
                wait_for_progress(Path(spec["progress_file"]), procs)
            except AssertionError as exc:  # a rank ended before its first batch: its error is in its report
                raise AssertionError(f"{exc}; reports: {read_reports(spec, attempt)}") from None
            time.sleep(rng.uniform(0.0, 0.8))
            os.kill(procs[rng.randrange(world)].pid, signal.SIGKILL)
        outcomes = wait_all(procs, timeout=120)
        assert all(rc is not None for rc, _, _ in outcomes), "a rank hung"
        assert any(rc == -signal.SIGKILL for rc, _, _ in outcomes), [(rc, err[-2000:]) for rc, _, err in outcomes]
        assert not any("result" in r for r in read_reports(spec, attempt).values()), "the job finished: kill earlier"
    procs = spawn_ranks(1, TABLE_JOB, json.dumps(dict(spec, attempt=len(kills) + 1, sleep=0)))  # nothing to kill
    (rc, _, err), = wait_all(procs, timeout=180)
    assert rc == 0, err[-4000:]
    assert_each_index_once(spec_table, n)
    target = target_of(spec_table)
    assert read_outputs(target).column("index").to_pylist() == list(range(n))
    assert target.open().live_files() == 1


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_kill9_chaos_then_resume_on_other_world_sizes_every_index_once(tmp_path, fmt):
    spec = dict(table_spec(fmt, tmp_path), commit_interval_s=0.2)  # transactions postponed, yet several per attempt
    chaos(tmp_path, spec, seed=FORMATS.index(fmt) + 11, storage=str(tmp_path / "job"))


@pytest.mark.slow
@pytest.mark.s3
def test_kill9_chaos_on_s3_delta_table_every_index_once(tmp_path, s3_url, moto_server):
    need("delta")
    bucket = s3_url.split("/")[2]
    options = {
        "AWS_ENDPOINT_URL": moto_server.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true", "AWS_S3_ALLOW_UNSAFE_RENAME": "true",
    }
    spec = dict(table_spec("delta", tmp_path, options, uri=f"s3://{bucket}/rows"), commit_interval_s=0)
    chaos(tmp_path, spec, seed=21, storage=s3_url, n=400)


# ------------------------------------------------------------------ units


def test_data_file_names_carry_the_job_and_the_stage():
    from torch_batch_process.outputs.tables.base import data_file_name, data_file_stage

    name = data_file_name("embed-1a2b", 12, 3, 2, 7)
    assert name == "tbp-embed-1a2b-s00000012-r3-a2-00007.parquet"
    assert data_file_stage(name, "embed-1a2b") == 12
    assert data_file_stage(name, "embed") is None  # another job's file is never this job's orphan
    assert data_file_stage("part-00001-abc.parquet", "embed-1a2b") is None


def test_table_types_are_normalized_or_refused_naming_the_column():
    from torch_batch_process.outputs.tables.base import normalize_schema

    schema = pa.schema([
        ("index", pa.int64()), ("v", pa.list_(pa.float32(), 4)), ("u", pa.uint8()), ("s", pa.large_string()),
        ("m", pa.list_(pa.list_(pa.int32(), 2), 3)),
    ])
    lists = normalize_schema(schema, fixed_lists=False, what="a Delta table", origin="batch 0")
    assert lists.field("v").type == pa.list_(pa.float32()) and lists.field("u").type == pa.int16()
    assert lists.field("s").type == pa.string() and lists.field("m").type == pa.list_(pa.list_(pa.int32()))
    fixed = normalize_schema(schema, fixed_lists=True, what="a Lance dataset", origin="batch 0")
    assert fixed.field("v").type == pa.list_(pa.float32(), 4)
    for bad, match in ((pa.float16(), "float16"), (pa.uint64(), "uint64"), (pa.null(), "all None")):
        with pytest.raises(SchemaConflictError, match=f"column 'x'.*{match}"):
            normalize_schema(pa.schema([("index", pa.int64()), ("x", bad)]), fixed_lists=False, what="a table",
                             origin="batch 3")


def test_table_transactions_are_paced_but_the_final_one_never_waits(tmp_path):
    need("lance")
    import lance

    target = tables.lance(tmp_path / "rows.lance", commit_interval_s=3600, compact=False)
    run_job(tmp_path, target, n=40, interval=1)  # 10 job commits
    dataset = lance.dataset(str(tmp_path / "rows.lance"))
    keys = [
        (dataset.read_transaction(v["version"]).transaction_properties or {}).get("tbp.commit")
        for v in dataset.versions()
    ]
    assert [k for k in keys if k] == ["1", keys[-1]] and keys[-1] != "1"  # the first commit's, then the final one's
    assert sorted(read_outputs(target).column("index").to_pylist()) == list(range(40))
    paced = tables.lance(tmp_path / "fast.lance", commit_interval_s=0, compact=False)
    run_job(tmp_path / "two", paced, n=40, interval=1)
    fast = lance.dataset(str(tmp_path / "fast.lance"))
    fast_keys = [
        (fast.read_transaction(v["version"]).transaction_properties or {}).get("tbp.commit") for v in fast.versions()
    ]
    assert len([k for k in fast_keys if k]) > 1  # at most one per commit, several here


def test_ranks_opening_a_new_sql_catalog_at_once_all_reach_it(tmp_path):
    """Every rank opens the catalog at its start; on a new SQL catalog each creates the catalog's tables, and
    sqlite refuses the losers of that race ("table ... already exists", "database is locked"): seen as a rank of
    the 2-rank chaos test failing before its first batch. The race is tried again, so every rank gets the catalog."""
    need("iceberg")
    import threading

    spec = table_spec("iceberg", tmp_path)
    start, errors, reached = threading.Barrier(8), [], []

    def open_catalog() -> None:
        start.wait()
        try:
            reached.append(target_of(spec).open().catalog())
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=open_catalog) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(reached) == 8, errors


# ------------------------------------------------------------------ a damaged or deleted table


class TableRows(TorchBatchProcessor):
    """One record row per example; SIGTERM to itself at batch ``stop_at``."""

    stop_at: int | None = None

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        self.context.write({"value": [int(v) for v in batch]})
        if batch_idx == type(self).stop_at:
            os.kill(os.getpid(), signal.SIGTERM)


class StoppingTableRows(TableRows):
    stop_at = 15


StoppingTableRows.__qualname__ = "TableRows"


def _stopped_table_job(tmp_path: Path) -> tuple[dict, Any]:
    need("delta")
    run = dict(batch_size=2, checkpoint_interval=2, storage_path=str(tmp_path / "job"), progress=False)
    target = tables.delta(str(tmp_path / "rows.delta"), commit_interval_s=0)
    assert torch_batch_process(StoppingTableRows, list(range(60)), table=target, **run).preempted
    return run, target


def test_a_table_whose_metadata_is_cut_short_is_named_not_a_bare_format_error(tmp_path):
    """delta-rs says "Kernel error: Json error: Truncated record..." and a backtrace, naming no table: the resume
    and read_outputs say which table cannot be read and what to do, before any work."""
    run, target = _stopped_table_job(tmp_path)
    log = sorted((tmp_path / "rows.delta" / "_delta_log").glob("*.json"))[-1]
    log.write_bytes(log.read_bytes()[:60])
    for call in (lambda: torch_batch_process(TableRows, list(range(60)), table=target, **run),
                 lambda: read_outputs(target)):
        with pytest.raises(InvalidArgumentError, match="rows.delta' cannot be read") as info:
            call()
        assert "restore it" in str(info.value) and "Json error" in str(info.value)


def test_a_table_deleted_after_it_received_committed_rows_is_refused_at_resume(tmp_path):
    """The records say which committed rows the table holds (those not pending): a table that holds no transaction
    of the job then was deleted or replaced, and re-adding only the pending files would make a table lacking rows
    (and referencing files deleted with it). The resume refuses; resume=False starts afresh."""
    import shutil

    from torch_batch_process import CheckpointCorruptError

    run, target = _stopped_table_job(tmp_path)
    shutil.rmtree(tmp_path / "rows.delta")
    with pytest.raises(CheckpointCorruptError, match="holds no transaction of this job") as info:
        torch_batch_process(TableRows, list(range(60)), table=target, **run)
    assert "resume=False" in str(info.value)
    assert not (tmp_path / "rows.delta").exists(), "nothing was written"
    assert torch_batch_process(TableRows, list(range(60)), table=target, resume=False, **run).finished
    assert read_outputs(target).column("value").to_pylist() == list(range(60))
