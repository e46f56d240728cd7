"""The incremental planner: which examples of a dataset a rerun processes, in memory bounded by a partition.

An incremental run (DESIGN §21) compares the dataset with what the job's outputs hold:

- the dataset gives, in index order, each example's key and content hash
  (:meth:`~torch_batch_process.outputs.keyed.keys.KeySpec.key_batch`, or a source's columns);
- the outputs give their *events*: every stored row (key, content hash, the run that wrote it, that run's
  fingerprint digest: its *version*), every failure record of a keyed example (key, run, ``failed``) and every key
  a finished run removed (``prune_missing=True``: key, run, ``removed``). A key's newest event (highest run) is its
  state; older ones are shadowed (a changed example's earlier row). A key whose newest event is a removal has no
  row: it is ``new`` if the dataset has it again.

Every example is then one of:

=============  =========================================================================  ==========
reason         when                                                                       processed
=============  =========================================================================  ==========
``new``        its key has no event                                                       yes
``failed``     its key's newest event is a failure                                        yes
``changed``    its key's newest row has another content hash                              yes
``recompute``  same hash, but the row's version is not the run's (``on_change=            yes
               "recompute"``; with ``"refuse"``, such rows raise before anything is read
               from the dataset)
``unchanged``  same hash and version                                                      no
=============  =========================================================================  ==========

and a stored key whose newest event is a row and that the dataset lacks is ``removed`` (reported, and deleted
from a table when the user asks).

**Bounded memory.** Neither side is held whole: the stored events are spilled to local files by a hash of the key
(:class:`~torch_batch_process.outputs.keyed.partitions.KeyPartitions`), each partition is reduced to its newest
event per key (and the versions are counted, so that ``on_change="refuse"`` refuses before the dataset is read),
then the dataset's keys are spilled the same way and each partition is compared with numpy (sorted keys,
``searchsorted``; string keys are first given exact integer codes by Arrow's dictionary encoding). What is held at
once is one partition of both sides (``rows_per_partition`` rows in all) and the result, one bit per example
(:class:`~torch_batch_process.outputs.keyed.selection.Selection`). Duplicate keys in the dataset are refused naming
the key and both indices (they meet in one partition).

Figures: ``python -m benchmarks.incremental`` (10**5..10**7 keys; time and peak RSS).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torch_batch_process.errors import InvalidArgumentError, JobMismatchError
from torch_batch_process.outputs.columns import require_pyarrow
from torch_batch_process.outputs.keyed.keys import HASH_COLUMN, KEY_COLUMN
from torch_batch_process.outputs.keyed.partitions import KeyPartitions, key_kind, partition_count, spill_error
from torch_batch_process.outputs.keyed.selection import Selection
from torch_batch_process.storage.scratch import process_folder

__all__ = [
    "ON_CHANGE",
    "REASONS",
    "DuplicateKeyError",
    "Increment",
    "IncrementCounts",
    "VersionChangedError",
    "plan_increment",
]

logger = logging.getLogger(__name__)

ON_CHANGE = ("recompute", "refuse")
"""What a run does with stored rows of another version (fingerprint): compute them again, or refuse to run."""

REASONS = ("unchanged", "new", "changed", "failed", "recompute")
"""The reason codes of the planner, in code order."""
_UNCHANGED, _NEW, _CHANGED, _FAILED, _RECOMPUTE = range(len(REASONS))

ROWS_PER_PARTITION = 1 << 21
"""Rows of both sides together per partition, on average: about 150-300 MB of memory while one is compared
(``python -m benchmarks.incremental``: 272 MiB peak at 10**7 int keys, 365 MiB with string keys)."""


class DuplicateKeyError(InvalidArgumentError):
    """Two examples of the dataset have the same key."""


class VersionChangedError(JobMismatchError):
    """The outputs hold rows of another version (fingerprint) and the run was told to refuse."""


@dataclass
class IncrementCounts:
    """What the planner found (for ``tbp status`` and the report)."""

    total: int = 0
    """Examples in the dataset."""
    new: int = 0
    changed: int = 0
    failed: int = 0
    """Examples whose key failed before, processed again."""
    recompute: int = 0
    """Unchanged examples whose stored row has another version, processed again (``on_change="recompute"``)."""
    unchanged: int = 0
    removed: int = 0
    """Stored keys (with a row) that the dataset lacks."""
    stored: int = 0
    """Stored keys whose newest event is a row."""
    stored_failed: int = 0
    """Stored keys whose newest event is a failure."""
    shadowed: int = 0
    """Stored events older than their key's newest one (superseded rows)."""
    duplicates: int = 0
    """Stored events of a key repeated by one run (never written by the library; kept once)."""

    @property
    def selected(self) -> int:
        """Examples the run processes."""
        return self.new + self.changed + self.failed + self.recompute

    def to_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {"selected": self.selected}


