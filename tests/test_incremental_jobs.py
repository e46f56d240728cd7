"""Incremental runs of keyed jobs in real processes (DESIGN §21, issue 46): after a run over a dataset, 10% of its
examples change and 10% are appended; the run with ``incremental=True`` calls ``process_batch`` on exactly those,
``read_outputs``/``iter_outputs`` give every key once with its newest value, and the counts are in the result and
``tbp status``. Killed with SIGKILL at random moments of that run and resumed on other world sizes, the union of
what it processed is the selection, and no read between the kills returns a key twice.

Scaled down from the issue's 10**5 rows to 3,000 (CI budget); ``python -m benchmarks.incremental`` measures the
planner at scale.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from harness import JOBS, base_env, spawn_ranks, wait_all

from torch_batch_process import iter_outputs, read_outputs
from torch_batch_process.observe.status import format_status, read_status

pytestmark = pytest.mark.slow

SCRIPT = JOBS / "keyed_job.py"
N, EVERY, EXTRA = 3000, 10, 300
SELECTED = set(range(0, N, EVERY)) | set(range(N, N + EXTRA))
"""The indices run 2 must process: the changed ids (every 10th) and the appended ones (ids = indices)."""


def run(tmp: Path, spec: dict[str, Any], world_size: int, *, ok: bool = True, timeout: float = 240) -> list[dict]:
    """Runs the keyed job on ``world_size`` ranks; returns the ranks' reports."""
    reports = tmp / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    reports.mkdir(parents=True)
    spec = {"batch_size": 20, "checkpoint_interval": 2, "calls_dir": str(tmp / "calls"), **spec,
            "report_dir": str(reports)}
    env = base_env(TBP_SHARD_BYTES="1")  # a shard published per commit: reads between kills see the run's rows
    results = wait_all(spawn_ranks(world_size, SCRIPT, json.dumps(spec), env=env), timeout)
    if ok:
        for code, _out, err in results:
            assert code == 0, err[-3000:]
    return [json.loads(p.read_text()) for p in sorted(reports.glob("rank_*.json"))]


