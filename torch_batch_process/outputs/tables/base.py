"""What every table format implements: the target a user names, the table it opens, and its data files.

A :class:`TableTarget` is what ``torch_batch_process(..., table=...)`` receives (built by
:func:`torch_batch_process.tables.delta`, :func:`~torch_batch_process.tables.iceberg` or
:func:`~torch_batch_process.tables.lance`): where the table is and how to reach it. It is checked on every rank
before any work (:meth:`TableTarget.check`: the format's package is installed, the options are well formed, the
catalog answers) and identifies the table in the job's fingerprint (:meth:`TableTarget.describe`, no secrets).

A :class:`Table` is the opened table, one implementation per format behind one interface: its schema, the data
files a rank writes during a stage (:meth:`Table.open_file`), the one transaction that adds the files of job
commits to it with their idempotency key (:meth:`Table.commit`), the key it holds (:meth:`Table.committed_key`),
clean-up of the data files of stages that were never committed, compaction and reading. The protocol that drives
them is :mod:`torch_batch_process.outputs.tables.commits`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch_batch_process.errors import InvalidArgumentError, SchemaConflictError
from torch_batch_process.outputs.columns import INDEX_COLUMN
from torch_batch_process.shell_commands import pip_install

__all__ = [
    "DataFileWriter",
    "Table",
    "TableTarget",
    "check_options",
    "check_storage_options",
    "concat_keys",
    "tombstone",
    "data_file_name",
    "data_file_stage",
    "normalize_schema",
    "require",
]

_NAME = re.compile(r"^tbp-(?P<job>.+)-s(?P<stage>\d{8})-r\d+-a\d+-\d{5}\.parquet$")


def data_file_name(job_id: str, stage: int, rank: int, attempt: int, part: int) -> str:
    """The name of a data file a rank writes into the table during stage ``stage`` (Parquet-based formats): the
    job id and the stage in it let the next start find the files of stages that were never committed."""
    return f"tbp-{job_id}-s{stage:08d}-r{rank}-a{attempt}-{part:05d}.parquet"


def data_file_stage(name: str, job_id: str) -> int | None:
    """The stage of a data file named by :func:`data_file_name` for job ``job_id``; ``None`` for any other file."""
    match = _NAME.match(name)
    if match is None or match.group("job") != job_id:
        return None
    return int(match.group("stage"))


def require(module: str, extra: str, what: str, *, load: bool = True) -> Any:
    """Imports ``module`` (``load=False``: only finds it, for a library that must not be loaded yet), or raises
    :class:`InvalidArgumentError` naming the pip extra that installs it."""
    import importlib
    import importlib.util

    try:
        if not load:
            if importlib.util.find_spec(module) is None:
                raise ImportError(module)
            return None
        return importlib.import_module(module)
    except ImportError as exc:
        raise InvalidArgumentError(
            f"table={what} needs the {module.split('.')[0]} package, which is not installed: {pip_install(extra)}"
        ) from exc


def check_options(what: str, compact: Any, commit_interval_s: Any) -> float:
    """Checks the options every target has; returns ``commit_interval_s`` as a float."""
    if not isinstance(compact, bool):
        raise InvalidArgumentError(f"{what}: compact must be True or False, got {compact!r}")
    if isinstance(commit_interval_s, bool) or not isinstance(commit_interval_s, (int, float)) or not (
        0 <= commit_interval_s < float("inf")
    ):
        raise InvalidArgumentError(
            f"{what}: commit_interval_s must be a number of seconds >= 0 (the least time between two table "
            f"transactions), got {commit_interval_s!r}"
        )
    return float(commit_interval_s)


def check_storage_options(value: Any, what: str) -> dict[str, str] | None:
    """``storage_options`` of a table target: ``None`` or a dict of str to str (the format's object-store options)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidArgumentError(
            f"{what}: storage_options must be a dict of str to str (the table's object-store options, e.g. "
            f"{{'AWS_ENDPOINT_URL': 'http://...'}}), got {value!r:.200}"
        )
    return dict(value)


def concat_keys(columns: list[Any]) -> Any:
    """Key columns (chunked or not) (of a keyed job's new data files, DESIGN §21) as one array."""
    import pyarrow as pa

    chunks = [c for column in columns for c in (column.chunks if hasattr(column, "chunks") else [column])]
    return pa.chunked_array(chunks, columns[0].type).combine_chunks()


