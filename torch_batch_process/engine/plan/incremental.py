"""``incremental=True``: a keyed job's next run processes only the new, changed or failed examples (DESIGN §21).

A keyed job (``key=``) stores each row with its key, content hash, version and run
(:mod:`torch_batch_process.outputs.keyed.options`). Once the job is finished, a call with ``incremental=True``
over a grown or changed dataset plans a *run*: rank 0, before any rank writes, reads the newest stored row of every
key (``iter_outputs`` of the key columns: it shadows superseded rows, in bounded memory) and the keys that failed,
hashes every example of the dataset, and selects the
examples whose key is new, whose content hash changed, or whose stored row has another version
(``on_change="recompute"``; ``"refuse"``, the default, raises :class:`VersionChangedError` naming the stored and
the current ``version=`` before the dataset is read): :func:`~torch_batch_process.outputs.keyed.diff.plan_increment`.
A key whose newest event is a failure (its records name their key) is selected again (``failed``).

The run is a job of its own stored like a ``retry_failed`` run, in ``retries/<k>/`` (so it shares the job's
numbering of batches and stages and its ``outputs/``: :mod:`torch_batch_process.jobstore.retries`; the job's
current failures are each key's newest failure over its finished runs:
:func:`~torch_batch_process.outputs.keyed.runs.current_failures`), with a :class:`SelectionPlan` over the selected
indices; its rows carry ``_tbp_run = k + 1``. The selection is stored in ``retries/<k>/_tbp/selection.bin`` with the
counts in ``increment.json`` (and the examples selected as failed before in ``retried.arrows``) before the run's
``job.json``; a resume (after a kill, on any world size) reuses them: the selection is the run's plan, fixed at its
start. A start killed before the run's ``job.json`` plans again.

Runs are sequential: a new one is planned only on a finished job whose latest run is finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.engine.plan.retry import Retry, check_same_outputs, repair_finished_folders
from torch_batch_process.errors import CORRUPT_HINT, CheckpointCorruptError, InvalidArgumentError, JobMismatchError
from torch_batch_process.jobstore.formats import qualified_name
from torch_batch_process.jobstore.layout import JOB_FILE, RETRIES_DIR
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.jobstore.retries import next_retry, retry_numbering, retry_numbers
from torch_batch_process.jobstore.store import job_finished, job_info_at, latest_record_at
from torch_batch_process.outputs.keyed.diff import plan_increment
from torch_batch_process.outputs.keyed.options import HASH_FIELD, RUN_FIELD, VERSION_FIELD, KeyedOptions
from torch_batch_process.outputs.keyed.runs import (
    INCREMENT_FILE,
    REMOVED_FILE,
    RETRIED_FILE,
    SELECTION_FILE,
    decode_removed,
    failed_keys,
    read_run_counts,
    removed_keys,
)
from torch_batch_process.outputs.keyed.selection import Selection
from torch_batch_process.sources.base import Source
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.nested import NestedStorage
from torch_batch_process.storage.registry import open_storage
from torch_batch_process.storage.scratch import process_folder

__all__ = ["RunChoice", "SelectionPlan", "choose_run", "prepare_incremental"]

if TYPE_CHECKING:
    from torch_batch_process.arguments import JobArguments
    from torch_batch_process.engine.distributed import Collectives
    from torch_batch_process.jobstore.schema import RecordSchema

logger = logging.getLogger(__name__)

KEYS_PER_CHUNK = 4096
"""Examples hashed per Arrow batch of the planning pass."""


class SelectionPlan(Plan):
    """Batches of ``batch_size`` over the selected indices of a dataset, in index order, numbered from
    ``first_batch``: batch ``first_batch + g`` holds the selected examples of ranks ``[g*B, (g+1)*B)``.

    Args:
        selection: the selected dataset indices.
        batch_size: examples per batch.
        num_batches: keep only this many batches (``None``: all).
        first_batch: the number of the first batch.
        first_stage: where the run's stage numbers start (part of the fingerprint).
    """

    def __init__(
        self, selection: Selection, batch_size: int, num_batches: int | None = None, *, first_batch: int,
        first_stage: int,
    ) -> None:
        self.selection = selection
        self.batch_size = batch_size
        self.first_batch = first_batch
        self.first_stage = first_stage
        self.selected = selection.count
        full = -(-self.selected // batch_size)
        self.num_batches = full if num_batches is None else min(num_batches, full)

    def cut(self, num_batches: int) -> SelectionPlan:
        return SelectionPlan(
            self.selection, self.batch_size, num_batches, first_batch=self.first_batch, first_stage=self.first_stage
        )

    def batch_indices(self, batch: int) -> list[int]:
        local = batch - self.first_batch
        if not 0 <= local < self.num_batches:
            raise IndexError(f"batch {batch} is not in the run's plan")
        return self.selection.take(local * self.batch_size, self.batch_size).tolist()

    def count_examples(self, batches: RangeSet) -> int:
        total = 0
        for start, stop in batches.ranges():
            start, stop = max(start - self.first_batch, 0), min(stop - self.first_batch, self.num_batches)
            if start < stop:
                total += min(stop * self.batch_size, self.selected) - start * self.batch_size
        return total

    def fingerprint(self) -> dict[str, Any]:
        return {
            "selection": self.selection.digest(), "selected": self.selected, "first_batch": self.first_batch,
            "first_stage": self.first_stage,
        }

    def describe(self) -> str:
        return (
            f"incremental run of {self.selected} selected examples (of {self.selection.size}) in {self.num_batches} "
            f"batches of {self.batch_size}"
        )


@dataclass
class RunChoice:
    """Rank 0's choice of the incremental run, sent to every rank."""

    k: int
    selection: bytes
    counts: dict[str, Any]
    schema: RecordSchema | None
    first_batch: int
    first_stage: int
    removed: bytes | None = None
    """The keys a ``prune_missing=True`` run removes (:data:`REMOVED_FILE`), ``None``: none."""