def calls(tmp: Path) -> list[list[int]]:
    """Every batch any process was given since the calls folder was last emptied."""
    return [json.loads(line) for path in sorted((tmp / "calls").glob("calls-*.jsonl"))
            for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job after its first run over N examples, on 2 ranks (copied by each test)."""
    tmp = tmp_path_factory.mktemp("first")
    storage = tmp / "storage"
    reports = run(tmp, {"n": N, "storage": str(storage)}, 2)
    assert reports[0]["result"]["finished"] and reports[0]["result"]["examples_processed"] == N
    table = read_outputs(storage)
    assert table.num_rows == N and sorted(table.column("id").to_pylist()) == list(range(N))
    assert set(table.column("_tbp_run").to_pylist()) == {1}
    return storage


def changed_spec(storage: Path, **more: Any) -> dict[str, Any]:
    return {"n": N, "changed_every": EVERY, "extra": EXTRA, "storage": str(storage),
            "kwargs": {"incremental": True}, **more}


def check_final(storage: Path) -> None:
    """Every id once, with the value of its newest text."""
    table = read_outputs(storage, columns=["id", "value", "_tbp_run"]).to_pydict()
    ids = table["id"]
    assert len(ids) == N + EXTRA and len(set(ids)) == N + EXTRA
    for key, value, run in zip(ids, table["value"], table["_tbp_run"], strict=True):
        text = f"NEW{key}" if key >= N else f"T{key}-V2" if key % EVERY == 0 else f"T{key}"
        assert value == text, (key, value, run)
        assert run == (2 if key in SELECTED else 1), (key, run)
    streamed = [row for batch in iter_outputs(storage, columns=["id", "value"]) for row in batch.to_pylist()]
    assert [r["id"] for r in streamed] == list(range(N + EXTRA))  # ids are the indices: index order, each once
    assert {r["id"]: r["value"] for r in streamed} == dict(zip(ids, table["value"], strict=True))


def test_incremental_run_processes_exactly_the_new_and_changed_examples(first_run: Path, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    shutil.copytree(first_run, storage)
    reports = run(tmp_path, changed_spec(storage), 2)
    batches = calls(tmp_path)
    processed = [i for batch in batches for i in batch]
    assert len(processed) == len(SELECTED) and set(processed) == SELECTED  # each selected example once, no other
    result = reports[0]["result"]
    assert reports[1]["result"]["increment"] == result["increment"]
    counts = result["increment"]
    assert (counts["new"], counts["changed"], counts["unchanged"], counts["selected"]) == (
        EXTRA, N // EVERY, N - N // EVERY, len(SELECTED))
    assert result["finished"] and result["examples_processed"] == len(SELECTED)
    check_final(storage)
    status = read_status(str(storage))  # what tbp status prints (--json, and as text)
    assert [(r["run"], r["state"], r["counts"]["new"], r["counts"]["changed"]) for r in status["runs"]] == [
        (2, "finished", EXTRA, N // EVERY)]
    text = format_status(status)
    assert f"{EXTRA} new, {N // EVERY} changed" in text and f"{N - N // EVERY:,} unchanged" in text

    # (the same dataset again selecting nothing, a changed version=: tests/test_incremental_api.py, in-process)


def test_incremental_run_killed_and_resumed_on_other_world_sizes(first_run: Path, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    shutil.copytree(first_run, storage)
    rng = random.Random(46)
    seen_new: set[int] = set()
    # 30 batches: killed at a random batch of a random rank on 2 ranks, then on 3, then resumed on 1
    for world_size, fewest, most in ((2, 5, 9), (3, 3, 4)):
        die = {"rank": rng.randrange(world_size), "batches": rng.randint(fewest, most)}
        run(tmp_path, changed_spec(storage, die_after=die), world_size, ok=False)
        status = read_status(str(storage))
        assert [r["state"] for r in status["runs"]] == ["unfinished"], status["runs"]  # the kill came mid-run
        between = read_outputs(storage, columns=["id", "_tbp_run"]).to_pydict()
        assert len(between["id"]) == len(set(between["id"]))  # never a key twice
        assert set(range(N)) <= set(between["id"])  # every stored key, with its old value or its new one
        seen_new |= {i for i, r in zip(between["id"], between["_tbp_run"], strict=True) if r == 2}
    assert seen_new  # the reads between kills saw rows of the killed run (its committed, published shards)
    reports = run(tmp_path, changed_spec(storage), 1)
    assert reports[0]["result"]["finished"]
    processed = {i for batch in calls(tmp_path) for i in batch}
    assert processed == SELECTED  # every attempt processed only selected examples, and all of them in the end
    check_final(storage)


def write_parquet(folder: Path, changed: bool) -> str:
    """The dataset of keyed_job.py as Parquet files of 500 rows (``changed``: every 10th text changed and the
    appended rows in a file of their own); returns their glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for old in folder.glob("*.parquet"):
        old.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "text": f"t{i}-v2" if changed and i % EVERY == 0 else f"t{i}"} for i in range(N)]
    rows += [{"id": i, "text": f"new{i}"} for i in range(N, N + EXTRA)] if changed else []
    for first in range(0, len(rows), 500):
        pq.write_table(pa.Table.from_pylist(rows[first:first + 500]), folder / f"part-{first:06d}.parquet",
                       row_group_size=100)
    return str(folder / "*.parquet")


