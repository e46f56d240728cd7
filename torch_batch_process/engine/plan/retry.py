"""``retry_failed=True``: process only the recorded failures of a finished job (DESIGN §11).

A retry is a job of its own, stored below the job's storage path in ``retries/<k>/`` (``k`` = 1, 2, ...), with
the same dataset, processor and options, whose plan (:class:`IndexPlan`) holds only the dataset indices listed
as failed when it starts, cut into batches of ``batch_size`` in index order. It has everything a job has:
commits, exactly-once outputs, resume after a kill (the same ``k`` is used again until it finishes),
``on_error``, ``max_failures``. ``context.batch_indices`` gives the original dataset indices.

Its outputs belong to the job: they are published to the job's own ``outputs/`` (a
:class:`~torch_batch_process.storage.nested.NestedStorage` maps the retry's ``outputs/`` there), so the documented
glob and :func:`~torch_batch_process.read_outputs` see the recovered examples' files and rows exactly once, next to
the others. Nothing it numbers repeats a number used before in the job's life: its batches (``batch_idx``) are
numbered after every batch of the job and of its earlier retries, and its stages (the ``outputs/commit_<s>/``
folders) after every stage they used; both starts are fixed when the retry first starts (stored in its plan's
fingerprint, ``first_batch`` and ``first_stage``), so a resume of the retry numbers the same way.

The failures a retry records replace the ones it retried: the job's current failures are those of its latest
finished retry (``retries/<k>/failures/``), else its own
(:func:`~torch_batch_process.jobstore.retries.current_failures_root`); so a failure that succeeds in a retry is
cleared, and one that fails again is listed once, by the retry, with the ``batch_idx`` of its batch in the job (the
original batch; ``retry_batch_idx`` is the retry's). The result of a retry call is the retry job's
(``failed_examples``: the failures left).

A job or retry is finished when its latest commit record is the final one
(:func:`~torch_batch_process.jobstore.store.job_finished`); its
``result.json`` is a copy written after that record, which a kill in between leaves unwritten: rank 0 writes
it before a retry starts (:func:`choose_retry`), and opening the finished job does too.

Retries stored by earlier versions (their ``outputs/`` in ``retries/<k>/outputs/``, batches numbered from 0,
no ``first_stage`` in their plan) are read where they are, and one left unfinished resumes in that layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.errors import JobMismatchError
from torch_batch_process.jobstore.formats import JobSpec
from torch_batch_process.jobstore.layout import RETRIES_DIR
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.jobstore.retries import next_retry, open_job_folder, retry_numbering
from torch_batch_process.jobstore.store import JobStore, latest_record_at
from torch_batch_process.outputs.failure_records import read_failure_records
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.nested import NestedStorage
from torch_batch_process.storage.registry import open_storage

__all__ = [
    "IndexPlan",
    "Retry",
    "RetryChoice",
    "check_same_outputs",
    "choose_retry",
    "prepare_retry",
    "repair_finished_folders",
]

if TYPE_CHECKING:
    from torch_batch_process.arguments import JobArguments
    from torch_batch_process.engine.distributed import Collectives
    from torch_batch_process.jobstore.schema import RecordSchema

logger = logging.getLogger(__name__)


@dataclass
class RetryChoice:
    """Rank 0's choice of the retry to run, sent to every rank."""

    k: int
    indices: list[int]
    """The dataset indices to process again, ascending."""
    origins: dict[int, int]
    """Dataset index -> the batch it failed in, in the job (the original ``batch_idx``)."""
    schema: RecordSchema | None
    """The record schema of the job or retry whose failures are retried (``None``: no rows)."""
    first_batch: int
    first_stage: int | None
    """``None``: a retry of an earlier version resumed in its own layout (outputs in its folder, batches from 0)."""


@dataclass
class Retry:
    """What a rank needs to run the retry: its arguments, plan, storage and the record schema to unify with."""

    args: JobArguments
    plan: IndexPlan
    storage: Storage
    schema: RecordSchema | None
    first_stage: int


def prepare_retry(args: JobArguments, collectives: Collectives) -> Retry:
    """Every rank: the retry to run for the finished job of ``args`` (see the module docstring). Rank 0 repairs
    and reads storage (:func:`choose_retry`); every rank gets its answer, or raises what it raised."""
    choice = collectives.from_rank0(lambda: choose_retry(args), "choosing the retry")
    assert isinstance(choice, RetryChoice)
    folder = f"{RETRIES_DIR}/{choice.k}"
    root = open_storage(args.storage_path, args.storage_options)
    if choice.first_stage is None:  # an unfinished retry of an earlier version: its own outputs/, as it began
        storage: Storage = open_storage(root.url_of(folder), args.storage_options)
        root.close()
    else:
        storage = NestedStorage(root, folder, args.storage_options)
    logger.info(
        "retry %d of job '%s': %d failed example(s) to process again, stored in %s (outputs in %s)",
        choice.k, args.job_name, len(choice.indices), storage.url, storage.url_of("outputs"),
    )
    if args.lengths is not None:  # said, not silently dropped: the failures are cut in index order
        logger.warning(
            "retry %d: bucket_by (and max_tokens) are not applied to a retry's failed examples: its batches hold "
            "batch_size=%d of them in index order (on_oom='split' still splits a batch that does not fit)",
            choice.k, args.batch_size,
        )
    options = dataclasses.replace(args.failures, retry_failed=False)
    # max_batches is refused with retry_failed=True before any work (validation): a retry processes every failure
    retry_args = dataclasses.replace(args, storage_path=storage.url, lengths=None, failures=options)
    plan = IndexPlan(
        choice.indices, args.batch_size, first_batch=choice.first_batch, first_stage=choice.first_stage,
        origins=choice.origins,
    )
    return Retry(retry_args, plan, storage, choice.schema, choice.first_stage or 1)


