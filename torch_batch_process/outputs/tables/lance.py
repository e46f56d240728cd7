"""Lance datasets (``pylance``): :func:`lance` and :class:`LanceTableOutput`.

Ranks write their rows as Lance fragments (``lance.fragment.write_fragments``, one call per row group of the
rank's writer) that no version of the dataset references yet; a transaction appends them
(``LanceDataset.commit`` of a ``Transaction`` with an ``Append`` operation) whose *transaction properties* carry
the job's idempotency key (``tbp.job``, ``tbp.commit``); the next start reads it back from the versions'
transactions (``LanceDataset.read_transaction``), newest first. Fixed-shape tensors stay fixed-size lists, so
``create_index`` can build a vector index on them. Compaction is ``dataset.optimize.compact_files()``.

Lance names its data files itself, so the fragments of a stage that was never committed (a killed attempt) cannot
be told from another writer's files in flight: they are left for Lance's own clean-up
(``dataset.cleanup_old_versions()`` deletes unreferenced files once they are a few days old). No version of the
dataset ever references them, so no reader sees their rows.

Lance is not fork-safe (importing it registers a warning at every ``fork``, and its runtime starts threads), and a
job forks its ``DataLoader`` workers when its first batch loads, after the checks and the job's opening. So for a
new local dataset (the path does not exist yet) nothing here imports Lance before the rows are written, after the
workers started: the check only finds the package. A resume into an existing dataset, or a dataset on an object
store, reads it at the start (its schema, the job's idempotency key), so the loader's workers are then forked from
a process that loaded Lance; pass ``dataloader_kwargs={"multiprocessing_context": "spawn"}`` to avoid that (the
script needs its ``if __name__ == "__main__":`` guard; each worker then starts a fresh interpreter: measured ~20 s
more to the first batch than ``fork`` for the embeddings example on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import logging
import os
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
    normalize_schema,
    require,
)
from torch_batch_process.storage.errors import file_error
from torch_batch_process.storage.urls import check_storage_url

__all__ = ["LanceTableOutput", "lance"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LanceTableOutput(TableTarget):
    """A Lance dataset as the target of ``context.write()`` rows (see :func:`lance`)."""

    uri: str
    storage_options: dict[str, str] | None = field(default=None, compare=False, repr=False)
    compact: bool = True
    commit_interval_s: float = 1.0
    kind = "lance"

    def check(self) -> None:
        require("lance", "lance", "tables.lance(...)", load=False)  # loaded where rows are written (module docstring)
        table = self.open()
        table.check_readable()  # a table its library cannot read: an error now, not after the first batch

    def describe(self) -> dict[str, Any]:
        return {"format": "lance", "uri": self.uri}

    def open(self, merge_key: str | None = None) -> LanceTable:
        return LanceTable(self, merge_key)

    def name_problem(self, name: str) -> str | None:
        if "." in name or "`" in name:  # Lance refused them in write_fragments, after the batch ran
            return "Lance reads '.' and '`' in a top-level column name as a path to a nested field"
        return None


def lance(
    uri: str | os.PathLike[str],
    *,
    storage_options: dict[str, str] | None = None,
    compact: bool = True,
    commit_interval_s: float = 1.0,
) -> LanceTableOutput:
    """A Lance dataset as the target of ``context.write()`` rows: ``torch_batch_process(..., table=lance(uri))``.

    Args:
        uri: the dataset: a local path or an object-store URI; created at the first rows if it does not exist, else
            appended to (its columns must match).
        storage_options: Lance's object-store options (``aws_endpoint``, ``allow_http``...; default: the
            environment).
        commit_interval_s: the least time between two table transactions: the job's commits in between are added by
            one (at most one transaction per commit; the closing and final commits never wait).
        compact: compact the dataset's fragments when the job finishes (``dataset.optimize.compact_files()``).
    """
    if not isinstance(uri, (str, os.PathLike)) or not os.fspath(uri).strip():
        raise InvalidArgumentError(f"tables.lance(uri): uri must be a non-empty path or URI, got {uri!r}")
    interval = check_options(f"tables.lance({uri!r})", compact, commit_interval_s)
    text = check_storage_url(uri, "tables.lance(uri)", fsspec_protocols=False)  # s3:/b would be a local folder
    if "://" not in text:
        text = os.path.abspath(text)
    return LanceTableOutput(text, check_storage_options(storage_options, f"tables.lance({text!r})"), compact, interval)


class LanceTable(Table):
    """An opened Lance dataset (see the module docstring)."""

    fixed_lists = True

    def __init__(self, target: LanceTableOutput, merge_key: str | None = None) -> None:
        super().__init__(target, merge_key)
        self._target = target

    def _load(self) -> Any:
        if "://" not in self._target.uri and not os.path.exists(self._target.uri):
            return None  # no dataset yet, and Lance not loaded for it (see the module docstring)
        import lance

        try:
            return lance.dataset(self._target.uri, storage_options=self._target.storage_options)
        except (FileNotFoundError, ValueError) as exc:  # no dataset there (yet)
            if isinstance(exc, FileNotFoundError) or "not found" in str(exc).lower():
                return None
            raise

    def exists(self) -> bool:
        return self._load() is not None

    def arrow_schema(self) -> Any:
        dataset = self._load()
        if dataset is None:
            return None
        return normalize_schema(dataset.schema, fixed_lists=True, what="a Lance dataset", origin=self._target.uri)

    def ensure(self, schema: Any) -> Any:
        import lance

        if not self.exists():
            try:
                lance.write_dataset(schema.empty_table(), self._target.uri, mode="create",
                                    storage_options=self._target.storage_options)
            except Exception:  # another rank created it at the same moment: its schema decides
                if not self.exists():
                    raise
        return self.arrow_schema()

    def open_file(self, name: str, schema: Any, stage: int) -> DataFileWriter:
        return _Fragments(self._target, schema, stage)

    def committed_key(self, job_id: str) -> int:
        dataset = self._load()
        if dataset is None:
            return 0
        for version in sorted((v["version"] for v in dataset.versions()), reverse=True):
            try:
                transaction = dataset.read_transaction(version)
            except Exception:  # noqa: BLE001 - a version cleaned up: older ones say nothing newer
                break
            properties = (transaction.transaction_properties or {}) if transaction is not None else {}
            if properties.get("tbp.job") == job_id:
                return int(properties["tbp.commit"])
        return 0

    def commit(self, files: list[dict[str, Any]], schema: Any, job_id: str, key: int) -> None:
        import lance
        from lance.fragment import FragmentMetadata

        self.ensure(schema)
        dataset = self._load()
        dropped = None
        if self.merge_key is not None:  # a keyed job: its failures' keys (tombstones) leave the table too (§21)
            files, dropped = self.merge_parts(files)
        fragments = [FragmentMetadata.from_json(json.dumps(f["fragment"])) for f in files]
        operation: Any = lance.LanceOperation.Append(fragments)
        if dropped is not None:  # a keyed job: the new rows replace their keys' rows (§21)
            removed, updated = self._superseded(dataset, fragments, dropped)
            if removed or updated:
                operation = lance.LanceOperation.Update(
                    removed_fragment_ids=removed, updated_fragments=updated, new_fragments=fragments
                )
        transaction = lance.Transaction(
            read_version=dataset.version,
            operation=operation,
            transaction_properties={"tbp.job": job_id, "tbp.commit": str(key)},
        )
        lance.LanceDataset.commit(self._target.uri, transaction, storage_options=self._target.storage_options)

    def _superseded(self, dataset: Any, fragments: list[Any], dropped: Any) -> tuple[list[int], list[Any]]:
        """The MERGE by key of a keyed job, in the transaction that appends ``fragments`` (an ``Update``
        operation): every fragment of the dataset holding one of their keys or of ``dropped`` (failed keys) gets a
        deletion file for those rows (``LanceFragment.delete``, uncommitted until the transaction), or is removed when
        none of its rows is left.
        Returns the removed fragment ids and the updated fragments. Computed from the dataset version the
        transaction reads, so a replay of an uncommitted transaction (the job's next start) computes the same; the
        deletion files of a killed attempt are never referenced (Lance's clean-up removes them)."""
        import pyarrow.compute as pc
        from lance.file import LanceFileReader

        column = self.merge_key
        assert column is not None
        root = self._target.uri.rstrip("/")
        keys = pc.unique(concat_keys([
            LanceFileReader(f"{root}/data/{data.path}", self._target.storage_options, columns=[column])
            .read_all().to_table().column(column)
            for fragment in fragments for data in fragment.files
        ] + [dropped]))
        removed: list[int] = []
        updated: list[Any] = []
        if not len(keys):
            return removed, updated
        for fragment in dataset.get_fragments():
            stored = fragment.to_table(columns=[column]).column(column)
            hit = pc.is_in(stored, value_set=keys)
            found = pc.sum(hit).as_py() or 0
            if not found:
                continue
            if found == len(stored):
                removed.append(fragment.fragment_id)
                continue
            doomed = ", ".join(map(_literal, pc.filter(stored, hit).to_pylist()))
            metadata = fragment.delete(f"{_quote(column)} IN ({doomed})")
            if metadata is None:
                removed.append(fragment.fragment_id)
            else:
                updated.append(metadata)
        return removed, updated

    def remove_orphans(self, job_id: str, committed: Callable[[int], bool]) -> int:
        return 0  # see the module docstring: Lance's own clean-up removes them

    def compact(self) -> None:
        dataset = self._load()
        if dataset is not None:
            dataset.optimize.compact_files()

    def live_files(self) -> int:
        dataset = self._load()
        return 0 if dataset is None else sum(len(f.data_files()) for f in dataset.get_fragments())

    def batches(self, columns: list[str] | None, low: int | None, high: int | None) -> Iterator[Any]:
        dataset = self._load()
        if dataset is None:
            return iter(())
        bounds = [f"index >= {int(low)}"] if low is not None else []
        bounds += [f"index < {int(high)}"] if high is not None else []
        return iter(dataset.to_batches(columns=columns, filter=" AND ".join(bounds) or None))


def _quote(column: str) -> str:
    """A column name in a Lance SQL predicate."""
    return "`" + column.replace("`", "``") + "`"


def _literal(key: Any) -> str:
    """A key (int or str) as a Lance SQL literal."""
    return str(int(key)) if isinstance(key, int) else "'" + str(key).replace("'", "''") + "'"


class _Fragments(DataFileWriter):
    """A rank's shard as Lance fragments: each row group written becomes fragments of the dataset (unreferenced
    until the table commit)."""

    def __init__(self, target: LanceTableOutput, schema: Any, stage: int) -> None:
        self._target = target
        self._schema = schema
        self._stage = stage
        self._written: list[dict[str, Any]] = []

    def write_table(self, table: Any, row_group_size: int | None = None) -> None:
        from lance.fragment import write_fragments

        try:
            fragments = write_fragments(table, self._target.uri, schema=self._schema,
                                        storage_options=self._target.storage_options)
        except OSError as exc:  # Lance's IO error (a full disk...): a StorageError naming the table
            raise file_error(self._target.uri, "write rows (fragments) to the Lance table", exc) from exc
        for fragment in fragments:
            self._written.append({"fragment": fragment.to_json(), "rows": fragment.physical_rows,
                                  "stage": self._stage})

    def close(self) -> list[dict[str, Any]]:
        written, self._written = self._written, []
        return written