@dataclass
class Increment:
    """The planner's answer: the examples to process, the counts, the removed keys and the stored versions."""

    selection: Selection
    counts: IncrementCounts
    removed: Path | None = None
    """An Arrow IPC stream of the removed keys (column ``key``), when asked for (``removed_to``)."""
    retried: Path | None = None
    """An Arrow IPC stream of the examples selected because their key failed before (columns ``key`` and ``index``,
    in no order), when asked for (``retried_to``): which failures the run may clear (``tbp failures``)."""
    versions: dict[str, int] = field(default_factory=dict)
    """Version -> the stored keys whose newest row has it."""


def plan_increment(
    new: Iterable[Any],
    stored: Iterable[Any],
    *,
    new_rows: int,
    stored_rows: int,
    version: str,
    on_change: str = "refuse",
    scratch: str | Path | None = None,
    rows_per_partition: int = ROWS_PER_PARTITION,
    removed_to: str | Path | None = None,
    retried_to: str | Path | None = None,
    describe_version: Callable[[str], str] | None = None,
) -> Increment:
    """Plans an incremental run (see the module docstring).

    Args:
        new: the dataset's keys and content hashes, in index order: ``pyarrow.RecordBatch``\\ es with columns
            ``key`` (ints or strings) and ``hash`` (int64).
        stored: the outputs' events: record batches with columns ``key``, ``hash`` (int64; null for a failure),
            ``run`` (int), ``version`` (string), ``failed`` (bool) and, optionally, ``removed`` (bool).
        new_rows: the number of examples of the dataset (the rows ``new`` gives).
        stored_rows: about how many events ``stored`` gives (it sizes the partitions).
        version: the run's version (fingerprint digest).
        on_change: ``"recompute"`` or ``"refuse"`` (rows of another version; see the module docstring).
        scratch: a local folder for the partition files (default: the system's temporary folder); a folder of
            this call is made in it and removed before returning.
        rows_per_partition: rows of both sides per partition (memory; see the module docstring).
        removed_to: where to write the removed keys (an Arrow IPC stream); ``None``: only counted.
        retried_to: where to write the key and index of each ``failed`` example (an Arrow IPC stream, written even
            when there is none); ``None``: only counted.
        describe_version: how to name a version in the refusal (e.g. the fingerprint keys that differ).

    Raises:
        DuplicateKeyError: two examples have the same key.
        VersionChangedError: ``on_change="refuse"`` and stored rows have another version (before ``new`` is read).
        InvalidArgumentError: a null key, keys of two types, or keys of another type than the stored ones.
    """
    if on_change not in ON_CHANGE:
        raise InvalidArgumentError(f"on_change must be one of {list(ON_CHANGE)}, got {on_change!r}")
    partitions = partition_count(new_rows + stored_rows, rows_per_partition)
    folder = process_folder("plan", scratch)  # a kill leaves it to the next process
    try:
        planner = _Planner(folder, partitions, version, on_change)
        planner.spill_stored(stored)
        versions = planner.reduce_stored()
        stale = {v: n for v, n in versions.items() if v != version}
        if stale and on_change == "refuse":
            raise VersionChangedError(_refusal(version, stale, describe_version))
        planner.spill_new(new, new_rows)
        increment = planner.compare(new_rows, removed_to, retried_to)
        increment.versions = versions
        return increment
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _refusal(version: str, stale: dict[str, int], describe: Callable[[str], str] | None) -> str:
    named = "; ".join(
        f"{rows} key(s) of version {v}" + (f" ({describe(v)})" if describe is not None else "")
        for v, rows in sorted(stale.items(), key=lambda item: -item[1])
    )
    return (
        f"the outputs hold rows computed by another version than this run's ({version}): {named}. Nothing was "
        "processed nor changed. To compute them again with this version, pass on_change='recompute'; to keep "
        "them, run with the version that wrote them"
    )


