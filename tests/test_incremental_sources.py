"""Keyed jobs over streamed sources, in this process (one rank; DESIGN §21, issue 46): ``key=`` names a column of a
Parquet, JSONL or ``Sharded`` source, and an incremental run over changed and appended files calls ``process_batch``
on exactly the new and changed rows (global row numbers across the shards), every key then once with its newest
value, in shards and in each table format (MERGE by key).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_incremental_api import table_target

from torch_batch_process import TorchBatchProcessor, read_outputs, sources, torch_batch_process

CALLS: list[int] = []
FAILING: set[str] = set()
"""Texts the processor fails on (the test's 'bug', fixed between calls)."""


class Upper(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        CALLS.extend(int(i) for i in self.context.batch_indices)
        if FAILING & set(batch["text"]):
            raise ValueError(f"cannot process {sorted(FAILING & set(batch['text']))}")
        self.context.write({"value": [text.upper() for text in batch["text"]]})


def write_files(folder: Path, rows: list[dict[str, Any]], per_file: int, fmt: str) -> None:
    """``rows`` as files of ``per_file`` rows (``part-000.parquet``...; Parquet: row groups of 100)."""
    for old in folder.glob("part-*"):
        old.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    for n, first in enumerate(range(0, len(rows), per_file)):
        chunk = rows[first:first + per_file]
        if fmt == "parquet":  # jsonl and sharded: JSON Lines files
            pq.write_table(pa.Table.from_pylist(chunk), folder / f"part-{n:03d}.parquet", row_group_size=100)
        else:
            (folder / f"part-{n:03d}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in chunk))


def open_jsonl(path: str) -> Any:
    with open(path) as f:
        yield from (json.loads(line) for line in f)


def source(folder: Path, fmt: str) -> Any:
    if fmt == "parquet":
        return sources.parquet(str(folder / "*.parquet"))
    if fmt == "sharded":  # row counts unknown: the planner and the plan count them
        return sources.Sharded([str(path) for path in sorted(folder.glob("*.jsonl"))], open_jsonl)
    return sources.jsonl(str(folder / "*.jsonl"))


def call(path: Path, data: Any, **kwargs: Any) -> Any:
    CALLS.clear()
    options = {"key": "id", "content": ["text"], "batch_size": 64, "storage_path": str(path), "progress": False}
    return torch_batch_process(Upper, data, **(options | kwargs))


@pytest.mark.parametrize(
    ("fmt", "output", "n"),
    [("parquet", "shards", 3000), ("jsonl", "shards", 600), ("sharded", "shards", 600), ("parquet", "delta", 600),
     ("parquet", "iceberg", 600), ("parquet", "lance", 600)],
)
def test_an_incremental_run_over_a_source_processes_exactly_the_new_and_changed_rows(
    fmt: str, output: str, n: int, tmp_path: Path
) -> None:
    # string keys, not in row order, so that the row numbers and the keys differ
    rows = [{"id": f"k{(i * 7919) % n:05d}", "text": f"t{i}", "other": i} for i in range(n)]
    folder, job = tmp_path / "data", tmp_path / "job"
    target = None if output == "shards" else table_target(output, tmp_path)
    extra = {} if target is None else {"table": target}
    write_files(folder, rows, n // 6, fmt)
    first = call(job, source(folder, fmt), **extra)
    assert sorted(CALLS) == list(range(n)) and first.examples_processed == n

    changed = set(range(0, n, 10))  # 10% of the rows changed, one of their other columns too (not hashed)
    new_rows = [
        {**row, "text": row["text"] + "!" if i in changed else row["text"], "other": -i} for i, row in enumerate(rows)
    ]
    new_rows += [{"id": f"new{i:05d}", "text": f"n{i}", "other": 0} for i in range(n // 10)]  # 10% appended
    write_files(folder, new_rows, n // 6, fmt)  # the appended rows land in a 7th file
    second = call(job, source(folder, fmt), incremental=True, **extra)
    expected = sorted(changed | set(range(n, n + n // 10)))
    assert sorted(CALLS) == expected, "process_batch got other rows than the new and changed ones"
    assert second.increment["new"] == n // 10 and second.increment["changed"] == len(changed)
    assert second.increment["unchanged"] == n - len(changed)

    out = read_outputs(target if target is not None else job, columns=["id", "value", "_tbp_run"]).to_pydict()
    assert len(out["id"]) == len(set(out["id"])) == len(new_rows), "a key read back twice, or missing"
    newest = dict(zip(out["id"], zip(out["value"], out["_tbp_run"], strict=True), strict=True))
    for i, row in enumerate(new_rows):
        assert newest[row["id"]] == (row["text"].upper(), 2 if i in expected else 1)

    third = call(job, source(folder, fmt), incremental=True, **extra)  # nothing changed: nothing runs
    assert CALLS == [] and third.increment["unchanged"] == len(new_rows)


def test_a_failed_source_row_is_hidden_and_selected_again(tmp_path: Path) -> None:
    """A changed row whose new run fails names its key in its failure record (read from the source by row number):
    its stale row is no longer served, and the next incremental run (the bug fixed) selects it again."""
    folder, job = tmp_path / "data", tmp_path / "job"
    rows = [{"id": i, "text": f"t{i}"} for i in range(40)]
    write_files(folder, rows, 10, "parquet")
    call(job, source(folder, "parquet"), batch_size=4, on_error="skip")
    write_files(folder, [{**row, "text": "bad" if row["id"] == 13 else row["text"]} for row in rows], 10, "parquet")
    FAILING.add("bad")
    try:
        failed = call(job, source(folder, "parquet"), batch_size=4, on_error="skip", incremental=True)
    finally:
        FAILING.clear()
    assert (failed.increment["changed"], failed.failed_examples) == (1, 1)
    assert 13 not in read_outputs(job, columns=["id"]).column("id").to_pylist()  # not served with its stale value
    fixed = call(job, source(folder, "parquet"), batch_size=4, on_error="skip", incremental=True)
    assert (fixed.increment["failed"], fixed.increment["selected"]) == (1, 1) and CALLS == [13]
    out = read_outputs(job, columns=["id", "value"]).to_pydict()
    assert sorted(out["id"]) == list(range(40)) and dict(zip(out["id"], out["value"], strict=True))[13] == "BAD"