TOMBSTONES = "tombstones"
"""The descriptor entry of a keyed job's failed keys (DESIGN §21): no data file, keys whose rows leave the table."""


def tombstone(keys: list[Any]) -> dict[str, Any]:
    """The descriptor that travels with a stage's data files for the keys of examples whose processing failed in it:
    the MERGE removes their rows (a changed example whose rerun failed is not served stale, as the shards'
    failure tombstones do)."""
    return {TOMBSTONES: list(keys), "rows": 0}


def normalize_schema(schema: Any, *, fixed_lists: bool, what: str, origin: str) -> Any:
    """The Arrow schema of a table's data files for rows of ``schema`` (``index`` first).

    Types the format lacks become the nearest one that holds every value (``uint8`` -> ``int16``..., large
    strings and lists -> plain ones; with ``fixed_lists=False``, fixed-size lists -> lists); types no table
    column can hold raise :class:`SchemaConflictError` naming the column, before anything is written.
    """
    import pyarrow as pa

    def convert(name: str, t: Any) -> Any:
        types = pa.types
        if types.is_null(t):
            raise SchemaConflictError(
                f"context.write(): column {name!r} is all None in {origin}; {what} needs a type for every column "
                "from the first rows: write typed values (e.g. a float NaN, an empty string) instead of None"
            )
        if types.is_float16(t):
            raise SchemaConflictError(
                f"context.write(): column {name!r} is float16 in {origin}, which {what} cannot store; write it as "
                "float32 (tensor.float())"
            )
        if types.is_uint64(t):
            raise SchemaConflictError(
                f"context.write(): column {name!r} is uint64 in {origin}, which {what} cannot store; write it as "
                "int64"
            )
        if types.is_uint8(t) or types.is_uint16(t) or types.is_uint32(t):  # the next signed type holds every value
            return {8: pa.int16, 16: pa.int32, 32: pa.int64}[t.bit_width]()
        if types.is_large_string(t):
            return pa.string()
        if types.is_large_binary(t):
            return pa.binary()
        if types.is_fixed_size_list(t):
            value = convert(name, t.value_type)
            return pa.list_(value, t.list_size) if fixed_lists else pa.list_(value)
        if types.is_list(t) or types.is_large_list(t):
            return pa.list_(convert(name, t.value_type))
        if types.is_struct(t):
            return pa.struct([pa.field(f.name, convert(f"{name}.{f.name}", f.type)) for f in t])
        if types.is_dictionary(t):
            return convert(name, t.value_type)
        return t

    fields = [pa.field(f.name, convert(f.name, f.type)) for f in schema]
    return pa.schema(fields)


class DataFileWriter(ABC):
    """One data file (or, for Lance, the fragments of one shard) being written by a rank."""

    @abstractmethod
    def write_table(self, table: Any, row_group_size: int | None = None) -> None:
        """Writes rows (already in the file's schema); called from the rank's encoder thread, in order."""

    @abstractmethod
    def close(self) -> list[dict[str, Any]]:
        """Finishes the file; returns what the table commit needs to add it (JSON-able descriptors)."""