def prepare_incremental(args: JobArguments, collectives: Collectives) -> Retry | None:
    """Every rank: the incremental run to do for a keyed call (see the module docstring), or ``None`` when the call
    is the job's own run (its first start, a resume of it, or a call without ``incremental=True``). Rank 0 plans
    (:func:`choose_run`); every rank gets its answer, or raises what it raised."""
    choice = collectives.from_rank0(lambda: choose_run(args), "planning the incremental run")
    if choice is None:
        return None
    assert isinstance(choice, RunChoice) and args.keyed is not None
    folder = f"{RETRIES_DIR}/{choice.k}"
    storage = NestedStorage(open_storage(args.storage_path, args.storage_options), folder, args.storage_options)
    selection = Selection.from_bytes(choice.selection, storage.url_of(SELECTION_FILE))
    plan = SelectionPlan(selection, args.batch_size, first_batch=choice.first_batch, first_stage=choice.first_stage)
    counts = choice.counts
    logger.info(
        "incremental run %d of job '%s': %s new, %s changed, %s recomputed, %s unchanged (%s keys gone from the "
        "dataset, %s): %d example(s) to process, stored in %s", choice.k + 1, args.job_name, counts.get("new"),
        counts.get("changed"), counts.get("recompute"), counts.get("unchanged"), counts.get("removed"),
        "removed" if counts.get("pruned") else "kept", plan.selected, storage.url,
    )
    removed: list[Any] = []
    if choice.removed is not None and args.table is not None:  # the table's first transaction deletes them
        removed = decode_removed(choice.removed, storage.url_of(REMOVED_FILE)).to_pylist()
    if args.lengths is not None:  # said, not silently dropped: the selection is cut in index order
        logger.warning(
            "incremental run %d: bucket_by (and max_tokens) are not applied to a run's selection: its batches hold "
            "batch_size=%d selected examples in dataset order (on_oom='split' still splits a batch that does not fit)",
            choice.k + 1, args.batch_size,
        )
    run_args = dataclasses.replace(  # max_batches caps the run's batches per rank (the rest: the next run's)
        args, storage_path=storage.url, lengths=None, keyed=args.keyed.for_run(choice.k + 1, counts, removed),
    )
    return Retry(run_args, plan, storage, choice.schema, choice.first_stage)  # type: ignore[arg-type]


