"""Shadowing of superseded rows in a keyed job's shards (DESIGN §21, issue 46): every key once, newest values."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torch_batch_process.outputs.keyed.shadow import RUN_COLUMN, find_shadows


def _write_runs(folder, kind):
    """Three runs of shards (two per run, small row groups): run 1 writes keys 0..999; run 2 changes every 10th
    key and adds 1000..1099; run 3 changes every 7th key of 0..1099. Returns the shards and the newest value of
    every key."""
    rng = np.random.default_rng(0)
    key = (lambda i: i) if kind == "int" else (lambda i: f"doc-{i}")
    newest, shards = {}, []
    runs = {1: list(range(1000)), 2: [*range(0, 1000, 10), *range(1000, 1100)], 3: list(range(0, 1100, 7))}
    for run, keys in runs.items():
        keys = [int(k) for k in rng.permutation(keys)]  # rows in no key order, as bucketed batches write them
        for half, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :])):
            values = [run * 10**6 + k for k in part]
            path = folder / f"run{run}-{half}.parquet"
            pq.write_table(pa.table({"id": [key(k) for k in part], RUN_COLUMN: pa.array([run] * len(part), pa.int32()),
                                     "value": values}), path, row_group_size=64)
            shards.append(path)
            newest.update({key(k): v for k, v in zip(part, values, strict=True)})
    return shards, newest


def _events(path):
    for batch in pq.ParquetFile(path).iter_batches(batch_size=100, columns=["id", RUN_COLUMN]):
        yield batch.rename_columns(["key", RUN_COLUMN])


def _read_back(shards, shadows):
    """What read-back does with the shadows: each row group loaded on its own and filtered."""
    tables = []
    for part, path in enumerate(shards):
        parquet, start = pq.ParquetFile(path), 0
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(group)
            visible = shadows.visible(part, start, start + table.num_rows)
            tables.append(table if visible is None else table.filter(pa.array(visible)))
            start += table.num_rows
    return pa.concat_tables(tables)


@pytest.mark.parametrize("kind", ["int", "str"])
@pytest.mark.parametrize("rows_per_partition", [1 << 21, 200])
def test_every_key_once_with_its_newest_values(tmp_path, kind, rows_per_partition):
    shards, newest = _write_runs(tmp_path, kind)
    total = sum(pq.ParquetFile(p).metadata.num_rows for p in shards)
    shadows = find_shadows(((i, _events(p)) for i, p in enumerate(shards)), total_rows=total,
                           rows_per_partition=rows_per_partition, scratch=tmp_path)
    table = _read_back(shards, shadows)
    assert table.num_rows == len(newest) == 1100 and shadows.hidden == total - 1100
    assert dict(zip(table.column("id").to_pylist(), table.column("value").to_pylist(), strict=True)) == newest
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # the partition files are gone

    # a plain glob reader keeps the newest row per key itself (the documented DuckDB query): the same rows
    duckdb = pytest.importorskip("duckdb")
    glob = str(tmp_path / "*.parquet")
    rows = duckdb.sql(
        f"SELECT id, value FROM '{glob}' QUALIFY row_number() OVER (PARTITION BY id ORDER BY {RUN_COLUMN} DESC) = 1"
    ).fetchall()
    assert dict(rows) == newest


def test_tombstones_hide_older_rows_and_a_copied_row_is_kept_once(tmp_path):
    shards, newest = _write_runs(tmp_path, "int")
    copy = tmp_path / "copy.parquet"  # run 2's first shard copied in twice: its rows would be read twice
    copy.write_bytes(shards[2].read_bytes())
    shards.append(copy)
    failed_in_4 = pa.record_batch({"key": pa.array([5, 10, 1050]), RUN_COLUMN: pa.array([4, 4, 4], pa.int32())})
    pruned_in_2 = pa.record_batch({"key": pa.array([7]), RUN_COLUMN: pa.array([2], pa.int32())})  # run 3 rewrote 7
    shadows = find_shadows(((i, _events(p)) for i, p in enumerate(shards)), [failed_in_4, pruned_in_2],
                           total_rows=5000, rows_per_partition=300)
    table = _read_back(shards, shadows)
    for k in (5, 10, 1050):
        del newest[k]
    assert sorted(table.column("id").to_pylist()) == sorted(newest)
    assert dict(zip(table.column("id").to_pylist(), table.column("value").to_pylist(), strict=True)) == newest


def test_no_hidden_rows_costs_no_mask(tmp_path):
    batch = pa.record_batch({"key": pa.array(["a", "b"]), RUN_COLUMN: pa.array([1, 1], pa.int32())})
    shadows = find_shadows([(0, [batch])], total_rows=2)
    assert shadows.hidden == 0 and shadows.visible(0, 0, 2) is None