class Table(ABC):
    """An opened table (see the module docstring). Methods other than :meth:`open_file` run on rank 0 only."""

    fixed_lists: bool = False
    """Whether fixed-shape tensors stay fixed-size lists in the table (Lance: vectors it can index)."""

    def __init__(self, target: TableTarget, merge_key: str | None = None) -> None:
        self.target = target
        self.merge_key = merge_key
        """A keyed job's key column (``key=``, DESIGN §21): a transaction then also removes the rows its new files'
        keys supersede (a MERGE by key)."""

    def merge_parts(self, files: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
        """A keyed job's transaction descriptors split into its data files and the keys its failures remove (an
        Arrow array of the key column's type; empty: none)."""
        import pyarrow as pa

        assert self.merge_key is not None
        data = [f for f in files if TOMBSTONES not in f]
        dropped = [key for f in files if TOMBSTONES in f for key in f[TOMBSTONES]]
        return data, pa.array(dropped, self.arrow_schema().field(self.merge_key).type)

    @abstractmethod
    def arrow_schema(self) -> Any:
        """The table's schema as Arrow types (normalized like :func:`normalize_schema`), ``None`` before it exists."""

    def check_readable(self) -> bool:
        """Reads the table's schema when the table exists (before any work): a table its format's library cannot
        read (metadata damaged or cut short) is an :class:`InvalidArgumentError` naming it and what to do, not the
        library's own error (delta-rs: ``Kernel error: Json error: ...`` and a backtrace, naming no table).
        Returns whether the table exists."""
        from torch_batch_process.errors import BatchProcessError

        try:
            exists = self.exists()
            if exists:
                self.arrow_schema()
            return exists
        except BatchProcessError:
            raise
        except Exception as exc:  # noqa: BLE001 - any of the format library's errors
            message = (str(exc).strip().splitlines() or [""])[0]
            raise InvalidArgumentError(
                f"{self.target.describe_short()} cannot be read ({type(exc).__name__}: {message}); if its metadata "
                "is damaged, restore it from a backup, or write to another table"
            ) from exc

    @abstractmethod
    def exists(self) -> bool:
        """Whether the table exists."""

    @abstractmethod
    def ensure(self, schema: Any) -> Any:
        """Creates the table with ``schema`` (Arrow, normalized) unless it exists; returns its schema (normalized)."""

    @abstractmethod
    def open_file(self, name: str, schema: Any, stage: int) -> DataFileWriter:
        """A new data file of the table for rows of ``stage``, named ``name`` (see :func:`data_file_name`), not yet
        part of the table."""

    @abstractmethod
    def committed_key(self, job_id: str) -> int:
        """The newest idempotency key (commit record number) of job ``job_id`` that the table holds; 0: none."""

    @abstractmethod
    def commit(self, files: list[dict[str, Any]], schema: Any, job_id: str, key: int) -> None:
        """One transaction that adds ``files`` (creating the table with ``schema`` if it does not exist) and
        records ``key`` for ``job_id`` in the table's own metadata, atomically with the files."""

    @abstractmethod
    def remove_orphans(self, job_id: str, committed: Callable[[int], bool]) -> int:
        """Deletes job ``job_id``'s data files whose stage is not ``committed`` (written by a killed attempt and never
        part of the table); returns how many."""

    @abstractmethod
    def compact(self) -> None:
        """Merges small data files with the format's own tools (a transaction of its own; rows unchanged)."""

    @abstractmethod
    def live_files(self) -> int:
        """The data files of the table's current version."""

    @abstractmethod
    def batches(self, columns: list[str] | None, low: int | None, high: int | None) -> Iterator[Any]:
        """The table's rows (``columns``, ``None``: all) with ``low <= index < high`` (``None``: unbounded), as
        Arrow record batches in no particular order."""

    def check_schema(self, schema: Any, origin: str) -> None:
        """Raises :class:`SchemaConflictError` when rows of ``schema`` do not fit the existing table."""
        existing = self.arrow_schema()
        if existing is None or _same_types(existing, schema):
            return
        raise SchemaConflictError(
            f"context.write(): {origin} wrote the columns {_describe(schema)}, but {self.target.describe_short()} has "
            f"{_describe(existing)}; write the table's columns with its types, or write to another table"
        )


def _same_types(a: Any, b: Any) -> bool:
    if sorted(a.names) != sorted(b.names):
        return False
    return all(a.field(name).type.equals(b.field(name).type) for name in a.names)


def _describe(schema: Any) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema if f.name != INDEX_COLUMN) or "(none)"


class TableTarget(ABC):
    """Where ``context.write()`` rows go: a table of one format (see the module docstring).

    Attributes:
        compact: whether a finished job compacts the table's small files (the format's own tools).
        commit_interval_s: the least time between two table transactions (job commits in between are added by one).
    """

    kind: str = ""
    compact: bool = True
    commit_interval_s: float = 1.0

    @abstractmethod
    def check(self) -> None:
        """Raises :class:`InvalidArgumentError` when the target cannot be used (before any work)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What identifies the table in the job's fingerprint (no credentials)."""

    @abstractmethod
    def open(self, merge_key: str | None = None) -> Table:
        """The opened table (``merge_key``: a keyed job's key column, whose new rows replace their keys' rows)."""

    def name_problem(self, name: str) -> str | None:
        """Why the format cannot hold a column named ``name``; ``None`` when it can."""
        return None

    def describe_short(self) -> str:
        """The table in messages."""
        where = self.describe()
        return f"the {self.kind} table {where.get('uri') or where.get('identifier')!r}"