def choose_run(args: JobArguments) -> RunChoice | None:
    """Rank 0: the run to do (see :func:`prepare_incremental`): a new run planned now, or the unfinished latest one
    with its stored selection; ``None`` for the job's own run. Refuses duplicate keys before any work."""
    keyed = args.keyed
    assert keyed is not None
    storage = open_storage(args.storage_path, args.storage_options)
    try:
        if not args.resume or not storage.exists(JOB_FILE) or not job_finished(storage):
            _refuse_duplicates(args, keyed)  # the job's first run: every example is new
            return None
        if not keyed.incremental:
            return None  # the job's own fingerprint decides: its stored result, or another dataset refused
        _check_same_key(storage, keyed)
        check_same_outputs(storage, args, "incremental=True")
        k, _ = next_retry(storage)
        folder = f"{RETRIES_DIR}/{k}"
        first_batch, first_stage = retry_numbering(storage, k)
        if storage.exists(f"{folder}/{JOB_FILE}"):  # the run started: resume it with its selection
            if not storage.exists(f"{folder}/{SELECTION_FILE}"):
                raise InvalidArgumentError(
                    f"{storage.url_of(folder)} is an unfinished retry_failed=True run; finish it first (call again "
                    "with retry_failed=True and the dataset it retried), then run incrementally"
                )
            counts = read_run_counts(storage, f"{folder}/{INCREMENT_FILE}")
            _check_same_size(storage, folder, k, counts, args)
            selection = _stored_selection(storage, folder)
            removed = _read_removed(storage, folder)
            latest = latest_record_at(storage, folder)
            schema = latest.record_schema if latest is not None else _newest_schema(storage)
            return RunChoice(k, selection, counts, schema, first_batch, int(first_stage or 1), removed)
        _check_keys_stored(storage)
        for left in (REMOVED_FILE, RETRIED_FILE):  # left by a start killed before job.json: planned again
            if storage.exists(f"{folder}/{left}"):
                storage.delete(f"{folder}/{left}")
        _repair(storage, args)
        scratch = process_folder("removed")  # a kill leaves it to the next process
        try:
            removed_to = os.path.join(scratch, "removed.arrows") if keyed.prune_missing else None
            increment = _plan(storage, args, keyed, removed_to, os.path.join(scratch, "retried.arrows"))
            removed = Path(increment.removed).read_bytes() if increment.removed is not None else None
            retried = Path(increment.retried).read_bytes() if increment.retried is not None else None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        counts = increment.counts.to_json() | {"versions": increment.versions, "pruned": keyed.prune_missing}
        storage.write_bytes(f"{folder}/{SELECTION_FILE}", increment.selection.to_bytes())
        if removed is not None:  # before job.json, as the selection: a resume removes the same keys
            storage.write_bytes(f"{folder}/{REMOVED_FILE}", removed)
        if retried is not None:  # the failures the run clears (tbp failures), fixed with its selection
            storage.write_bytes(f"{folder}/{RETRIED_FILE}", retried)
        storage.write_bytes(f"{folder}/{INCREMENT_FILE}", json.dumps(counts).encode())
        return RunChoice(
            k, increment.selection.to_bytes(), counts, _newest_schema(storage), first_batch, int(first_stage or 1),
            removed,
        )
    finally:
        storage.close()


