"""MERGE by key into each table format, with the job's idempotency key on the merge commit (issue 46, DESIGN §21).

    python -m benchmarks.incremental_tables                  # 10^5 rows, 3 rounds, every format and way
    python -m benchmarks.incremental_tables --rows 1000000 --rounds 1

A verification and a measurement, run against the installed deltalake, pyiceberg (SQL/sqlite catalog) and pylance.
For each format and way of merging: a table of ``--rows`` rows (``id``, ``value``, ``_tbp_hash``, ``_tbp_run``,
``_tbp_version``) is written in 8 data files, then one *commit of an incremental run* is merged into it: 10% of
the keys with new values and 10% new keys (0.2 x rows), in one table transaction that carries the idempotency key
(job ``J``, commit ``7``) in the format's own metadata. The script then checks, with the format's own reader, that
every key is once in the table with its newest values, reads the key back from the table the way the next start of
a killed job would, and applies the same merge again (a replay after a kill between the table's commit and the
job's record, had the key been ignored): the rows must stay the same, since a MERGE by key is idempotent by itself
(not ``delta add+remove``: adding the same files again would repeat their rows; it relies on the key, as today's
appends do).

Ways (each one transaction, atomic with its key):

- ``delta merge``: ``DeltaTable.merge(...).when_matched_update_all().when_not_matched_insert_all()``, with
  ``CommitProperties(app_transactions=[Transaction("tbp-J", 7)], custom_metadata=...)``; key read back with
  ``DeltaTable.transaction_version("tbp-J")``.
- ``delta add+remove``: the ranks' files as they are (the new rows, already written during the stage, as today's
  protocol does) plus the files holding superseded keys rewritten without them: one
  ``create_write_transaction([AddAction..., RemoveAction...])`` with the same ``txn``. Rank 0 reads only the files
  that hold changed keys, never the new rows.
- ``iceberg upsert``: ``Transaction.upsert(df, join_cols=["id"], snapshot_properties=...)`` and
  ``Transaction.set_properties({"tbp.commit.J": "7"})`` in one ``table.transaction()`` (one catalog commit).
- ``iceberg overwrite``: ``Transaction.overwrite(df, overwrite_filter=In("id", keys))`` (delete the commit's keys,
  append its rows) and the same property, in one catalog commit.
- ``iceberg add+remove``: like ``delta add+remove``, as one ``overwrite`` snapshot
  (``Transaction.update_snapshot().overwrite()``: ``delete_data_file``, ``append_data_file``) and the property.
- ``lance merge_insert``: ``merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
  .execute_uncommitted(df)`` gives a ``Transaction``; its ``transaction_properties`` get the key, then
  ``LanceDataset.commit``; key read back with ``read_transaction(version).transaction_properties``.

Clock: *merge s* is the wall time of the one transaction (the rewrite of the files it touches included), median
[min-max] over rounds, each round on a fresh table; *files* says what the transaction did.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

JOB, COMMIT = "J", 7
FILES = 8


def _rows(keys: np.ndarray, run: int) -> pa.Table:
    return pa.table({
        "id": pa.array(keys, pa.int64()),
        "value": pa.array(keys * 10 + run, pa.int64()),
        "_tbp_hash": pa.array(keys ^ run, pa.int64()),
        "_tbp_run": pa.array(np.full(len(keys), run), pa.int32()),
        "_tbp_version": pa.array(["v1"] * len(keys)),
    })


def _scenario(rows: int) -> tuple[pa.Table, pa.Table]:
    """The stored table (run 1) and the merge source (run 2: 10% changed keys, 10% new keys)."""
    stored = _rows(np.arange(rows, dtype=np.int64), 1)
    keys = np.concatenate([np.arange(3, rows, 10), np.arange(rows, rows + rows // 10)]).astype(np.int64)
    return stored, _rows(keys, 2)


def _check(table: pa.Table, stored: pa.Table, source: pa.Table) -> None:
    ids = table.column("id").to_numpy()
    if len(np.unique(ids)) != len(ids):
        raise AssertionError("a key is in the table twice")
    expected = {**dict(zip(stored["id"].to_pylist(), stored["value"].to_pylist(), strict=True)),
                **dict(zip(source["id"].to_pylist(), source["value"].to_pylist(), strict=True))}
    if dict(zip(ids.tolist(), table.column("value").to_pylist(), strict=True)) != expected:
        raise AssertionError("the table's values are not the newest")


# ------------------------------------------------------------------------------------------------ Delta


def _delta_create(folder: Path, stored: pa.Table) -> Any:
    from deltalake import DeltaTable, write_deltalake

    for part in range(FILES):  # 8 data files, by key range (as 8 ranks' shards would be, roughly)
        n = stored.num_rows
        write_deltalake(str(folder), stored.slice(part * n // FILES, n // FILES), mode="append")
    return DeltaTable(str(folder))


def delta_merge(folder: Path, stored: pa.Table, source: pa.Table) -> dict[str, Any]:
    from deltalake import CommitProperties, DeltaTable, Transaction

    _delta_create(folder, stored)

    def merge() -> dict[str, Any]:
        properties = CommitProperties(
            custom_metadata={"tbp.job": JOB, "tbp.commit": str(COMMIT)},
            app_transactions=[Transaction(f"tbp-{JOB}", COMMIT)],
        )
        return (
            DeltaTable(str(folder))
            .merge(source, predicate="t.id = s.id", source_alias="s", target_alias="t", commit_properties=properties)
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )

    started = time.perf_counter()
    metrics = merge()
    seconds = time.perf_counter() - started
    table = DeltaTable(str(folder))
    key = table.transaction_version(f"tbp-{JOB}")
    info = table.history(1)[0]
    _check(_delta_read(table), stored, source)
    merge()  # a replay
    _check(_delta_read(DeltaTable(str(folder))), stored, source)
    return {
        "seconds": seconds, "key": key, "metadata": {k: info.get(k) for k in ("tbp.job", "tbp.commit")},
        "files": f"scanned {metrics.get('num_target_files_scanned')}, skipped "
                 f"{metrics.get('num_target_files_skipped_during_scan')}, added {metrics.get('num_target_files_added')}"
                 f", removed {metrics.get('num_target_files_removed')}",
    }


def _delta_read(table: Any) -> pa.Table:
    from deltalake import QueryBuilder

    return QueryBuilder().register("t", table).execute("SELECT id, value FROM t").read_all()


def delta_add_remove(folder: Path, stored: pa.Table, source: pa.Table) -> dict[str, Any]:
    """The new rows' files as the ranks wrote them, plus the files holding superseded keys rewritten without those
    keys: one transaction of add and remove actions with the job's txn."""
    from deltalake import CommitProperties, DeltaTable, Transaction
    from deltalake.transaction import AddAction, RemoveAction

    table = _delta_create(folder, stored)
    new_file = f"tbp-{JOB}-s00000007-r0-a1-00000.parquet"  # written by a rank during the stage (not timed)
    pq.write_table(source, folder / new_file)

    def transaction() -> str:
        table = DeltaTable(str(folder))
        now = int(time.time() * 1000)
        keys = source.column("id")
        adds, removes = [_add(folder, new_file, now, AddAction)], []
        touched = 0
        for path in table.file_uris():  # the live files (a real run filters them by the key bounds of their stats)
            kept = _without(pq.read_table(path), keys)
            if kept is None:
                continue
            touched += 1
            rewritten = f"tbp-{JOB}-rewrite-{uuid.uuid4().hex}.parquet"
            pq.write_table(kept, folder / rewritten)
            adds.append(_add(folder, rewritten, now, AddAction))
            removes.append(RemoveAction(Path(path).name, True, now, Path(path).stat().st_size, {}))
        properties = CommitProperties(
            custom_metadata={"tbp.job": JOB, "tbp.commit": str(COMMIT)},
            app_transactions=[Transaction(f"tbp-{JOB}", COMMIT)],
        )
        table.create_write_transaction([*adds, *removes], mode="append", schema=table.schema(),
                                       commit_properties=properties)
        return f"added {len(adds)} (1 new + {touched} rewritten), removed {len(removes)}"

    started = time.perf_counter()
    files = transaction()
    seconds = time.perf_counter() - started
    table = DeltaTable(str(folder))
    _check(_delta_read(table), stored, source)
    info = table.history(1)[0]
    return {"seconds": seconds, "key": table.transaction_version(f"tbp-{JOB}"),
            "metadata": {k: info.get(k) for k in ("tbp.job", "tbp.commit")}, "files": files}


