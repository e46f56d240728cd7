"""Keyed jobs and incremental runs through the call, in this process (one rank; DESIGN §21, issue 46): the keyed
arguments checked before any work, duplicate keys refused naming the key, a changed ``version=`` refused or
recomputed, examples that failed (``on_error="skip"``) selected again, and a key whose new run failed hidden from
``read_outputs`` (its stale row is not served). Multi-process runs, kills and resumes: tests/test_incremental_jobs.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import tree_digest

from torch_batch_process import (
    CheckpointCorruptError,
    DuplicateKeyError,
    InvalidArgumentError,
    JobMismatchError,
    OutputCorruptError,
    TorchBatchProcessor,
    VersionChangedError,
    iter_outputs,
    read_outputs,
    tables,
    torch_batch_process,
)
from torch_batch_process.observe.status import format_status, read_status

FAILING: set[str] = set()
"""Texts the processor fails on (the test's 'bug', fixed between calls)."""
CALLS: list[list[int]] = []


class Upper(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        CALLS.append([int(i) for i in self.context.batch_indices])
        if FAILING & set(batch["text"]):
            raise ValueError(f"cannot process {sorted(FAILING & set(batch['text']))}")
        self.context.write({"value": [text.upper() for text in batch["text"]]})


def data(n: int, **texts: str) -> list[dict[str, Any]]:
    """``n`` examples ``{"id": i, "text": "t<i>"}``, some texts replaced (``t3="bad"``)."""
    return [{"id": i, "text": texts.get(f"t{i}", f"t{i}")} for i in range(n)]


def call(path: Path, dataset: list[dict[str, Any]], **kwargs: Any) -> Any:
    CALLS.clear()
    options: dict[str, Any] = {"key": "id", "batch_size": 4, "storage_path": str(path), "progress": False}
    return torch_batch_process(Upper, dataset, **(options | kwargs))


def rows(path: Path) -> dict[int, tuple[str, int]]:
    table = read_outputs(path, columns=["id", "value", "_tbp_run"]).to_pydict()
    assert len(table["id"]) == len(set(table["id"])), "a key read back twice"
    return {k: (v, r) for k, v, r in zip(table["id"], table["value"], table["_tbp_run"], strict=True)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": None, "incremental": True}, "incremental=True is for a keyed job: give key="),
        ({"key": None, "version": "v1"}, "version='v1' is for a keyed job"),
        ({"key": "index"}, "key='index'"),
        ({"key": 3}, "key must be the name of a field"),
        ({"on_change": "ignore"}, "on_change must be one of"),
        ({"incremental": "yes"}, "incremental must be True or False"),
        ({"version": object()}, "version must be a JSON value"),
        ({"version": float("nan")}, "version must be a JSON value"),  # NaN != NaN: the job could never match
        ({"retry_failed": True, "on_error": "skip"}, "run it with incremental=True instead"),
        ({"table": tables.delta("memory:///never-written")}, "key= with table=.* is not supported yet"),
        ({"content": ["text"], "key": None}, "give key= too"),
        ({"prune_missing": True, "key": None}, "prune_missing=True is for a keyed job"),
        ({"prune_missing": True}, "give incremental=True too"),
        ({"on_change": "recompute"}, "on_change='recompute' says what an incremental run does.*give incremental=True"),
        ({"prune_missing": 1, "incremental": True}, "prune_missing must be True or False"),
    ],
)
def test_keyed_arguments_are_checked_before_any_work(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        call(tmp_path / "job", data(8), **kwargs)
    assert not (tmp_path / "job").exists() and not CALLS


def test_duplicate_and_bad_keys_are_refused_before_any_work(tmp_path: Path) -> None:
    dataset = data(10)
    dataset[7]["id"] = 2
    with pytest.raises(DuplicateKeyError, match="examples 2 and 7 have the same key 2"):
        call(tmp_path / "dup", dataset)
    assert not CALLS and not (tmp_path / "dup" / "_tbp").exists()
    floats = [{"id": i + 0.5, "text": "t"} for i in range(4)]
    with pytest.raises(InvalidArgumentError, match="example 0 has the key 0.5 of type float"):
        call(tmp_path / "float", floats)
    assert not CALLS
    # a key or content function that raises, and a str key that is not Unicode text (no UTF-8 for Arrow/Parquet):
    # named, with the example, before any work
    bad: list[tuple[dict[str, Any], list[dict[str, Any]], str]] = [
        ({"key": lambda example: example["url"]}, data(6), r"key: the function .*<lambda> raised KeyError on example"),
        ({"content": lambda example: example["body"]}, data(6), r"content: the function .* raised KeyError on exam"),
        ({}, [{"id": "a\ud800b" if i == 4 else f"k{i}", "text": "t"} for i in range(6)],
         "example 4 has the key 'a\\\\ud800b', which is not Unicode text"),
        ({"key": "id\udcff"}, [{"id\udcff": i, "text": "t"} for i in range(6)],  # failed after the first batch
         "key='id\\\\udcff': the name is not Unicode text"),
    ]
    for n, (kwargs, dataset, message) in enumerate(bad):
        with pytest.raises(InvalidArgumentError, match=message):
            call(tmp_path / f"bad{n}", dataset, **kwargs)
        assert not CALLS and not (tmp_path / f"bad{n}" / "_tbp").exists()


def test_a_version_is_kept_as_json_gives_it_back(tmp_path: Path) -> None:
    """``version=`` is any JSON value, stored as JSON gives it back (a tuple as a list, int dict keys as strings): the
    finished job called again with it returns its stored result, and its incremental runs match it."""
    for n, version in enumerate([("model", 2), {1: "prompt"}]):
        path = tmp_path / f"job{n}"
        assert call(path, data(6), version=version).finished
        again = call(path, data(6), version=version)
        assert again.finished and not CALLS
        grown = call(path, data(8), version=version, incremental=True)
        assert (grown.increment["new"], grown.increment["unchanged"]) == (2, 6) and CALLS == [[6, 7]]


def test_keyed_rows_version_change_refused_or_recomputed(tmp_path: Path) -> None:
    path = tmp_path / "job"
    first = call(path, data(10), version="v1")
    assert first.finished and first.increment is None
    table = read_outputs(path)
    assert table.column_names == ["index", "value", "id", "_tbp_hash", "_tbp_version", "_tbp_run"]
    version = set(table.column("_tbp_version").to_pylist())
    assert len(version) == 1 and set(table.column("_tbp_run").to_pylist()) == {1}
    with pytest.raises(VersionChangedError, match="version: stored 'v1', now 'v2'"):
        call(path, data(10), version="v2", incremental=True)
    assert not CALLS and rows(path) == {i: (f"T{i}", 1) for i in range(10)}
    again = call(path, data(10), version="v2", incremental=True, on_change="recompute")
    assert again.increment["recompute"] == 10 and sorted(i for b in CALLS for i in b) == list(range(10))
    table = read_outputs(path)
    assert table.num_rows == 10 and set(table.column("_tbp_version").to_pylist()).isdisjoint(version)
    assert set(table.column("_tbp_run").to_pylist()) == {2}
    with pytest.raises(JobMismatchError, match="keyed otherwise"):  # another key is another identity of the rows
        call(path, data(10), key=lambda example: str(example["id"]), version="v2", incremental=True)
    plain = tmp_path / "plain"
    call(plain, data(4), key=None)
    with pytest.raises(InvalidArgumentError, match="stored no keys"):
        call(plain, data(4), incremental=True)


def test_an_unfinished_run_called_with_a_dataset_of_another_size_says_how_to_finish_it(tmp_path: Path) -> None:
    """An unfinished incremental run resumes with the selection made when it started: a grown dataset is refused
    before anything changes, saying to finish the run with its dataset (not "another job: pass resume=False", which
    would erase every run); with it the run finishes, and the next one takes the grown dataset."""
    path, changed = tmp_path / "job", data(12, t5="x5", t9="x9")
    call(path, data(12))
    FAILING.clear()
    FAILING.add("x9")
    try:
        with pytest.raises(ValueError, match="cannot process"):
            call(path, changed, incremental=True)  # on_error="raise": run 2 is left unfinished
    finally:
        FAILING.clear()
    before = rows(path)
    with pytest.raises(JobMismatchError, match=r"run 2 of the job .* is unfinished .* over 12 examples, but this "
                                               r"dataset has 14\. Nothing was changed\. Call again with the dataset"):
        call(path, [*changed, *data(14)[12:]], incremental=True)
    assert not CALLS and rows(path) == before
    with pytest.raises(JobMismatchError, match=r"has an unfinished run \(.*retries/1\) that started with other "
                                               r"settings \(batch_size.*Call again with the settings it started with"):
        call(path, changed, incremental=True, batch_size=2)  # was: "pass resume=False", which erases every run
    assert not CALLS and rows(path) == before
    assert call(path, changed, incremental=True).finished and rows(path)[9] == ("X9", 2)
    grown = call(path, [*changed, *data(14)[12:]], incremental=True)
    assert (grown.increment["new"], grown.increment["selected"]) == (2, 2) and len(rows(path)) == 14


def test_max_batches_caps_an_incremental_run_and_the_next_run_takes_the_rest(tmp_path: Path) -> None:
    """max_batches (Determined's cap per rank, a smoke test's argument) was dropped by an incremental run, which then
    processed its whole selection."""
    path = tmp_path / "job"
    call(path, data(4))
    capped = call(path, data(12), incremental=True, max_batches=1)
    assert capped.finished and CALLS == [[4, 5, 6, 7]] and sorted(rows(path)) == list(range(8))
    rest = call(path, data(12), incremental=True)
    assert rest.increment["new"] == 4 and CALLS == [[8, 9, 10, 11]] and sorted(rows(path)) == list(range(12))


class Uploads(TorchBatchProcessor):
    """Determined-style: the outputs are files written through upload_path(), no context.write() row."""

    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        CALLS.append([int(i) for i in self.context.batch_indices])
        with self.context.upload_path() as path:
            (Path(path) / f"pred_{batch_idx}.txt").write_text(repr([text.upper() for text in batch["text"]]))


def test_an_incremental_run_of_a_keyed_job_that_stored_no_row_is_refused(tmp_path: Path) -> None:
    """Keys are stored with context.write() rows: a keyed job of upload_path() files has none, so its incremental run
    found every example new and processed it again, its files written a second time. Refused, nothing changed."""
    path = tmp_path / "job"
    CALLS.clear()
    torch_batch_process(Uploads, data(6), 4, None, 5, None, storage_path=str(path), key="id", progress=False)
    before = tree_digest(path)
    CALLS.clear()
    with pytest.raises(InvalidArgumentError, match=r"processed 6 example\(s\) but stored no row with context.write"):
        torch_batch_process(Uploads, data(7), 4, None, 5, None, storage_path=str(path), key="id", progress=False,
                            incremental=True)
    assert not CALLS and tree_digest(path) == before


def test_a_generation_processors_sampling_is_part_of_the_runs_version(tmp_path: Path) -> None:
    """DESIGN §21: the version stored with each row covers what a ``generation.Generate`` processor declares (model,
    sampling, prompt...): answers to be drawn another way are refused, naming what changed, before anything is run or
    changed, or recomputed when the user asks."""
    pytest.importorskip("transformers")
    from jobs.generation_job import BUDGET, tiny_llama

    from torch_batch_process import generation

    def generate(sampling: Any) -> Any:
        return generation.Generate(model=tiny_llama, prompt="ids", max_new_tokens=2, eos_token_id=(), budget=BUDGET,
                                   columns=("token_ids",), sampling=sampling, model_id="tiny")

    prompts, path = [{"id": i, "ids": [1 + i, 2, 3]} for i in range(4)], tmp_path / "job"
    options: dict[str, Any] = {"key": "id", "batch_size": 4, "storage_path": str(path), "progress": False,
                               "dataloader_kwargs": {"collate_fn": list}}
    torch_batch_process(generate(generation.Sampling()), prompts, **options)
    stored = read_outputs(path)
    sampled = generate(generation.Sampling(temperature=0.9, seed=3))
    with pytest.raises(VersionChangedError, match=r"sampling: stored \{'kind': 'greedy'\}, now \{'kind': 'sampled'"):
        torch_batch_process(sampled, prompts, incremental=True, **options)
    assert read_outputs(path).equals(stored)
    again = torch_batch_process(sampled, prompts, incremental=True, on_change="recompute", **options)
    assert (again.increment["recompute"], again.increment["selected"]) == (4, 4)
    assert set(read_outputs(path).column("_tbp_run").to_pylist()) == {2}
    generation_status = read_status(str(path))["generation"]  # the first run's alone, said to be "all attempts"
    assert generation_status["generated_prompts"] == 8 and generation_status["completion_tokens"] == 16


def test_failed_examples_are_selected_again_and_hide_their_stale_rows(tmp_path: Path) -> None:
    path = tmp_path / "job"
    FAILING.clear()
    FAILING.update({"bad3", "bad7"})
    try:
        first = call(path, data(12, t3="bad3", t7="bad7"), on_error="skip")
        assert first.failed_examples == 2 and set(rows(path)) == set(range(12)) - {3, 7}
        FAILING.clear()  # the bug is fixed: the same dataset again processes the two failed examples only
        fixed = call(path, data(12, t3="bad3", t7="bad7"), on_error="skip", incremental=True)
        assert (fixed.increment["failed"], fixed.increment["selected"]) == (2, 2)
        assert sorted(i for b in CALLS for i in b) == [3, 7] and fixed.failed_examples == 0
        assert read_outputs(fixed.storage_path).equals(read_outputs(path))  # the job's path, not retries/1's
        assert rows(path)[3] == ("BAD3", 2) and len(rows(path)) == 12
        FAILING.add("bad5")  # example 5 changes and its new run fails: its stale row is not served
        changed = call(path, data(12, t3="bad3", t7="bad7", t5="bad5"), on_error="skip", incremental=True)
        assert changed.increment["changed"] == 1 and changed.failed_examples == 1
        assert 5 not in rows(path) and len(rows(path)) == 11
        assert 5 not in [r["id"] for b in iter_outputs(path, columns=["id"]) for r in b.to_pylist()]
        FAILING.clear()
        last = call(path, data(12, t3="bad3", t7="bad7", t5="bad5"), on_error="skip", incremental=True)
        assert (last.increment["failed"], last.increment["selected"]) == (1, 1) and rows(path)[5] == ("BAD5", 4)
        from torch_batch_process.observe.report.data import read_job_data
        from torch_batch_process.observe.report.page import build_model, render_page

        page = render_page(build_model(read_job_data(str(path))))  # the report says each run's counts
        assert "incremental runs" in page
        for run, counts in ((2, "0 new, 0 changed, 2 failed before"), (3, "0 new, 1 changed, 0 failed before"),
                            (4, "0 new, 0 changed, 1 failed before")):
            assert f"run {run} (incremental, finished): 12 examples: {counts}" in page, (run, page[:2000])
    finally:
        FAILING.clear()


def a_job_whose_incremental_run_failed_example_5(tmp_path: Path) -> Path:
    """A keyed job of 8 examples, then an incremental run where example 5 changed and failed (``on_error="skip"``)."""
    path = tmp_path / "job"
    call(path, data(8))
    FAILING.update({"x5"})
    try:
        call(path, data(8, t5="x5"), on_error="skip", incremental=True)
    finally:
        FAILING.clear()
    return path


def test_a_damaged_or_deleted_failures_file_is_an_error_never_a_failed_keys_stale_row(tmp_path: Path) -> None:
    """A keyed job's failure records are its failed keys' newest events (tombstones): a failures file cut short, or
    deleted, is an OutputCorruptError naming it on the read side and in the planner (it was a raw JSONDecodeError,
    and a deleted file silently served the stale rows); restored, both read as before."""
    path = a_job_whose_incremental_run_failed_example_5(tmp_path)
    assert 5 not in rows(path)
    (failures,) = (path / "retries" / "1" / "failures").glob("*.jsonl")
    whole = failures.read_bytes()
    for damage, message in ((whole[: len(whole) // 2], "this committed failures file cannot be read"),
                            (None, r"committed 1 failure record\(s\), but its files hold 0")):
        if damage is None:
            failures.unlink()
        else:
            failures.write_bytes(damage)
        for attempt in (lambda: read_outputs(path), lambda: call(path, data(8, t5="x5"), incremental=True)):
            with pytest.raises(OutputCorruptError, match=message):
                attempt()
        assert not CALLS
    failures.write_bytes(whole)
    assert 5 not in rows(path) and len(rows(path)) == 7


def test_a_runs_damaged_plan_files_are_named_before_any_work(tmp_path: Path) -> None:
    """An incremental run's plan files (its counts, selection and removed keys) cut short or garbled are a
    CheckpointCorruptError naming the file, before anything is processed or changed: on the read side for the
    removed keys (was a raw ArrowInvalid), and when the unfinished run resumes (a raw JSONDecodeError for the counts,
    "another job: pass resume=False" for a selection whose bits changed); ``tbp status`` lists the run with damaged
    counts, naming the file (it left the run out). Restored, the run finishes."""
    path, changed = tmp_path / "job", data(12, t5="x5", t9="x9")
    call(path, data(14))
    FAILING.add("x9")
    try:
        with pytest.raises(ValueError, match="cannot process"):
            call(path, changed, incremental=True, prune_missing=True)  # run 2 (removes 12, 13) left unfinished
    finally:
        FAILING.clear()
    plan = path / "retries" / "1" / "_tbp"
    files = {name: (plan / name).read_bytes() for name in ("increment.json", "selection.bin", "removed.arrows")}
    flipped = bytearray(files["selection.bin"])
    flipped[-1] ^= 0x10  # another example selected: the same size, another digest
    for name, damage in (("increment.json", files["increment.json"][:20]), ("selection.bin", bytes(flipped)),
                         ("removed.arrows", files["removed.arrows"][:-40])):
        (plan / name).write_bytes(damage)
        with pytest.raises(CheckpointCorruptError, match=f"{plan / name}.* damaged|{plan / name} is corrupt"):
            call(path, changed, incremental=True, prune_missing=True)
        assert not CALLS
        if name == "removed.arrows":
            with pytest.raises(CheckpointCorruptError, match=str(plan / name)):
                read_outputs(path)
        if name == "increment.json":  # tbp status lists the run and names the damaged file (it left it out)
            (run,) = read_status(str(path))["runs"]
            assert run["run"] == 2 and str(plan / name) in run["error"]
            assert f"run 2 (incremental, unfinished): its planner's counts cannot be read: {plan / name}" in (
                format_status(read_status(str(path))))
        (plan / name).write_bytes(files[name])
    assert call(path, changed, incremental=True, prune_missing=True).finished
    assert rows(path)[9] == ("X9", 2) and len(rows(path)) == 12


def test_a_finished_runs_missing_or_garbled_files_are_named_never_a_raw_error(tmp_path: Path) -> None:
    """The files a keyed job's read side and next run read of each finished run (its job file, selection and retried
    keys) and the job's own job file: deleted or garbled, each is a CheckpointCorruptError naming it (they were a raw
    FileNotFoundError, pyarrow's OSError "Invalid flatbuffers message" or a JSONDecodeError from ``tbp status``,
    ``tbp failures``, ``read_failures`` and the next run); so is an unfinished run's deleted counts file. Restored,
    the job reads and runs on as before."""
    from torch_batch_process import read_failures

    path, dataset = tmp_path / "job", data(10, t5="x5")
    FAILING.add("x5")
    try:
        call(path, dataset, on_error="skip")
        call(path, dataset, on_error="skip", incremental=True)  # run 2 retries key 5, which fails again: finished
    finally:
        FAILING.clear()
    run = path / "retries" / "1" / "_tbp"
    CALLS.clear()

    def garbled(raw: bytes) -> bytes:
        middle = len(raw) // 2
        return raw[:middle] + bytes(b ^ 0x5A for b in raw[middle:middle + 16]) + raw[middle + 16:]

    for file, damage, side in ((run / "retried.arrows", garbled, "read"), (run / "selection.bin", None, "read"),
                               (run / "job.json", None, "read"), (run / "job.json", garbled, "run"),
                               (path / "_tbp" / "job.json", garbled, "run")):
        whole = file.read_bytes()
        if damage is None:
            file.unlink()
        else:
            file.write_bytes(damage(whole))
        with pytest.raises(CheckpointCorruptError, match=str(file)):
            if side == "read":
                read_failures(str(path))
            else:
                call(path, dataset, on_error="skip", incremental=True)
        assert not CALLS
        file.write_bytes(whole)
    assert [f["key"] for f in read_failures(str(path))] == [5]

    FAILING.add("x5")
    try:
        with pytest.raises(ValueError, match="cannot process"):  # run 3, left unfinished: key 5 fails without "skip"
            call(path, dataset, incremental=True)
    finally:
        FAILING.clear()
    counts = path / "retries" / "2" / "_tbp" / "increment.json"
    whole = counts.read_bytes()
    counts.unlink()
    with pytest.raises(CheckpointCorruptError, match=str(counts)):
        call(path, dataset, incremental=True)
    assert not CALLS
    counts.write_bytes(whole)
    assert call(path, dataset, incremental=True).finished and rows(path)[5] == ("X5", 3)


def test_a_keyed_delta_table_is_merged_by_key(tmp_path: Path) -> None:
    pytest.importorskip("deltalake")
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    target = tables.delta(str(tmp_path / "table"))
    path = tmp_path / "job"
    call(path, data(40), table=target, version="v1")
    changed = data(40, t3="x3", t17="x17", t31="x31") + [{"id": i, "text": f"n{i}"} for i in range(40, 44)]
    result = call(path, changed, table=target, version="v1", incremental=True)
    assert (result.increment["changed"], result.increment["new"], result.increment["selected"]) == (3, 4, 7)
    assert sorted(i for b in CALLS for i in b) == [3, 17, 31, 40, 41, 42, 43]

    def table_rows() -> dict[int, tuple[str, int]]:
        read = pa.table(QueryBuilder().register("t", DeltaTable(str(tmp_path / "table"))).execute(
            'SELECT id, value, "_tbp_run" FROM t').read_all()).to_pydict()
        assert len(read["id"]) == len(set(read["id"])), "a key twice in the table"
        return {k: (v, r) for k, v, r in zip(read["id"], read["value"], read["_tbp_run"], strict=True)}

    rows_now = table_rows()
    assert len(rows_now) == 44 and rows_now[3] == ("X3", 2) and rows_now[4] == ("T4", 1) and rows_now[42] == ("N42", 2)
    by_reader = read_outputs(target).to_pydict()
    assert sorted(by_reader["id"]) == list(range(44))
    again = call(path, changed, table=target, version="v1", incremental=True)
    assert again.increment["selected"] == 0 and table_rows() == rows_now


def table_target(fmt: str, tmp_path: Path) -> Any:
    pytest.importorskip({"delta": "deltalake", "iceberg": "pyiceberg", "lance": "lance"}[fmt])
    if fmt == "iceberg":
        return tables.iceberg("db.keyed", catalog={"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
                                                   "warehouse": f"file://{tmp_path}/warehouse"})
    return getattr(tables, fmt)(str(tmp_path / f"table.{fmt}"))


class Ticked(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        CALLS.append([int(i) for i in self.context.batch_indices])
        self.context.write({"v`1": [text.upper() for text in batch["text"]]})


def test_column_names_a_lance_table_cannot_hold_are_refused_naming_them(tmp_path: Path) -> None:
    """Lance reads '.' and '`' in a column name as a nested field's path: key='a.b' (and a written column 'v`1') failed
    with Lance's own OSError from the encoding thread after the first batch ran. key= is refused before any work; a
    written column at its first batch, before the table is made."""
    target = table_target("lance", tmp_path)
    dotted = [{"a.b": i, "text": f"t{i}"} for i in range(4)]
    with pytest.raises(InvalidArgumentError, match=r"key='a\.b': the lance table .* cannot hold a column of that name"):
        call(tmp_path / "job", dotted, key="a.b", table=target)
    assert not CALLS and not (tmp_path / "job").exists() and not (tmp_path / "table.lance").exists()
    with pytest.raises(InvalidArgumentError, match=r"wrote a column named 'v`1', which the lance table .* rename it"):
        torch_batch_process(Ticked, data(4), batch_size=4, storage_path=str(tmp_path / "job"), table=target,
                            progress=False)
    assert not (tmp_path / "table.lance").exists()
    assert call(tmp_path / "job2", dotted, key=lambda example: example["a.b"], table=target).finished


@pytest.mark.parametrize("fmt", ["delta", "iceberg", "lance"])
def test_a_failed_key_leaves_the_table_until_its_rerun_succeeds(fmt: str, tmp_path: Path) -> None:
    """As in shards (a failure hides the key's older rows), a changed example whose rerun failed is not served
    with its stale row: the MERGE of the stage that recorded the failure removes the key's row from the table."""
    target, path = table_target(fmt, tmp_path), tmp_path / "job"

    def table_rows() -> dict[int, tuple[str, int]]:
        read = read_outputs(target, columns=["id", "value", "_tbp_run"]).to_pydict()
        assert len(read["id"]) == len(set(read["id"])), "a key twice in the table"
        return {k: (v, r) for k, v, r in zip(read["id"], read["value"], read["_tbp_run"], strict=True)}

    FAILING.clear()
    try:
        call(path, data(12), table=target, on_error="skip")
        FAILING.add("bad5")  # example 5 changes and its new run fails; example 9 changes and succeeds
        changed = call(path, data(12, t5="bad5", t9="x9"), table=target, on_error="skip", incremental=True)
        assert (changed.increment["changed"], changed.failed_examples) == (2, 1)
        assert table_rows() == {i: ("X9", 2) if i == 9 else (f"T{i}", 1) for i in range(12) if i != 5}
        FAILING.clear()  # fixed: the next run selects the failed key again and its row comes back
        last = call(path, data(12, t5="bad5", t9="x9"), table=target, on_error="skip", incremental=True)
        assert (last.increment["failed"], last.increment["selected"]) == (1, 1)
        assert len(table_rows()) == 12 and table_rows()[5] == ("BAD5", 3)
    finally:
        FAILING.clear()


@pytest.mark.parametrize("output", ["shards", "delta", "iceberg", "lance"])
def test_prune_missing_removes_the_keys_gone_from_the_dataset(output: str, tmp_path: Path) -> None:
    """Keys gone from the dataset are counted and kept by default; ``prune_missing=True`` removes them (shards: a
    tombstone hides them; tables: deleted in the run's transaction, even when the run selects nothing); a removed
    key that comes back is new."""
    target = None if output == "shards" else table_target(output, tmp_path)
    path, extra = tmp_path / "job", {} if target is None else {"table": target}

    def stored() -> dict[int, str]:
        read = read_outputs(target if target is not None else path, columns=["id", "value"]).to_pydict()
        assert len(read["id"]) == len(set(read["id"])), "a key read back twice"
        return dict(zip(read["id"], read["value"], strict=True))

    call(path, data(12), **extra)
    gone = [example for example in data(12, t4="x4") if example["id"] not in (2, 7)]
    kept = call(path, gone, incremental=True, **extra)
    assert (kept.increment["removed"], kept.increment["selected"]) == (2, 1) and set(stored()) == set(range(12))
    pruned = call(path, gone, incremental=True, prune_missing=True, **extra)
    assert (pruned.increment["removed"], pruned.increment["selected"]) == (2, 0) and not CALLS
    assert stored() == {i: "X4" if i == 4 else f"T{i}" for i in range(12) if i not in (2, 7)}
    if target is None:
        assert sorted(r["id"] for b in iter_outputs(path, columns=["id"]) for r in b.to_pylist()) == sorted(stored())
    back = call(path, [*gone, {"id": 2, "text": "b2"}], incremental=True, prune_missing=True, **extra)
    assert (back.increment["new"], back.increment["removed"], back.increment["selected"]) == (1, 0, 1)
    assert stored()[2] == "B2" and 7 not in stored() and len(stored()) == 11
    if target is None:  # a start killed before its run's job.json left a plan that removed 2 and 7: not this one's
        import shutil

        runs = path / "retries"
        planned = runs / str(max(int(p.name) for p in runs.iterdir()) + 1) / "_tbp"
        planned.mkdir(parents=True)
        shutil.copy(next(runs.glob("*/_tbp/removed.arrows")), planned)
        again = call(path, [*gone, {"id": 2, "text": "b2"}], incremental=True)
        assert (again.increment["selected"], again.increment["removed"]) == (0, 0) and stored()[2] == "B2"


def test_tbp_status_counts_the_failures_of_a_run_when_the_first_run_had_none(tmp_path: Path) -> None:
    """The failures of an incremental run are the job's current failures (``tbp failures`` lists them, and the next
    run selects them again): ``tbp status`` counts them too, and names a damaged failures file of that run, also when
    the job's first run had no failure (it said ``failed none``, reading the first run's count only)."""
    path = a_job_whose_incremental_run_failed_example_5(tmp_path)
    status = read_status(str(path))
    assert status["failed_examples"] == 1 and [f["index"] for f in status["failures"]["first"]] == [5], status
    assert "1 example(s) skipped" in format_status(status)
    (failures,) = (path / "retries" / "1" / "failures").glob("*.jsonl")
    failures.write_bytes(failures.read_bytes()[:10])
    status = read_status(str(path))
    assert status["failed_examples"] == 1 and "cannot be read" in status["failures"]["error"], status["failures"]


def test_an_incremental_run_with_another_output_format_or_table_than_its_job_is_refused(tmp_path: Path) -> None:
    """A run's rows join the job's: a run called with another output_format was accepted and wrote the other format
    (read_outputs then failed on 'record shards of several formats'; the documented Parquet glob missed its rows), one
    called with another table= failed planning with the table library's raw error. Both are refused before anything
    is planned or written, naming the argument and the job's value."""
    path = tmp_path / "job"
    call(path, data(8))
    before = tree_digest(path)
    for other, needle in (
        ({"output_format": "jsonl"}, r"output_format: the job's 'parquet', this call's 'jsonl'"),
        ({"table": tables.delta(str(tmp_path / "t"))}, r"table: the job's None, this call's \{'format': 'delta'"),
    ):
        with pytest.raises(JobMismatchError, match=needle):
            call(path, data(10), incremental=True, **other)
        assert tree_digest(path) == before and not CALLS and not (tmp_path / "t").exists()
    assert call(path, data(10), incremental=True).increment["new"] == 2 and len(rows(path)) == 10


@pytest.mark.parametrize("output", ["parquet", "jsonl", "delta", "iceberg", "lance"])
def test_a_calls_outputs_compare_with_its_stored_spec_through_one_definition(output: str, tmp_path: Path) -> None:
    """A run's outputs are checked against its job's (check_same_outputs) through JobSpec's own reading of what
    to_json stores (output_format only when not the default, the table's description as JSON gives it back): it
    re-derived both, so the two could drift apart. The spec a call stores reads back as that call's outputs."""
    import json

    from torch_batch_process.jobstore.formats import JobSpec
    from torch_batch_process.validation import validate_arguments

    table = table_target(output, tmp_path) if output in ("delta", "iceberg", "lance") else None
    args = validate_arguments(Upper, data(4), 4, None, 5, None, str(tmp_path / "job"), None, "job", True, True,
                              output_format="parquet" if table is not None else output, table=table)
    stored = json.loads(json.dumps(JobSpec.of_call(args, 4, None).to_json()))  # as job.json holds it
    assert JobSpec.stored_outputs(stored) == JobSpec.call_outputs(args)
    assert ("output_format" in stored) == (output == "jsonl") and ("table" in stored) == (table is not None)
    assert JobSpec.call_outputs(args)["table"] == (json.loads(json.dumps(table.describe())) if table else None)


@pytest.mark.parametrize("output", ["parquet", "jsonl", "delta", "iceberg", "lance"])
def test_a_keyed_job_whose_keys_were_all_pruned_reads_back_empty_with_its_columns(output: str, tmp_path: Path) -> None:
    """Every key gone from the dataset and pruned: read_outputs gave a table of the ``index`` column alone (the shards'
    rows all hidden, their columns dropped with them). It has the job's columns and types, and no row."""
    target = table_target(output, tmp_path) if output in ("delta", "iceberg", "lance") else None
    path = tmp_path / "job"
    extra: dict[str, Any] = {"table": target} if target is not None else {"output_format": output}
    source = target if target is not None else path
    call(path, data(6), **extra)
    full = read_outputs(source)
    named = read_outputs(source, columns=["value", "id"])
    gone = call(path, data(0), incremental=True, prune_missing=True, **extra)
    assert (gone.increment["removed"], gone.increment["selected"]) == (6, 0)
    empty = read_outputs(source)
    assert empty.num_rows == 0 and empty.schema == full.schema, (empty.schema, full.schema)
    empty_named = read_outputs(source, columns=["value", "id"])
    assert empty_named.num_rows == 0 and empty_named.schema == named.schema, empty_named.schema
    assert [b.num_rows for b in iter_outputs(source)] in ([], [0])


def test_the_jobs_failures_are_every_key_whose_newest_event_is_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tbp failures``, ``read_failures`` and ``tbp status`` of a keyed job listed its latest run's failures only: a
    key that failed in an earlier run and that a run capped by max_batches did not reach (or that the dataset no longer
    had) was not listed, yet the next run counted it as failed and ran it. They list every key currently failed: each
    key's newest failure, none that succeeded since; the next run retries exactly those."""
    from torch_batch_process import read_failures
    from torch_batch_process.launch.cli import main as cli_main

    def listed() -> list[tuple[int, int]]:
        failures = read_failures(str(path))
        status = read_status(str(path))
        assert status["failed_examples"] == len(failures), (status["failures"], failures)
        assert [f["index"] for f in status["failures"]["first"]] == [f["index"] for f in failures][:5]
        assert cli_main(["failures", str(path)]) == 0
        assert capsys.readouterr().out.startswith(f"{len(failures)} failed example(s)")
        return [(f["key"], f["_tbp_run"]) for f in failures]

    path = tmp_path / "job"
    FAILING.clear()
    FAILING.update({"bad3", "bad9"})
    try:
        assert call(path, data(12, t3="bad3", t9="bad9"), on_error="skip").failed_examples == 2
        assert listed() == [(3, 1), (9, 1)]
        FAILING.discard("bad3")  # 3 is fixed, example 5 changes and fails, 9 still fails but is not reached
        FAILING.add("bad5")
        dataset = data(12, t3="bad3", t5="bad5", t9="bad9")
        capped = call(path, dataset, on_error="skip", incremental=True, max_batches=2, batch_size=1)
        assert capped.increment["selected"] == 3 and CALLS == [[3], [5]] and capped.failed_examples == 1
        assert listed() == [(5, 2), (9, 1)]
        retried = path / "retries" / "1" / "_tbp" / "retried.arrows"
        whole = retried.read_bytes()
        retried.write_bytes(whole[: len(whole) // 2])  # damaged: named, never a guess at which failures are current
        with pytest.raises(CheckpointCorruptError, match=r"retried\.arrows: the examples this run retried cannot be"):
            read_failures(str(path))
        retried.write_bytes(whole)
        FAILING.clear()  # fixed: the next run retries the two listed keys, and none is left
        rest = call(path, dataset, on_error="skip", incremental=True)
        assert (rest.increment["failed"], rest.increment["selected"]) == (2, 2)
        assert sorted(i for b in CALLS for i in b) == [5, 9] and listed() == []
        FAILING.add("bad11")  # a key that fails, then leaves the dataset (kept): still failed, listed
        assert call(path, data(12, t3="bad3", t5="bad5", t9="bad9", t11="bad11"), on_error="skip",
                    incremental=True).failed_examples == 1
        FAILING.clear()
        without = call(path, data(11, t3="bad3", t5="bad5", t9="bad9"), on_error="skip", incremental=True)
        assert without.increment["stored_failed"] == 1 and without.increment["selected"] == 0
        assert listed() == [(11, 4)]
        back = call(path, data(12, t3="bad3", t5="bad5", t9="bad9", t11="bad11"), on_error="skip", incremental=True)
        assert (back.increment["failed"], back.increment["selected"]) == (1, 1) and listed() == []
    finally:
        FAILING.clear()
