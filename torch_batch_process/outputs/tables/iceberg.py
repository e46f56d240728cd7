"""Apache Iceberg tables (``pyiceberg``, any catalog it supports): :func:`iceberg` and :class:`IcebergTableOutput`.

Data files are Parquet files written by the ranks under the table's ``data/`` folder (through the table's own
FileIO, so the catalog's storage properties apply); a transaction adds them with ``Transaction.add_files`` (an
``append`` snapshot) and, in the same catalog commit, sets the table property ``tbp.commit.<job id>`` to the commit
record's number. The snapshot's summary also carries the key (``tbp.job``, ``tbp.commit``); the table property is
what the next start reads, because expiring snapshots drops their summaries.

Compaction: pyiceberg (0.12) has no data-file rewrite action (its ``maintenance`` only expires snapshots), so the
closest supported thing is done: the current snapshot's small files are read in bins of
:data:`TARGET_FILE_BYTES`, each bin is written as one file, and one ``overwrite`` snapshot
(``Transaction.update_snapshot().overwrite()``) deletes the small files and adds the new ones: the rows are
unchanged, readers of any version see them once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.outputs.tables.base import (
    DataFileWriter,
    Table,
    TableTarget,
    check_options,
    concat_keys,
    data_file_stage,
    normalize_schema,
    require,
)
from torch_batch_process.outputs.tables.parquet_files import ParquetDataFile

__all__ = ["IcebergTableOutput", "TARGET_FILE_BYTES", "iceberg"]

logger = logging.getLogger(__name__)

TARGET_FILE_BYTES = 128 << 20
"""Compaction: files smaller than this are merged into files of about this size."""


@dataclass(frozen=True)
class IcebergTableOutput(TableTarget):
    """An Iceberg table as the target of ``context.write()`` rows (see :func:`iceberg`)."""

    identifier: str
    catalog: str | None = None
    catalog_properties: dict[str, str] | None = field(default=None, compare=False, repr=False)
    compact: bool = True
    commit_interval_s: float = 1.0
    kind = "iceberg"

    def check(self) -> None:
        require("pyiceberg", "iceberg", "tables.iceberg(...)")
        table = self.open()
        table.catalog()  # a catalog that cannot be loaded or reached: an error now
        table.check_readable()  # a table its library cannot read: an error now, not after the first batch

    def describe(self) -> dict[str, Any]:
        where = (self.catalog_properties or {}).get("uri")
        return {"format": "iceberg", "identifier": self.identifier, "catalog": self.catalog or where}

    def open(self, merge_key: str | None = None) -> IcebergTable:
        return IcebergTable(self, merge_key)


def iceberg(
    identifier: str,
    *,
    catalog: str | Mapping[str, str] | None = None,
    compact: bool = True,
    commit_interval_s: float = 1.0,
) -> IcebergTableOutput:
    """An Iceberg table as the target of ``context.write()`` rows: ``torch_batch_process(..., table=iceberg(...))``.

    Args:
        identifier: the table, ``"namespace.table"``; created (and its namespace) at the first rows if it does not
            exist, else appended to (its columns must match).
        catalog: the catalog, as pyiceberg's ``load_catalog`` takes it: a dict of catalog properties (e.g.
            ``{"type": "sql", "uri": "sqlite:////path/catalog.db", "warehouse": "file:///path/warehouse"}`` for a
            local SQL catalog, ``{"type": "rest", "uri": "https://..."}``, storage properties such as
            ``s3.endpoint`` included; the optional key ``"name"`` names the catalog, default ``"default"``: a SQL
            catalog keeps it with its tables, so read it back with ``load_catalog(name, ...)``), or the name of a
            catalog configured in ``~/.pyiceberg.yaml`` or the ``PYICEBERG_CATALOG__...`` environment; ``None``:
            pyiceberg's default catalog.
        compact: merge the table's small files when the job finishes (see the module docstring).
        commit_interval_s: the least time between two table transactions: the job's commits in between are added by
            one (at most one transaction per commit; the closing and final commits never wait).
    """
    if not isinstance(identifier, str) or "." not in identifier.strip(".") or any(not p for p in identifier.split(".")):
        raise InvalidArgumentError(
            f"tables.iceberg(identifier): the table must be named 'namespace.table', got {identifier!r}"
        )
    interval = check_options(f"tables.iceberg({identifier!r})", compact, commit_interval_s)
    if catalog is None or isinstance(catalog, str):
        return IcebergTableOutput(identifier, catalog, None, compact, interval)
    if not isinstance(catalog, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in catalog.items()):
        raise InvalidArgumentError(
            "tables.iceberg(catalog=...) must be a catalog name or a dict of str catalog properties (e.g. "
            f"{{'type': 'sql', 'uri': 'sqlite:///catalog.db', 'warehouse': 'file:///warehouse'}}), got {catalog!r:.200}"
        )
    properties = dict(catalog)
    return IcebergTableOutput(identifier, properties.pop("name", None), properties, compact, interval)


def _key_property(job_id: str) -> str:
    return f"tbp.commit.{job_id}"


class IcebergTable(Table):
    """An opened Iceberg table (see the module docstring)."""

    def __init__(self, target: IcebergTableOutput, merge_key: str | None = None) -> None:
        super().__init__(target, merge_key)
        self._target = target
        self._catalog: Any = None
        self._location: str | None = None
        self._io: Any = None  # the table's FileIO, kept once the table exists (a rank opens many data files)

    def catalog(self) -> Any:
        """The catalog (loaded once)."""
        if self._catalog is None:
            from pyiceberg.catalog import load_catalog

            target = self._target
            name = target.catalog or "default"
            try:
                self._catalog = _load_catalog(load_catalog, name, target.catalog_properties or {})
            except Exception as exc:  # noqa: BLE001 - pyiceberg raises many kinds
                raise InvalidArgumentError(
                    f"tables.iceberg({target.identifier!r}, catalog=...): the catalog cannot be used "
                    f"({type(exc).__name__}: {exc}); give pyiceberg catalog properties (e.g. {{'type': 'sql', 'uri': "
                    "'sqlite:////path/catalog.db', 'warehouse': 'file:///path/warehouse'}) or a configured catalog name"
                ) from exc
        return self._catalog

    def _load(self) -> Any:
        from pyiceberg.exceptions import NoSuchTableError

        try:
            return self.catalog().load_table(self._target.identifier)
        except NoSuchTableError:
            return None

    def exists(self) -> bool:
        return self._load() is not None

    def arrow_schema(self) -> Any:
        table = self._load()
        if table is None:
            return None
        return normalize_schema(_plain(table.schema().as_arrow()), fixed_lists=False, what="an Iceberg table",
                                origin=self._target.identifier)

    def ensure(self, schema: Any) -> Any:
        namespace = self._target.identifier.rsplit(".", 1)[0]
        catalog = self.catalog()
        try:  # ranks race here at their first rows: whichever creates the namespace and the table, its schema decides
            catalog.create_namespace_if_not_exists(namespace)
        except Exception:
            if not catalog.namespace_exists(namespace):
                raise
        try:
            catalog.create_table_if_not_exists(self._target.identifier, schema=schema)
        except Exception:
            if not self.exists():
                raise
        return self.arrow_schema()

    def _data_folder(self) -> str:
        if self._location is None:
            table = self._load()
            assert table is not None, "ensure() creates the table before any data file"
            self._location, self._io = table.location().rstrip("/"), table.io
        return f"{self._location}/data"

    def open_file(self, name: str, schema: Any, stage: int) -> DataFileWriter:
        path = f"{self._data_folder()}/{name}"  # the table's location and FileIO, loaded once
        return ParquetDataFile(self._io.new_output(path).create(overwrite=True), path, schema, stage)

    def committed_key(self, job_id: str) -> int:
        table = self._load()
        if table is None:
            return 0
        return int(table.properties.get(_key_property(job_id), 0))

    def commit(self, files: list[dict[str, Any]], schema: Any, job_id: str, key: int) -> None:
        self.ensure(schema)
        table = self._load()
        properties = {"tbp.job": job_id, "tbp.commit": str(key)}
        with table.transaction() as transaction:
            if self.merge_key is not None:  # a keyed job: the new rows replace their keys' rows (§21)
                data, dropped = self.merge_parts(files)
                self._merge(table, transaction, [f["path"] for f in data], dropped, properties, key)
            else:
                transaction.add_files(
                    [f["path"] for f in files],
                    snapshot_properties=properties,
                    check_duplicate_files=False,  # the key says which commits the table holds: no O(table) check
                )
            transaction.set_properties({_key_property(job_id): str(key)})

    def _merge(
        self, table: Any, transaction: Any, paths: list[str], dropped: Any, properties: dict[str, str], key: int
    ) -> None:
        """The MERGE by key of a keyed job, as one snapshot of the transaction that carries the job's key: the new files
        are added, and every live file holding one of their keys or of ``dropped`` (failed keys) is deleted and, when it
        keeps other rows, added again rewritten without them (copy-on-write, as the Delta merge; measured as ``iceberg
        add+remove`` in ``benchmarks/incremental_tables.py``). Computed from the table as it is before the transaction,
        so a replay of an uncommitted transaction (the job's next start) computes the same; a rewritten file's name
        comes from the file it replaces and the key, so a replay overwrites what a killed attempt left, unreferenced."""
        import hashlib

        import pyarrow.compute as pc
        from pyiceberg.expressions import And, GreaterThanOrEqual, LessThanOrEqual
        from pyiceberg.io.pyarrow import parquet_file_to_data_file
        from pyiceberg.table import TableProperties

        column = self.merge_key
        assert column is not None
        keys = pc.unique(concat_keys([*(self._read(table, path, [column]).column(column) for path in paths), dropped]))
        doomed: list[Any] = []
        rewritten: list[str] = []
        if table.current_snapshot() is not None and len(keys):
            bounds = pc.min_max(keys)  # files whose key statistics miss the new keys' range are not read
            condition = And(GreaterThanOrEqual(column, bounds["min"].as_py()),
                            LessThanOrEqual(column, bounds["max"].as_py()))
            added = set(paths)
            schema = self.arrow_schema()
            for task in table.scan(row_filter=condition, selected_fields=(column,)).plan_files():
                path = str(task.file.file_path)
                if path in added:
                    continue
                hit = pc.is_in(self._read(table, path, [column]).column(column), value_set=keys)
                if not pc.any(hit).as_py():
                    continue
                doomed.append(task.file)
                rows = self._read(table, path, None).select(schema.names).cast(schema)
                kept = rows.filter(pc.invert(pc.is_in(rows.column(column), value_set=keys)))
                if kept.num_rows:
                    digest = hashlib.sha256(path.encode()).hexdigest()[:16]
                    target = f"{self._data_folder()}/tbp-{properties['tbp.job']}-merge{key:08d}-{digest}.parquet"
                    writer = ParquetDataFile(table.io.new_output(target).create(overwrite=True), target, schema, 0)
                    writer.write_table(kept)
                    rewritten.append(writer.close()[0]["path"])
        if not (doomed or paths):
            return  # nothing to change: the transaction carries the job's key only
        if transaction.table_metadata.name_mapping() is None:  # what add_files does: files without field ids
            mapping = transaction.table_metadata.schema().name_mapping.model_dump_json()
            transaction.set_properties(**{TableProperties.DEFAULT_NAME_MAPPING: mapping})
        snapshot = transaction.update_snapshot(snapshot_properties=properties)
        with (snapshot.overwrite() if doomed else snapshot.fast_append()) as update:
            for data_file in doomed:
                update.delete_data_file(data_file)
            for path in [*rewritten, *paths]:
                update.append_data_file(parquet_file_to_data_file(table.io, transaction.table_metadata, path))

    @staticmethod
    def _read(table: Any, path: str, columns: list[str] | None) -> Any:
        import pyarrow.parquet as pq

        with table.io.new_input(path).open() as f:
            return pq.read_table(f, columns=columns)

    def _filesystem(self) -> tuple[Any, str]:
        from pyiceberg.io.pyarrow import PyArrowFileIO

        table = self._load()
        folder = self._data_folder()
        scheme, netloc, path = PyArrowFileIO.parse_location(folder)
        return table.io.fs_by_scheme(scheme, netloc), path

    def remove_orphans(self, job_id: str, committed: Callable[[int], bool]) -> int:
        if not self.exists():
            return 0
        import pyarrow.fs as pafs

        fs, folder = self._filesystem()
        infos = fs.get_file_info(pafs.FileSelector(folder, recursive=False, allow_not_found=True))
        doomed = []
        for info in infos:
            stage = data_file_stage(info.base_name, job_id)
            if stage is not None and not committed(stage):
                doomed.append(info.path)
        for path in doomed:
            fs.delete_file(path)
        return len(doomed)

    def compact(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyiceberg.io.pyarrow import parquet_file_to_data_file

        table = self._load()
        if table is None or table.current_snapshot() is None:
            return
        small = [task.file for task in table.scan().plan_files() if task.file.file_size_in_bytes < TARGET_FILE_BYTES]
        small = [f for f in small if str(f.file_path).endswith(".parquet")]
        bins: list[list[Any]] = []
        size = TARGET_FILE_BYTES
        for data_file in sorted(small, key=lambda f: str(f.file_path)):
            if size + data_file.file_size_in_bytes > TARGET_FILE_BYTES:
                bins.append([])
                size = 0
            bins[-1].append(data_file)
            size += data_file.file_size_in_bytes
        bins = [b for b in bins if len(b) > 1]
        if not bins:
            return
        schema = self.arrow_schema()
        written = []
        for group in bins:
            parts = []
            for data_file in group:
                with table.io.new_input(str(data_file.file_path)).open() as f:
                    parts.append(pq.read_table(f).select(schema.names).cast(schema))
            name = f"tbp-compacted-{uuid.uuid4().hex}.parquet"  # no job's data file name: never taken for an orphan
            writer = ParquetDataFile(table.io.new_output(f"{self._data_folder()}/{name}").create(overwrite=True),
                                     f"{self._data_folder()}/{name}", schema, 0)
            writer.write_table(pa.concat_tables(parts))
            written.append(writer.close()[0]["path"])
        with table.transaction() as transaction:
            with transaction.update_snapshot(snapshot_properties={"tbp.compaction": "1"}).overwrite() as overwrite:
                for group in bins:
                    for data_file in group:
                        overwrite.delete_data_file(data_file)
                for path in written:
                    overwrite.append_data_file(parquet_file_to_data_file(table.io, transaction.table_metadata, path))

    def live_files(self) -> int:
        table = self._load()
        if table is None or table.current_snapshot() is None:
            return 0
        return sum(1 for _ in table.scan().plan_files())

    def batches(self, columns: list[str] | None, low: int | None, high: int | None) -> Iterator[Any]:
        from pyiceberg.expressions import AlwaysTrue, And, GreaterThanOrEqual, LessThan

        table = self._load()
        if table is None:
            return iter(())
        condition: Any = AlwaysTrue()
        if low is not None:
            condition = And(condition, GreaterThanOrEqual("index", low))
        if high is not None:
            condition = And(condition, LessThan("index", high))
        scan = table.scan(row_filter=condition, selected_fields=tuple(columns) if columns else ("*",))
        return iter(scan.to_arrow_batch_reader())


def _plain(schema: Any) -> Any:
    """An Arrow schema without pyiceberg's field-id metadata."""
    import pyarrow as pa

    return pa.schema([pa.field(f.name, f.type) for f in schema])


_RACES = ("already exists", "database is locked")
"""Errors of a SQL catalog that several ranks open at once for the first time (each creates its tables, sqlite
locks the file): transient, so the load is tried again."""


def _load_catalog(load_catalog: Any, name: str, properties: dict[str, Any], attempts: int = 6) -> Any:
    """The catalog, reached (``list_namespaces``: a bad URI or credentials fail here, before any work). A race of
    ranks creating a new SQL catalog's tables together is tried again, a few times over about 6 s."""
    for attempt in range(attempts):
        try:
            catalog = load_catalog(name, **properties)
            catalog.list_namespaces()
            return catalog
        except Exception as exc:  # noqa: BLE001 - pyiceberg and sqlalchemy raise many kinds
            if attempt == attempts - 1 or not any(race in str(exc) for race in _RACES):
                raise
            time.sleep(0.1 * 2**attempt)
    raise AssertionError("unreachable")