def _without(rows: pa.Table, keys: pa.ChunkedArray) -> pa.Table | None:
    """A data file's rows without those of ``keys`` (the superseded ones); ``None`` when it holds none of them."""
    keep = pc.invert(pc.is_in(rows.column("id"), keys))
    return None if pc.all(keep).as_py() else rows.filter(keep)


def _add(folder: Path, name: str, now: int, action: Any) -> Any:
    size = (folder / name).stat().st_size
    rows = pq.ParquetFile(folder / name).metadata.num_rows
    return action(name, size, {}, now, True, json.dumps({"numRecords": rows}))


# ------------------------------------------------------------------------------------------------ Iceberg


def _iceberg_create(folder: Path, stored: pa.Table) -> Any:
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog("default", type="sql", uri=f"sqlite:///{folder}/catalog.db", warehouse=f"file://{folder}")
    catalog.create_namespace("ns")
    table = catalog.create_table("ns.t", schema=stored.schema)
    n = stored.num_rows
    for part in range(FILES):
        table.append(stored.slice(part * n // FILES, n // FILES))
    return catalog


def _iceberg(folder: Path, stored: pa.Table, source: pa.Table, apply: Callable[[Any], None]) -> dict[str, Any]:
    catalog = _iceberg_create(folder, stored)

    def merge() -> None:
        table = catalog.load_table("ns.t")
        with table.transaction() as transaction:
            apply(transaction)
            transaction.set_properties({f"tbp.commit.{JOB}": str(COMMIT)})

    before = len(catalog.load_table("ns.t").snapshots())
    metadata = len(list(folder.rglob("*.metadata.json")))
    started = time.perf_counter()
    merge()
    seconds = time.perf_counter() - started
    table = catalog.load_table("ns.t")
    snapshots = table.snapshots()[before:]
    commits = len(list(folder.rglob("*.metadata.json"))) - metadata  # a catalog commit writes one metadata file
    _check(table.scan(selected_fields=("id", "value")).to_arrow(), stored, source)
    summary = table.current_snapshot().summary
    merge()
    _check(catalog.load_table("ns.t").scan(selected_fields=("id", "value")).to_arrow(), stored, source)
    return {
        "seconds": seconds, "key": int(table.properties.get(f"tbp.commit.{JOB}", 0)),
        "metadata": {k: summary.get(k) for k in ("tbp.job", "tbp.commit")},
        "files": f"{len(snapshots)} snapshot(s) ({', '.join(s.summary.operation.value for s in snapshots)}) in "
                 f"{commits} catalog commit(s)",
    }


def iceberg_upsert(folder: Path, stored: pa.Table, source: pa.Table) -> dict[str, Any]:
    props = {"tbp.job": JOB, "tbp.commit": str(COMMIT)}
    return _iceberg(folder, stored, source,
                    lambda tx: tx.upsert(source, join_cols=["id"], snapshot_properties=props))


def iceberg_overwrite(folder: Path, stored: pa.Table, source: pa.Table) -> dict[str, Any]:
    from pyiceberg.expressions import In

    props = {"tbp.job": JOB, "tbp.commit": str(COMMIT)}
    keys = source.column("id").to_pylist()
    return _iceberg(folder, stored, source,
                    lambda tx: tx.overwrite(source, overwrite_filter=In("id", keys), snapshot_properties=props))


def iceberg_add_remove(folder: Path, stored: pa.Table, source: pa.Table) -> dict[str, Any]:
    """Like ``delta add+remove``: the ranks' file of the new rows as it is, the files holding superseded keys rewritten
    without them, in one ``overwrite`` snapshot (``update_snapshot().overwrite()``, as the compaction does) with the
    key property, in one catalog commit."""
    from pyiceberg.io.pyarrow import parquet_file_to_data_file

    catalog = _iceberg_create(folder, stored)
    table = catalog.load_table("ns.t")
    data = f"{table.location().rstrip('/')}/data"
    new_file = f"{data}/tbp-{JOB}-s00000007-r0-a1-00000.parquet"  # written by a rank during the stage (not timed)
    with table.io.new_output(new_file).create(overwrite=True) as f:
        pq.write_table(source.cast(table.schema().as_arrow()), f)
    metadata = len(list(folder.rglob("*.metadata.json")))
    started = time.perf_counter()
    keys = source.column("id")
    touched = 0
    with table.transaction() as transaction:
        with transaction.update_snapshot(snapshot_properties={"tbp.job": JOB, "tbp.commit": str(COMMIT)}).overwrite() \
                as overwrite:
            for task in table.scan().plan_files():
                with table.io.new_input(task.file.file_path).open() as f:
                    kept = _without(pq.read_table(f), keys)
                if kept is None:
                    continue
                touched += 1
                rewritten = f"{data}/tbp-{JOB}-rewrite-{uuid.uuid4().hex}.parquet"
                with table.io.new_output(rewritten).create(overwrite=True) as f:
                    pq.write_table(kept, f)
                overwrite.delete_data_file(task.file)
                overwrite.append_data_file(parquet_file_to_data_file(table.io, transaction.table_metadata, rewritten))
            overwrite.append_data_file(parquet_file_to_data_file(table.io, transaction.table_metadata, new_file))
        transaction.set_properties({f"tbp.commit.{JOB}": str(COMMIT)})
    seconds = time.perf_counter() - started
    table = catalog.load_table("ns.t")
    _check(table.scan(selected_fields=("id", "value")).to_arrow(), stored, source)
    summary = table.current_snapshot().summary
    commits = len(list(folder.rglob("*.metadata.json"))) - metadata
    return {"seconds": seconds, "key": int(table.properties.get(f"tbp.commit.{JOB}", 0)),
            "metadata": {k: summary.get(k) for k in ("tbp.job", "tbp.commit")},
            "files": f"1 overwrite snapshot: added {touched + 1} (1 new + {touched} rewritten), removed {touched}, in "
                     f"{commits} catalog commit(s)"}


# ------------------------------------------------------------------------------------------------ Lance


def lance_merge_insert(folder: Path, stored: pa.Table, source: pa.Table) -> dict[str, Any]:
    import lance

    uri = str(folder / "t.lance")
    n = stored.num_rows
    lance.write_dataset(stored.slice(0, n // FILES), uri)
    for part in range(1, FILES):
        lance.write_dataset(stored.slice(part * n // FILES, n // FILES), uri, mode="append")

    def merge() -> int:
        dataset = lance.dataset(uri)
        transaction, stats = (
            dataset.merge_insert("id").when_matched_update_all().when_not_matched_insert_all()
            .execute_uncommitted(source)
        )
        transaction.transaction_properties = {"tbp.job": JOB, "tbp.commit": str(COMMIT)}
        return lance.LanceDataset.commit(uri, transaction).version

    started = time.perf_counter()
    version = merge()
    seconds = time.perf_counter() - started
    dataset = lance.dataset(uri)
    properties = dataset.read_transaction(version).transaction_properties or {}
    _check(dataset.to_table(columns=["id", "value"]), stored, source)
    merge()
    _check(lance.dataset(uri).to_table(columns=["id", "value"]), stored, source)
    deletions = sum(1 for f in dataset.get_fragments() if f.metadata.deletion_file is not None)
    return {"seconds": seconds, "key": int(properties.get("tbp.commit", 0)),
            "metadata": {k: properties.get(k) for k in ("tbp.job", "tbp.commit")},
            "files": f"{len(dataset.get_fragments())} fragments, {deletions} with a deletion file"}


WAYS: dict[str, Callable[[Path, pa.Table, pa.Table], dict[str, Any]]] = {
    "delta merge": delta_merge,
    "delta add+remove": delta_add_remove,
    "iceberg upsert": iceberg_upsert,
    "iceberg overwrite": iceberg_overwrite,
    "iceberg add+remove": iceberg_add_remove,
    "lance merge_insert": lance_merge_insert,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS))
    args = parser.parse_args(argv)
    ways = args.ways.split(",")
    stored, source = _scenario(args.rows)
    results: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for r in range(args.rounds):
        for way in ways[r % len(ways):] + ways[: r % len(ways)]:
            folder = Path(tempfile.mkdtemp(prefix="tbp-merge-"))
            try:
                results[way].append(WAYS[way](folder, stored, source))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    print(f"MERGE of {source.num_rows:,} rows (10% changed keys, 10% new) into {args.rows:,} rows in {FILES} files, "
          f"{args.rounds} round(s); checked: every key once with its newest values, the key read back, and (but for "
          "the add+remove ways, which rely on the key) the rows unchanged by a replay")
    print(f"| {'way':18} | {'merge s':>20} | {'key read back':>13} | {'commit metadata':32} | "
          "what the transaction did |")
    print(f"|{'-' * 20}|{'-' * 22}|{'-' * 15}|{'-' * 34}|{'-' * 26}|")
    for way in ways:
        rows = results[way]
        seconds = [x["seconds"] for x in rows]
        spread = f"{statistics.median(seconds):.2f} [{min(seconds):.2f}-{max(seconds):.2f}]"
        meta = ", ".join(f"{k}={v}" for k, v in rows[-1]["metadata"].items())
        print(f"| {way:18} | {spread:>20} | {rows[-1]['key']:>13} | {meta:32} | {rows[-1]['files']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