def test_incremental_run_over_a_parquet_source_killed_and_resumed_on_another_world_size(tmp_path: Path) -> None:
    """key= names a column of a streamed source (DESIGN §21): run 1 on 1 rank; then 10% of the rows changed and
    10% appended in a new file; run 2 killed by SIGKILL on 2 ranks, resumed on 3: exactly the selected rows (global
    row numbers = ids here) processed, every key once with its newest value, never a key twice in between."""
    storage, data = tmp_path / "storage", tmp_path / "data"
    spec = {"storage": str(storage), "batch_size": 50, "n": N}
    assert run(tmp_path, {**spec, "parquet": write_parquet(data, False)}, 1)[0]["result"]["finished"]
    shutil.rmtree(tmp_path / "calls")
    again = {**spec, "parquet": write_parquet(data, True), "kwargs": {"incremental": True}}
    run(tmp_path, {**again, "die_after": {"rank": 1, "batches": 3}}, 2, ok=False)
    between = read_outputs(storage, columns=["id", "_tbp_run"]).to_pydict()
    assert len(between["id"]) == len(set(between["id"])) and set(range(N)) <= set(between["id"])
    assert [r["state"] for r in read_status(str(storage))["runs"]] == ["unfinished"]
    reports = run(tmp_path, again, 3)
    assert reports[0]["result"]["finished"] and reports[0]["result"]["increment"]["selected"] == len(SELECTED)
    assert {i for batch in calls(tmp_path) for i in batch} == SELECTED
    check_final(storage)


def table_spec(fmt: str, tmp: Path) -> dict[str, Any]:
    """A local table of format ``fmt`` (Iceberg: a SQL/sqlite catalog) for keyed_job.py."""
    if fmt == "iceberg":
        catalog = {"type": "sql", "uri": f"sqlite:///{tmp}/catalog.db", "warehouse": f"file://{tmp}/warehouse"}
        return {"format": "iceberg", "identifier": "db.keyed", "catalog": catalog}
    return {"format": fmt, "uri": str(tmp / f"table.{fmt}")}


def table_rows(spec: dict[str, Any]) -> dict[str, list]:
    """The table's ``id``, ``value`` and ``_tbp_run`` columns, read with the format's own reader."""
    import pyarrow as pa

    columns = ["id", "value", "_tbp_run"]
    if spec["format"] == "delta":
        from deltalake import DeltaTable, QueryBuilder

        query = 'SELECT id, value, "_tbp_run" FROM t'
        return pa.table(QueryBuilder().register("t", DeltaTable(spec["uri"])).execute(query).read_all()).to_pydict()
    if spec["format"] == "iceberg":
        from pyiceberg.catalog import load_catalog

        table = load_catalog("default", **spec["catalog"]).load_table(spec["identifier"])
        return table.scan(selected_fields=tuple(columns)).to_arrow().to_pydict()
    import lance

    return lance.dataset(spec["uri"]).to_table(columns=columns).to_pydict()