class _Planner:
    """The steps of :func:`plan_increment`, sharing the partition files and the key type."""

    def __init__(self, folder: Path, partitions: int, version: str, on_change: str) -> None:
        self.folder = folder
        self.partitions = partitions
        self.version = version
        self.recompute = on_change == "recompute"
        self.kind: str | None = None  # "int" or "str", fixed by the first keys seen
        self._kind_of = ""  # the side whose keys fixed it
        self.version_codes: dict[str, int] = {}
        self.counts = IncrementCounts()
        self.stored: KeyPartitions | None = None
        self.winners: KeyPartitions | None = None
        self.new: KeyPartitions | None = None

    # ------------------------------------------------------------ the stored side

    def _keys(self, column: Any, what: str, first_index: int | None = None) -> Any:
        """A key column normalized (int64 or large_string), after checking its type and nulls."""
        pa = require_pyarrow()
        kind = key_kind(column.type)
        if self.kind is None:
            self.kind, self._kind_of = kind, what
        elif kind != self.kind:
            theirs = f"{self._kind_of} have" if self._kind_of != what else "its earlier rows have"
            raise InvalidArgumentError(
                f"key: {what} has {kind} keys, but {theirs} {self.kind} keys; a job's keys keep one type (cast them "
                "in the key function)"
            )
        if column.null_count:
            nulls = np.flatnonzero(_np(column.is_null()))
            where = f"example {first_index + int(nulls[0])}" if first_index is not None else "a stored row"
            raise InvalidArgumentError(f"key: {where} of {what} has no key (None); every example needs one")
        return column.cast(pa.int64() if kind == "int" else pa.large_string())

    def _codes(self, versions: Any) -> np.ndarray:
        """Stored version strings as small ints (codes of :attr:`version_codes`)."""
        import pyarrow.compute as pc

        encoded = pc.dictionary_encode(versions.fill_null(""))
        mapping = np.array(
            [self.version_codes.setdefault(v, len(self.version_codes)) for v in encoded.dictionary.to_pylist()],
            np.int32,
        )
        return mapping[_np(encoded.indices)] if len(mapping) else np.zeros(0, np.int32)

    def spill_stored(self, stored: Iterable[Any]) -> None:
        pa = require_pyarrow()
        self.stored = KeyPartitions(self.folder, "stored", self.partitions)
        for batch in stored:
            if batch.num_rows == 0:
                continue
            failed = batch.column("failed").fill_null(False)
            removed = (
                batch.column("removed").fill_null(False) if "removed" in batch.schema.names
                else pa.array(np.zeros(len(failed), bool))
            )
            self.stored.add(pa.record_batch(
                [
                    self._keys(batch.column("key"), "the stored outputs"),
                    batch.column("hash").cast(pa.int64()).fill_null(0),
                    batch.column("run").cast(pa.int32()),
                    pa.array(self._codes(batch.column("version").cast(pa.string())), pa.int32()),
                    failed,
                    removed,
                ],
                names=[KEY_COLUMN, HASH_COLUMN, "run", "version", "failed", "removed"],
            ))
        self.stored.close()

    def reduce_stored(self) -> dict[str, int]:
        """Keeps each stored key's newest event (rewriting the partitions); returns version -> keys whose newest
        event is a row of that version."""
        assert self.stored is not None
        import pyarrow.compute as pc

        pa = require_pyarrow()
        self.winners = KeyPartitions(self.folder, "winners", self.partitions)
        per_version = np.zeros(len(self.version_codes), np.int64)
        for p in range(self.partitions):
            table = self.stored.read(p)
            if table is None:
                continue
            codes = _exact_codes(table.column(KEY_COLUMN), self.kind)
            runs = _np(table.column("run"))
            order = np.lexsort((-runs.astype(np.int64), codes))  # by key, newest run first
            ordered_codes, ordered_runs = codes[order], runs[order]
            first = np.ones(len(order), bool)
            first[1:] = ordered_codes[1:] != ordered_codes[:-1]
            newest_run = ordered_runs[np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))]
            repeated = int((~first & (ordered_runs == newest_run)).sum())
            self.counts.duplicates += repeated
            self.counts.shadowed += int((~first).sum()) - repeated
            winners = table.take(pa.array(order[first]))
            winners = winners.filter(pc.invert(winners.column("removed")))  # a removed key has no row: absent
            failed = _np(winners.column("failed"))
            self.counts.stored += int((~failed).sum())
            self.counts.stored_failed += int(failed.sum())
            per_version += np.bincount(_np(winners.column("version"))[~failed], minlength=len(per_version))
            self.winners.write(p, winners)
            self.stored.remove(p)
        self.winners.close()
        names = {code: v for v, code in self.version_codes.items()}
        return {names[c]: int(n) for c, n in enumerate(per_version.tolist()) if n}

    # ------------------------------------------------------------ the dataset

    def spill_new(self, new: Iterable[Any], new_rows: int) -> None:
        pa = require_pyarrow()
        self.new = KeyPartitions(self.folder, "new", self.partitions)
        index = 0
        for batch in new:
            n = batch.num_rows
            if n == 0:
                continue
            self.new.add(pa.record_batch(
                [
                    self._keys(batch.column("key"), "the dataset", index),
                    batch.column("hash").cast(pa.int64()).fill_null(0),
                    pa.array(np.arange(index, index + n, dtype=np.int64)),
                ],
                names=[KEY_COLUMN, HASH_COLUMN, "index"],
            ))
            index += n
        self.new.close()
        if index != new_rows:
            raise InvalidArgumentError(f"the dataset gave {index} keys, but it has {new_rows} examples")

    # ------------------------------------------------------------ comparing

    def compare(self, new_rows: int, removed_to: str | Path | None, retried_to: str | Path | None = None) -> Increment:
        assert self.new is not None and self.winners is not None
        pa = require_pyarrow()
        selection = Selection(new_rows)
        counts = self.counts
        counts.total = new_rows
        removed_writer = None
        retried: list[Any] = []  # (key, index) of the failed examples: few (failures), held until the end
        for p in range(self.partitions):
            new = self.new.read(p)
            stored = self.winners.read(p)
            if new is None and stored is None:
                continue
            n = 0 if new is None else new.num_rows
            keys = [t.column(KEY_COLUMN) for t in (new, stored) if t is not None]
            codes = _exact_codes(pa.chunked_array([c for k in keys for c in k.chunks], keys[0].type), self.kind)
            new_codes, stored_codes = codes[:n], codes[n:]
            if new is not None:
                _refuse_duplicates(new, new_codes)
            reasons, matched_stored = _classify(new, new_codes, stored, stored_codes, self.version_codes,
                                                self.version, self.recompute)
            if new is not None:
                tally = np.bincount(reasons, minlength=len(REASONS))
                counts.unchanged += int(tally[_UNCHANGED])
                counts.new += int(tally[_NEW])
                counts.changed += int(tally[_CHANGED])
                counts.failed += int(tally[_FAILED])
                counts.recompute += int(tally[_RECOMPUTE])
                selection.add(_np(new.column("index"))[reasons != _UNCHANGED])
                if retried_to is not None and (reasons == _FAILED).any():
                    retried.append(new.select([KEY_COLUMN, "index"]).filter(pa.array(reasons == _FAILED)))
            if stored is not None:
                gone = ~matched_stored & ~_np(stored.column("failed"))
                counts.removed += int(gone.sum())
                if removed_to is not None and gone.any():
                    keys_gone = stored.column(KEY_COLUMN).filter(pa.array(gone))
                    try:
                        if removed_writer is None:
                            schema = pa.schema([(KEY_COLUMN, keys_gone.type)])
                            removed_writer = pa.ipc.new_stream(str(removed_to), schema)
                        removed_writer.write_table(pa.table({KEY_COLUMN: keys_gone}))
                    except OSError as exc:  # e.g. a full disk: pyarrow's error names no file
                        raise spill_error(removed_to, exc) from exc
            self.new.remove(p)
            self.winners.remove(p)
        if removed_writer is not None and removed_to is not None:
            try:
                removed_writer.close()
            except OSError as exc:
                raise spill_error(removed_to, exc) from exc
        if retried_to is not None:
            self._write_retried(retried, retried_to)
        return Increment(
            selection, counts, Path(removed_to) if removed_writer is not None else None,
            retried=Path(retried_to) if retried_to is not None else None,
        )

    def _write_retried(self, tables: list[Any], path: str | Path) -> None:
        """Writes the failed examples' keys and indices (:attr:`Increment.retried`), an empty stream when none."""
        pa = require_pyarrow()
        kind = pa.large_string() if self.kind == "str" else pa.int64()
        schema = pa.schema([(KEY_COLUMN, kind), ("index", pa.int64())])
        try:
            with pa.ipc.new_stream(str(path), schema) as writer:
                for table in tables:
                    writer.write_table(table.cast(schema))
        except OSError as exc:  # e.g. a full disk: pyarrow's error names no file
            raise spill_error(path, exc) from exc