def choose_retry(args: JobArguments) -> RetryChoice:
    """Rank 0: the retry to run (its number), the dataset indices it retries with their original batches, the
    record schema of the job or retry whose failures it retries, and where its batch and stage numbers start.

    The job, and the retry whose failures are retried, get the repairs of a finished job first (their last
    failures and outputs published, their ``result.json`` written: :meth:`JobStore.repair_finished`), so that
    the failures read are all those committed.
    """
    storage = open_storage(args.storage_path, args.storage_options)
    try:
        k, source = next_retry(storage)
        check_same_outputs(storage, args, "retry_failed=True")
        repair_finished_folders(storage, list(dict.fromkeys(["", source])), args.storage_options)
        records = read_failure_records(storage, source)
        origins: dict[int, int] = {}
        for record in records:
            origins.setdefault(int(record["index"]), int(record.get("batch_idx", -1)))
        latest = latest_record_at(storage, source)
        first_batch, first_stage = retry_numbering(storage, k)
        return RetryChoice(
            k=k,
            indices=sorted(origins),
            origins=origins,
            schema=latest.record_schema if latest else None,
            first_batch=first_batch,
            first_stage=first_stage,
        )
    finally:
        storage.close()


def check_same_outputs(storage: Storage, args: JobArguments, call: str) -> None:
    """A run stored in ``retries/<k>/`` (``retry_failed=True``, a keyed job's ``incremental=True`` run) publishes its
    rows with the job's: its ``output_format`` and ``table`` must be the job's (another format would leave the job's
    outputs in two formats, which ``read_outputs`` refuses to mix; another table would hold the run's rows apart from
    the job's). ``call`` names the kind of run in the error.

    Raises:
        JobMismatchError: they differ (raised before anything is planned or written), naming each and the job's value.
    """
    job = JobStore(storage).load_job()
    spec = job.spec if job is not None else {}
    stored, now = JobSpec.stored_outputs(spec), JobSpec.call_outputs(args)  # both as a stored spec holds them
    differ = [name for name in stored if stored[name] != now[name]]
    if differ:
        named = "; ".join(f"{name}: the job's {stored[name]!r}, this call's {now[name]!r}" for name in differ)
        raise JobMismatchError(
            f"{call}: the job at {storage.url} writes its rows elsewhere ({named}), and its runs write where it does. "
            f"Nothing was changed. Call it with the job's {' and '.join(differ)}, or start a new job (resume=False, or "
            "a new storage_path)"
        )


def repair_finished_folders(storage: Storage, folders: list[str], storage_options: dict[str, Any] | None) -> None:
    """Rank 0: the repairs of the finished jobs in ``folders`` of ``storage`` (``""``: the job, ``retries/<k>``: a
    run): their last failures and outputs published, their ``result.json`` written
    (:meth:`JobStore.repair_finished`; nothing on one that is not finished)."""
    from torch_batch_process.outputs.segments import roll_leftovers

    for folder in folders:
        job = open_job_folder(storage, folder, storage_options) if folder else storage
        try:
            JobStore(job, leftovers=roll_leftovers).repair_finished()
        finally:
            if job is not storage:
                job.close()


class IndexPlan(Plan):
    """Batches of ``batch_size`` over given dataset indices, in their order, numbered from ``first_batch``.

    Args:
        indices: the dataset indices.
        batch_size: examples per batch.
        num_batches: keep only this many batches (``None``: all).
        first_batch: the number of the first batch (batch ``first_batch + i`` holds the ``i``-th slice).
        first_stage: where the retry's stage numbers start (part of the fingerprint; ``None``: not numbered so).
        origins: dataset index -> its original batch in the job (failure records keep it).
    """

    def __init__(
        self,
        indices: Sequence[int],
        batch_size: int,
        num_batches: int | None = None,
        *,
        first_batch: int = 0,
        first_stage: int | None = None,
        origins: dict[int, int] | None = None,
    ) -> None:
        self.indices = [int(i) for i in indices]
        self.batch_size = batch_size
        self.first_batch = first_batch
        self.first_stage = first_stage
        self.origins = origins or {}
        full = -(-len(self.indices) // batch_size)
        self.num_batches = full if num_batches is None else min(num_batches, full)

    def cut(self, num_batches: int) -> IndexPlan:
        return IndexPlan(
            self.indices, self.batch_size, num_batches, first_batch=self.first_batch, first_stage=self.first_stage,
            origins=self.origins,
        )

    def batch_indices(self, batch: int) -> list[int]:
        local = batch - self.first_batch
        return self.indices[local * self.batch_size : (local + 1) * self.batch_size]

    def count_examples(self, batches: RangeSet) -> int:
        total = 0
        for start, stop in batches.ranges():
            start, stop = max(start - self.first_batch, 0), min(stop - self.first_batch, self.num_batches)
            if start < stop:
                total += min(stop * self.batch_size, len(self.indices)) - start * self.batch_size
        return total

    def original_batch(self, batch: int, index: int) -> int:
        """The batch that example ``index`` failed in, in the job (``batch`` when unknown)."""
        return self.origins.get(index, batch)

    def fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256(",".join(map(str, self.indices)).encode()).hexdigest()[:16]
        numbering = (
            {} if self.first_stage is None else {"first_batch": self.first_batch, "first_stage": self.first_stage}
        )
        return {"retry_indices": len(self.indices), "sha256": digest, **numbering}

    def describe(self) -> str:
        first, last = self.first_batch, self.first_batch + self.num_batches - 1
        numbers = f" (batch_idx {first}..{last})" if self.num_batches else ""
        return (
            f"retry of {self.num_examples} failed examples in {self.num_batches} batches of {self.batch_size}{numbers}"
        )