def _check_same_size(storage: Storage, folder: str, k: int, counts: dict[str, Any], args: JobArguments) -> None:
    """An unfinished run resumes with the selection made when it started, over that dataset: a dataset of another
    size is refused here, saying what to do (the run's own fingerprint would refuse it as \"another job\", offering
    resume=False, which erases every run of the job)."""
    planned, now = counts.get("total"), _dataset_rows(args)
    if isinstance(planned, int) and planned != now:
        raise JobMismatchError(
            f"incremental=True: run {k + 1} of the job at {storage.url} is unfinished (stopped, killed or failed); it "
            f"resumes with the selection made when it started, over {planned:,} examples, but this dataset has "
            f"{now:,}. Nothing was changed. Call again with the dataset it was planned over to finish it; the next "
            f"incremental run then processes what changed since (its run folder: {storage.url_of(folder)})"
        )


def _stored_selection(storage: Storage, folder: str) -> bytes:
    """The selection of the started run in ``folder``, checked against the digest its ``job.json`` stored (a
    damaged selection is a :class:`CheckpointCorruptError` naming it, not "another job": the run cannot resume
    without the selection it began with)."""
    rel = f"{folder}/{SELECTION_FILE}"
    data = storage.read_bytes(rel)
    digest = Selection.from_bytes(data, storage.url_of(rel)).digest()
    stored = (_spec(storage, folder).get("plan") or {}).get("selection")
    if stored is not None and stored != digest:
        raise CheckpointCorruptError(
            f"{storage.url_of(rel)} is not the selection the run's job file stored (digest {digest}, stored "
            f"{stored}): it is damaged. {CORRUPT_HINT}."
        )
    return data


def _read_removed(storage: Storage, folder: str) -> bytes | None:
    """The removed-keys file of the started run in ``folder`` (checked: a damaged one is named), ``None``: none."""
    rel = f"{folder}/{REMOVED_FILE}"
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        return None
    decode_removed(data, storage.url_of(rel))
    return data


def _key_batches(args: JobArguments, keyed: KeyedOptions) -> Iterator[Any]:
    """The dataset's keys and content hashes, in index order, a chunk of examples at a time. A streamed source is
    read shard after shard (its global row numbers: the plan's, :mod:`~torch_batch_process.engine.plan.streamed`),
    so memory holds one chunk of rows; a Parquet source with a named key and ``content=`` names decodes only those
    columns (the hash is the same: it reads only them)."""
    dataset = args.dataset
    if isinstance(dataset, Source):
        fields = keyed.spec.fields
        narrow = fields is not None and hasattr(dataset, "with_columns") and set(fields) <= set(dataset.columns)
        source = dataset.with_columns(fields) if narrow else dataset  # Parquet: only key and content= are decoded
        try:
            first = 0
            for shard in range(source.num_shards):
                rows = source.read(shard)
                while chunk := list(itertools.islice(rows, KEYS_PER_CHUNK)):
                    yield keyed.spec.key_batch(chunk, first)
                    first += len(chunk)
        finally:
            if narrow:  # its readers are its own (the user's source keeps its readers for the run)
                source.close()
        return
    for first in range(0, args.dataset_length, KEYS_PER_CHUNK):
        stop = min(first + KEYS_PER_CHUNK, args.dataset_length)
        yield keyed.spec.key_batch((dataset[i] for i in range(first, stop)), first)


def _dataset_rows(args: JobArguments) -> int:
    """The examples of the dataset: a streamed source's rows from its metadata, else counted (as its plan does)."""
    dataset = args.dataset
    if not isinstance(dataset, Source):
        return args.dataset_length
    return sum(
        info.num_rows if info.num_rows is not None else dataset.count_rows(shard)
        for shard, info in enumerate(dataset.shards())
    )


def _refuse_duplicates(args: JobArguments, keyed: KeyedOptions) -> None:
    """The first run's pass over the keys: two examples with one key are refused (naming it) before any work."""
    plan_increment(
        _key_batches(args, keyed), [], new_rows=_dataset_rows(args), stored_rows=0, version=keyed.digest
    )