def _np(column: Any) -> np.ndarray:
    """An Arrow column (array or chunked) as a numpy array."""
    return np.asarray(column.to_numpy() if hasattr(column, "num_chunks") else column.to_numpy(zero_copy_only=False))


def _exact_codes(keys: Any, kind: str | None) -> np.ndarray:
    """An int64 code per key, equal exactly when the keys are: the key itself for ints, a dictionary code for
    strings (Arrow's dictionary encoding, exact: no hash collision can make two keys one). A chunked array is
    encoded with one dictionary for all its chunks (Arrow unifies it), without joining the chunks first."""
    import pyarrow.compute as pc

    pa = require_pyarrow()
    if kind == "int":
        return _np(keys).astype(np.int64, copy=False)
    encoded = pc.dictionary_encode(keys)
    chunks = encoded.chunks if isinstance(encoded, pa.ChunkedArray) else [encoded]
    if any(len(chunk.dictionary) != len(chunks[0].dictionary) for chunk in chunks):  # not one dictionary: join first
        return _exact_codes(keys.combine_chunks(), kind)
    return np.concatenate([_np(chunk.indices).astype(np.int64) for chunk in chunks] or [np.zeros(0, np.int64)])


def _refuse_duplicates(new: Any, codes: np.ndarray) -> None:
    order = np.argsort(codes, kind="stable")
    ordered = codes[order]
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(same) == 0:
        return
    indices = _np(new.column("index"))
    first, second = sorted((int(indices[order[same[0]]]), int(indices[order[same[0] + 1]])))
    key = new.column(KEY_COLUMN)[int(order[same[0]])].as_py()
    raise DuplicateKeyError(
        f"key: examples {first} and {second} have the same key {key!r}; every example of a keyed job needs its "
        "own key (deduplicate the dataset, or make the key unique, e.g. key=lambda example: f\"{example['doc']}"
        "/{example['chunk']}\")"
    )


