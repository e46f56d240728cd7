"""Delta Lake tables (``deltalake``, delta-rs): :func:`delta` and its :class:`DeltaTableOutput`.

Data files are Parquet files written by the ranks at the table's root; a transaction adds them with
``DeltaTable.create_write_transaction`` (``add`` actions with row counts and ``index`` bounds), carrying the job's
idempotency key as a Delta *application transaction* (``txn``: app id ``tbp-<job id>``, version = the commit
record's number) and in the commit info (``tbp.job``, ``tbp.commit``). ``DeltaTable.transaction_version`` reads
the key back. Compaction is ``DeltaTable.optimize.compact()``.

On object stores Delta needs a safe commit (a conditional put, or a locking provider: see delta-rs'
``storage_options``); only rank 0 commits, so one job never races itself.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.outputs.tables.base import (
    DataFileWriter,
    Table,
    TableTarget,
    check_options,
    check_storage_options,
    concat_keys,
    data_file_stage,
    normalize_schema,
    require,
)
from torch_batch_process.outputs.tables.parquet_files import ParquetDataFile
from torch_batch_process.storage.errors import file_error
from torch_batch_process.storage.urls import check_storage_url

__all__ = ["DeltaTableOutput", "delta"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeltaTableOutput(TableTarget):
    """A Delta Lake table as the target of ``context.write()`` rows (see :func:`delta`)."""

    uri: str
    storage_options: dict[str, str] | None = field(default=None, compare=False, repr=False)
    compact: bool = True
    commit_interval_s: float = 1.0
    kind = "delta"

    def check(self) -> None:
        require("deltalake", "delta", "tables.delta(...)")
        what = f"tables.delta({self.uri!r})"
        check_storage_options(self.storage_options, what)
        table = self.open()
        exists = table.check_readable()  # a table its library cannot read (or a place it cannot use): an error now
        if "://" in self.uri and not exists:
            _check_scheme(self.uri, self.storage_options, what)

    def describe(self) -> dict[str, Any]:
        return {"format": "delta", "uri": self.uri}

    def open(self, merge_key: str | None = None) -> DeltaTable:
        return DeltaTable(self, merge_key)


def _check_scheme(uri: str, storage_options: dict[str, str] | None, what: str) -> None:
    """Raises InvalidArgumentError when delta-rs knows no object store for the scheme of ``uri`` (``bogus://``): it
    would say so only when the job commits its first rows."""
    from deltalake import DeltaTable as Loaded

    try:
        Loaded(uri, storage_options=storage_options)
    except Exception as exc:  # noqa: BLE001 - a table that does not exist yet is the expected answer
        if "unknown scheme" in str(exc).lower():
            raise InvalidArgumentError(f"{what}: {str(exc).splitlines()[0][:300]}; fix the URI") from exc


def delta(
    uri: str | os.PathLike[str],
    *,
    storage_options: dict[str, str] | None = None,
    compact: bool = True,
    commit_interval_s: float = 1.0,
) -> DeltaTableOutput:
    """A Delta Lake table as the target of ``context.write()`` rows: ``torch_batch_process(..., table=delta(uri))``.

    Args:
        uri: the table: a local path or an object-store URI (``s3://bucket/path``, ``gs://``, ``az://``...);
            created at the first rows if it does not exist, else appended to (its columns must match).
        storage_options: delta-rs' object-store options (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...;
            default: the environment).
        commit_interval_s: the least time between two table transactions: the job's commits in between are added by
            one (at most one transaction per commit; the closing and final commits never wait).
        compact: compact the table's small files when the job finishes (``DeltaTable.optimize.compact()``).
    """
    if not isinstance(uri, (str, os.PathLike)) or not os.fspath(uri).strip():
        raise InvalidArgumentError(f"tables.delta(uri): uri must be a non-empty path or URI, got {uri!r}")
    interval = check_options(f"tables.delta({uri!r})", compact, commit_interval_s)
    text = check_storage_url(uri, "tables.delta(uri)", fsspec_protocols=False)  # s3:/b would be a local folder
    if "://" not in text:
        text = os.path.abspath(text)
    return DeltaTableOutput(text, check_storage_options(storage_options, f"tables.delta({text!r})"), compact, interval)


def _app_id(job_id: str) -> str:
    return f"tbp-{job_id}"


class DeltaTable(Table):
    """An opened Delta table (see the module docstring)."""

    def __init__(self, target: DeltaTableOutput, merge_key: str | None = None) -> None:
        super().__init__(target, merge_key)
        self._target = target
        self._local = "://" not in target.uri or target.uri.startswith("file://")
        self._root = target.uri[len("file://") :] if target.uri.startswith("file://") else target.uri

    def _load(self) -> Any:
        from deltalake import DeltaTable as Loaded

        return Loaded(self._target.uri, storage_options=self._target.storage_options)

    def exists(self) -> bool:
        from deltalake import DeltaTable as Loaded

        return bool(Loaded.is_deltatable(self._target.uri, storage_options=self._target.storage_options))

    def arrow_schema(self) -> Any:
        import pyarrow as pa

        if not self.exists():
            return None
        schema = pa.schema(self._load().schema().to_arrow())
        return normalize_schema(schema, fixed_lists=False, what="a Delta table", origin=self._target.uri)

    def ensure(self, schema: Any) -> Any:
        from deltalake import DeltaTable as Loaded

        try:
            Loaded.create(self._target.uri, schema, mode="ignore", storage_options=self._target.storage_options)
        except Exception:  # another rank created it at the same moment: its schema decides
            if not self.exists():
                raise
        return self.arrow_schema()

    def open_file(self, name: str, schema: Any, stage: int) -> DataFileWriter:
        shown = f"{self._target.uri.rstrip('/')}/{name}"  # errors name the file in its table
        if self._local:
            import pyarrow as pa

            try:
                os.makedirs(self._root, exist_ok=True)
                stream = pa.OSFile(os.path.join(self._root, name), mode="wb")  # closed by the data file
            except OSError as exc:  # e.g. a full disk
                raise file_error(shown, "create the table's data file", exc) from exc
        else:  # delta-rs' own object store (the table's storage options); its stream takes bytes only
            stream = _BytesStream(self._handler()._handler.open_output_stream(name, None))
        return ParquetDataFile(stream, name, schema, stage, shown=shown)

    def _handler(self) -> Any:
        from deltalake.fs import DeltaStorageHandler

        return DeltaStorageHandler(self._target.uri, self._target.storage_options)

    def committed_key(self, job_id: str) -> int:
        if not self.exists():
            return 0
        return int(self._load().transaction_version(_app_id(job_id)) or 0)

    def commit(self, files: list[dict[str, Any]], schema: Any, job_id: str, key: int) -> None:
        from deltalake import CommitProperties, Transaction
        from deltalake.transaction import AddAction

        self.ensure(schema)
        table = self._load()
        now = int(time.time() * 1000)
        data, dropped = files, None
        if self.merge_key is not None:  # a keyed job: its failures' keys (tombstones) leave the table too (§21)
            data, dropped = self.merge_parts(files)
        actions = [
            AddAction(f["path"], int(f["size"]), {}, now, True, json.dumps(_stats(f))) for f in data
        ]
        if dropped is not None:  # a keyed job: the new rows replace their keys' rows (§21)
            actions += self._superseded(table, data, dropped, job_id, key, now)
        properties = CommitProperties(
            custom_metadata={"tbp.job": job_id, "tbp.commit": str(key)},
            app_transactions=[Transaction(_app_id(job_id), key)],
        )
        table.create_write_transaction(actions, mode="append", schema=table.schema(), commit_properties=properties)

    def _superseded(
        self, table: Any, files: list[dict[str, Any]], dropped: Any, job_id: str, key: int, now: int
    ) -> list[Any]:
        """The MERGE by key of a keyed job, in the transaction of ``files``: every live file holding a key of ``files``
        or of ``dropped`` (failed keys) is removed, and re-added rewritten without those rows when it keeps others
        (copy-on-write, as delta-rs' own ``merge``; measured in ``benchmarks/incremental_tables.py``). Computed from the
        table as it is before the transaction, so a replay of an uncommitted transaction (the job's start) computes the
        same."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        from deltalake.transaction import AddAction, RemoveAction

        column = self.merge_key
        assert column is not None
        added = {f["path"] for f in files}
        keys = pc.unique(concat_keys([
            *(pq.read_table(os.path.join(self._root, f["path"]), columns=[column]).column(column) for f in files),
            dropped,
        ]))
        if not len(keys):
            return []
        actions: list[Any] = []
        for uri in table.file_uris():
            name = uri.rsplit("/", 1)[-1]
            path = os.path.join(self._root, name)
            if name in added:
                continue
            hit = pc.is_in(pq.read_table(path, columns=[column]).column(column), value_set=keys)
            if not pc.any(hit).as_py():
                continue
            rows = pq.read_table(path)
            kept = rows.filter(pc.invert(pc.is_in(rows.column(column), value_set=keys)))
            if kept.num_rows:
                rewritten = f"tbp-{job_id}-merge{key:08d}-{uuid.uuid4().hex[:12]}.parquet"
                pq.write_table(kept, os.path.join(self._root, rewritten))
                size = os.path.getsize(os.path.join(self._root, rewritten))
                actions.append(AddAction(rewritten, size, {}, now, True, json.dumps({"numRecords": kept.num_rows})))
            actions.append(RemoveAction(name, True, now, os.path.getsize(path), {}))
        return actions

    def remove_orphans(self, job_id: str, committed: Callable[[int], bool]) -> int:
        if self._local:
            names = os.listdir(self._root) if os.path.isdir(self._root) else []
            doomed = [n for n in names if _orphan(n, job_id, committed)]
            for name in doomed:
                os.remove(os.path.join(self._root, name))
            return len(doomed)
        import pyarrow.fs as pafs

        handler = self._handler()
        infos = handler.get_file_info_selector(pafs.FileSelector("", recursive=False, allow_not_found=True))
        doomed = [info.path for info in infos if _orphan(info.path.rsplit("/", 1)[-1], job_id, committed)]
        for path in doomed:
            handler.delete_file(path)
        return len(doomed)

    def compact(self) -> None:
        """``optimize.compact()`` with the encoding of the ranks' files (snappy; dictionaries for text, statistics
        for flat columns only): delta-rs' defaults (dictionaries and statistics everywhere) made it ~3x slower on
        tensor columns."""
        import pyarrow as pa
        from deltalake import ColumnProperties, WriterProperties

        schema = self.arrow_schema()
        columns = {
            f.name: ColumnProperties(dictionary_enabled=pa.types.is_string(f.type), statistics_enabled="CHUNK")
            for f in schema
            if not pa.types.is_nested(f.type)
        }
        properties = WriterProperties(
            compression="SNAPPY",
            default_column_properties=ColumnProperties(dictionary_enabled=False, statistics_enabled="NONE"),
            column_properties=columns,
        )
        self._load().optimize.compact(writer_properties=properties)

    def live_files(self) -> int:
        return len(self._load().file_uris())

    def batches(self, columns: list[str] | None, low: int | None, high: int | None) -> Iterator[Any]:
        """Through delta-rs' own query engine (``QueryBuilder``): ``to_pyarrow_dataset()`` reads through a Python
        filesystem from pyarrow's threads, which makes some processes abort at exit (deltalake 1.6)."""
        import pyarrow as pa
        from deltalake import QueryBuilder

        names = ", ".join(f'"{c}"' for c in columns) if columns else "*"
        bounds = [f'"index" >= {int(low)}'] if low is not None else []
        bounds += [f'"index" < {int(high)}'] if high is not None else []
        where = f" WHERE {' AND '.join(bounds)}" if bounds else ""
        reader = QueryBuilder().register("tbp_table", self._load()).execute(f"SELECT {names} FROM tbp_table{where}")
        return (pa.record_batch(batch) for batch in reader)


def _orphan(name: str, job_id: str, committed: Callable[[int], bool]) -> bool:
    stage = data_file_stage(name, job_id)
    return stage is not None and not committed(stage)


def _stats(file: dict[str, Any]) -> dict[str, Any]:
    stats: dict[str, Any] = {"numRecords": int(file["rows"])}
    if file.get("low") is not None:
        stats.update(minValues={"index": file["low"]}, maxValues={"index": file["high"]}, nullCount={"index": 0})
    return stats


class _BytesStream:
    """A file object over delta-rs' object-store output stream, which takes ``bytes`` (pyarrow hands buffers)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._written = 0
        self.closed = False

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._raw.write(chunk)
        self._written += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
            self.closed = True