@pytest.mark.parametrize("fmt", ["delta", "iceberg", "lance"])
def test_keyed_table_killed_around_its_merge_transactions(fmt: str, tmp_path: Path) -> None:
    """A keyed job into a table: run 2's MERGE by key (Delta: add+remove; Iceberg: one overwrite snapshot; Lance: an
    Update with deletion files), killed right before its first table transaction (between a durable record and the
    table's commit: the next start replays it), then right after its second (the next start must not add it
    again), resumed: every key once in the table with its newest value, read with the format's own reader."""
    pytest.importorskip({"delta": "deltalake", "iceberg": "pyiceberg", "lance": "lance"}[fmt])
    n, spec = 400, table_spec(fmt, tmp_path)
    base = {"storage": str(tmp_path / "storage"), "table": spec, "batch_size": 10}
    run(tmp_path, {"n": n, **base}, 1)
    selected = set(range(0, n, EVERY)) | set(range(n, n + n // 10))
    shutil.rmtree(tmp_path / "calls")
    again = {"n": n, "changed_every": EVERY, "extra": n // 10, "kwargs": {"incremental": True}, **base}
    for kill in ("before:1", "after:2"):  # the resume's replay of the first is its transaction 1
        assert run(tmp_path, {**again, "table_kill": kill}, 1, ok=False) == []  # killed: no report
        between = table_rows(spec)["id"]
        assert sorted(between) == list(range(len(between)))  # never a key twice, none lost
    report = run(tmp_path, again, 1)[0]
    assert report["result"]["finished"] and {i for b in calls(tmp_path) for i in b} == selected
    rows = table_rows(spec)
    assert sorted(rows["id"]) == list(range(n + n // 10))  # every key once
    for key, value, run_ in zip(rows["id"], rows["value"], rows["_tbp_run"], strict=True):
        assert value == (f"NEW{key}" if key >= n else f"T{key}-V2" if key % EVERY == 0 else f"T{key}")
        assert run_ == (2 if key in selected else 1)


PLAN_KILLED = """
import os, signal, sys
from torch_batch_process import TorchBatchProcessor, torch_batch_process

class Rows(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        self.context.write({"value": [text.upper() for text in batch["text"]]})

seen, kill_at = [0], int(sys.argv[2])

def key(example):  # the planner calls it for every example: the process dies in the middle of its pass
    seen[0] += 1
    if seen[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return example["id"]

rows = [{"id": i, "text": f"t{i}" + ("x" if kill_at and i % 2 else "")} for i in range(4000)]
torch_batch_process(Rows, rows, batch_size=500, storage_path=sys.argv[1], key=key, incremental=True, progress=False)
"""


def test_a_kill_while_planning_leaves_no_spill_behind_once_the_run_resumes(tmp_path: Path) -> None:
    """The planner spills the keys to local partition files (GBs at 10**8 keys): a kill -9 in the middle of its pass
    leaves them, and the next start on the host removes them (they were left in the temporary folder for good, so
    that repeated preemptions while planning filled the disk), then plans again and finishes exactly once."""
    import subprocess
    import sys

    scratch, storage = tmp_path / "tmp", tmp_path / "job"
    scratch.mkdir()
    env = base_env(TMPDIR=str(scratch))

    def call(kill_at: int) -> int:
        command = [sys.executable, "-c", PLAN_KILLED, str(storage), str(kill_at)]
        return subprocess.run(command, env=env, capture_output=True, timeout=120).returncode

    assert call(0) == 0
    assert call(3000) == -9  # in the planner's pass over the dataset, its partitions spilled
    assert [p for p in scratch.iterdir() if "plan" in p.name], "the kill left the planner's spill"
    assert call(-1) == 0
    assert [p.name for p in scratch.iterdir() if "plan" in p.name] == []
    table = read_outputs(storage, columns=["key", "value"]).to_pydict()  # a key function's column: "key"
    assert sorted(table["key"]) == list(range(4000))
    values = dict(zip(table["key"], table["value"], strict=True))
    assert all(value == f"T{key}" + ("X" if key % 2 else "") for key, value in values.items())


def test_a_capped_run_on_two_ranks_leaves_the_failures_it_did_not_reach_listed(tmp_path: Path) -> None:
    """The job's failures are each key's newest failure over its runs: a run capped by max_batches (per rank, here
    2 ranks x 1 batch of 1) clears the failures it reached and leaves the one it did not, which ``read_failures`` and
    ``tbp status`` still list and the next run retries."""
    from torch_batch_process import read_failures

    storage, n = tmp_path / "storage", 200
    skip = {"on_error": "skip"}
    run(tmp_path, {"n": n, "storage": str(storage), "fail_ids": [30, 90, 150], "kwargs": skip}, 2)
    assert [f["key"] for f in read_failures(str(storage))] == [30, 90, 150]
    capped = {"n": n, "storage": str(storage), "batch_size": 1, "kwargs": {**skip, "incremental": True,
                                                                             "max_batches": 1}}
    shutil.rmtree(tmp_path / "calls")
    reports = run(tmp_path, capped, 2)
    assert reports[0]["result"]["increment"]["selected"] == 3 and sorted(sum(calls(tmp_path), [])) == [30, 90]
    assert [(f["key"], f["_tbp_run"]) for f in read_failures(str(storage))] == [(150, 1)]
    assert read_status(str(storage))["failed_examples"] == 1
    shutil.rmtree(tmp_path / "calls")
    reports = run(tmp_path, {**capped, "kwargs": {**skip, "incremental": True}}, 2)
    assert reports[0]["result"]["increment"]["failed"] == 1 and sum(calls(tmp_path), []) == [150]
    assert read_failures(str(storage)) == [] and read_status(str(storage))["failed_examples"] == 0