def _classify(
    new: Any, new_codes: np.ndarray, stored: Any, stored_codes: np.ndarray, version_codes: dict[str, int],
    version: str, recompute: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """The reason of each new example, and which stored keys the dataset has."""
    n_stored = len(stored_codes)
    matched_stored = np.zeros(n_stored, bool)
    if new is None:
        return np.zeros(0, np.int64), matched_stored
    reasons = np.full(len(new_codes), _NEW, np.int64)
    if n_stored == 0:
        return reasons, matched_stored
    order = np.argsort(stored_codes, kind="stable")
    ordered = stored_codes[order]
    position = np.minimum(np.searchsorted(ordered, new_codes), n_stored - 1)
    matched = ordered[position] == new_codes
    at = order[position[matched]]  # the stored winner of each matched example
    matched_stored[at] = True
    failed = _np(stored.column("failed"))[at]
    changed = _np(stored.column(HASH_COLUMN))[at] != _np(new.column(HASH_COLUMN))[matched]
    current = version_codes.get(version, -1)
    stale = _np(stored.column("version"))[at] != current
    reason = np.where(failed, _FAILED, np.where(changed, _CHANGED, np.where(stale & recompute, _RECOMPUTE, _UNCHANGED)))
    reasons[matched] = reason
    return reasons, matched_stored