def _check_same_key(storage: Storage, keyed: KeyedOptions) -> None:
    """The job's key must be the one it stored (another key is another identity of the rows)."""
    stored = _spec(storage, "").get("keyed")
    if not stored:
        raise InvalidArgumentError(
            f"incremental=True: the job at {storage.url} stored no keys (it ran without key=); start a keyed job "
            "(resume=False, or a new storage_path)"
        )
    now = keyed.describe()
    differ = [name for name in ("key", "content", "hash", "column") if stored.get(name) != now.get(name)]
    if differ:
        named = "; ".join(f"{name}: stored {stored.get(name)!r}, now {now.get(name)!r}" for name in differ)
        raise JobMismatchError(
            f"incremental=True: the job at {storage.url} is keyed otherwise ({named}); run it with its key and "
            "content, or start a new job (resume=False, or a new storage_path)"
        )


def _check_keys_stored(storage: Storage) -> None:
    """A keyed job stores its keys with its ``context.write()`` rows: one whose processor wrote none (Determined-style
    code whose outputs are ``upload_path()`` files) has no key stored, so a run would find every example new and
    process it again, adding its files a second time. Refused before the run is planned."""
    latest = latest_record_at(storage, "")
    stats = latest.stats if latest is not None else {}
    rows, examples = stats.get("record_rows"), stats.get("examples_committed")
    if not (isinstance(rows, int) and isinstance(examples, int)):  # a job stored before rows were counted
        return
    done = examples - int(stats.get("failed_examples") or 0)
    if rows == 0 and done > 0 and _stored_rows(storage) == 0:
        raise InvalidArgumentError(
            f"incremental=True: the keyed job at {storage.url} processed {done:,} example(s) but stored no row with "
            "context.write(), and a keyed job keeps each example's key with its row: every example would be new to "
            "this run and processed again (upload_path() files are not keyed: they would be written twice). Write "
            "each example's outputs (or the names of its files) with context.write() in process_batch, then start "
            "the job again (resume=False, or a new storage_path); or drop key= and incremental=True"
        )


def _spec(storage: Storage, folder: str) -> dict[str, Any]:
    info = job_info_at(storage, folder)  # damaged: CheckpointCorruptError naming it
    return info.spec if info is not None else {}


def _repair(storage: Storage, args: JobArguments) -> None:
    """The repairs of a finished job and of its runs (their last outputs published, ``result.json`` written), so
    that what is read is all that was committed."""
    folders = [f"{RETRIES_DIR}/{k}" for k in retry_numbers(storage)]
    repair_finished_folders(storage, ["", *(f for f in folders if job_finished(storage, f))], args.storage_options)


def _versions(storage: Storage) -> dict[str, dict[str, Any]]:
    """Version digest -> what the runs that stored it declared (:func:`_declared`)."""
    found = {}
    for folder in ["", *(f"{RETRIES_DIR}/{k}" for k in retry_numbers(storage))]:
        spec = _spec(storage, folder)
        keyed = spec.get("keyed") or {}
        if "version" in keyed:
            declared = _declared(keyed.get("version_value"), spec.get("processor"), spec.get("generation"))
            found[keyed["version"]] = declared
    return found


def _declared(version: Any, processor: Any, generation: Any) -> dict[str, Any]:
    """What a run declares of its version, by name: ``version=``, the processor, and each item of a generation
    processor's fingerprint (``sampling``, ``model``...), to name the ones that changed in a refusal."""
    return {"version": version, "processor": processor, **(generation if isinstance(generation, dict) else {})}


def _changes(stored: dict[str, Any], now: dict[str, Any]) -> str:
    """The declared items that differ, in words (``version`` alone when none does: ``autocast`` or
    ``inference_mode`` changed)."""
    names = [name for name in dict.fromkeys([*now, *stored]) if stored.get(name) != now.get(name)] or ["version"]
    return "; ".join(f"{name}: stored {stored.get(name)!r}, now {now.get(name)!r}" for name in names)


def _plan(
    storage: Storage, args: JobArguments, keyed: KeyedOptions, removed_to: str | None, retried_to: str | None = None
) -> Any:
    """Plans the run: the stored rows (newest per key) against the dataset's keys and hashes."""
    import pyarrow as pa

    from torch_batch_process.outputs.readback import iter_outputs

    column = keyed.column
    names = ["key", "hash", "run", "version", "failed"]

    def stored() -> Iterator[Any]:  # the newest row of every key, a batch at a time (bounded memory)
        if not _has_rows(storage):
            return
        columns = [column, HASH_FIELD, RUN_FIELD, VERSION_FIELD]
        # a table holds one row per key (each run's transactions MERGE by key): the table is the truth
        batches = (
            args.table.open().batches(columns, None, None) if args.table is not None
            else iter_outputs(storage.url, columns=columns, storage_options=args.storage_options)
        )
        for batch in batches:
            yield pa.record_batch(
                [batch.column(column), batch.column(HASH_FIELD), batch.column(RUN_FIELD),
                 batch.column(VERSION_FIELD), pa.array(np.zeros(batch.num_rows, bool))], names=names,
            )

    events: list[Any] = []
    failed = failed_keys(storage)  # a failure is its key's newest event until a later run writes a row
    if failed is not None:
        events.append(pa.record_batch(
            [failed.column("key").combine_chunks(), pa.nulls(failed.num_rows, pa.int64()),
             failed.column(RUN_FIELD).combine_chunks(), pa.nulls(failed.num_rows, pa.string()),
             pa.array([True] * failed.num_rows)],
            names=names,
        ))
    gone = removed_keys(storage)  # a key removed by a prune_missing run has no row: new if it comes back
    if gone is not None:
        events.append(pa.record_batch(
            [gone.column("key").combine_chunks(), pa.nulls(gone.num_rows, pa.int64()),
             gone.column(RUN_FIELD).combine_chunks(), pa.nulls(gone.num_rows, pa.string()),
             pa.array([False] * gone.num_rows), pa.array([True] * gone.num_rows)],
            names=[*names, "removed"],
        ))
    values = _versions(storage)
    now = _declared(keyed.version, qualified_name(args.processor_cls),
                    getattr(args.processor_cls, "generation_fingerprint", None))

    def describe(digest: str) -> str:
        return _changes(values.get(digest, {}), now)

    return plan_increment(
        _key_batches(args, keyed), itertools.chain(stored(), events), new_rows=_dataset_rows(args),
        stored_rows=_stored_rows(storage), version=keyed.digest, on_change=keyed.on_change, describe_version=describe,
        removed_to=removed_to, retried_to=retried_to,
    )


def _has_rows(storage: Storage) -> bool:
    """Whether the job committed record rows (a keyed job whose processor wrote none has no keys stored)."""
    return _stored_rows(storage) > 0


def _stored_rows(storage: Storage) -> int:
    """The record rows the job and its runs committed (it sizes the planner's partitions)."""
    total = 0
    for folder in ["", *(f"{RETRIES_DIR}/{k}" for k in retry_numbers(storage))]:
        latest = latest_record_at(storage, folder)
        rows = latest.stats.get("record_rows") if latest is not None else None
        total += rows if isinstance(rows, int) else 0
    return total


def _newest_schema(storage: Storage) -> RecordSchema | None:
    """The record schema of the job's newest finished run (the run's rows unify with it)."""
    for folder in [*(f"{RETRIES_DIR}/{k}" for k in reversed(retry_numbers(storage))), ""]:
        latest = latest_record_at(storage, folder)
        if latest is not None and latest.record_schema is not None and (not folder or latest.finished):
            return latest.record_schema
    return None
