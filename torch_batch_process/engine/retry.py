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
finished retry (``retries/<k>/failures/``), else its own (:func:`current_failures_root`); so a failure that
succeeds in a retry is cleared, and one that fails again is listed once, by the retry, with the ``batch_idx`` of
its batch in the job (the original batch; ``retry_batch_idx`` is the retry's). The result of a retry call is the
retry job's (``failed_examples``: the failures left).

A job or retry is finished when its latest commit record is the final one (:func:`job_finished`); its
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

from torch_batch_process.engine.plan import Plan
from torch_batch_process.engine.ranges import RangeSet
from torch_batch_process.engine.records import JobInfo
from torch_batch_process.engine.store import JobStore, job_finished, latest_record_at
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.storage.base import Storage, open_storage
from torch_batch_process.storage.layout import JOB_FILE, RETRIES_DIR
from torch_batch_process.storage.nested import NestedStorage

__all__ = [
    "IndexPlan",
    "Retry",
    "RetryChoice",
    "choose_retry",
    "current_failures_root",
    "next_retry",
    "open_job_folder",
    "prepare_retry",
    "retry_first_stages",
    "retry_numbers",
]

if TYPE_CHECKING:
    from torch_batch_process.engine.distributed import Collectives
    from torch_batch_process.outputs.schema import RecordSchema
    from torch_batch_process.validation import JobArguments

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
        "retry %d of job %s: %d failed example(s) to process again, stored in %s (outputs in %s)",
        choice.k, args.job_name, len(choice.indices), storage.url, storage.url_of("outputs"),
    )
    options = dataclasses.replace(args.failures, retry_failed=False)
    retry_args = dataclasses.replace(
        args, storage_path=storage.url, max_batches=None, lengths=None, failures=options
    )
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
    from torch_batch_process.observe.failures import read_failure_records

    storage = open_storage(args.storage_path, args.storage_options)
    try:
        k, source = next_retry(storage)
        for folder in dict.fromkeys(["", source]):
            job = open_job_folder(storage, folder, args.storage_options) if folder else storage
            try:
                JobStore(job).repair_finished()
            finally:
                if job is not storage:
                    job.close()
        records = read_failure_records(storage, source)
        origins: dict[int, int] = {}
        for record in records:
            origins.setdefault(int(record["index"]), int(record.get("batch_idx", -1)))
        latest = latest_record_at(storage, source)
        first_batch, first_stage = _numbering(storage, k)
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


def _numbering(storage: Storage, k: int) -> tuple[int, int | None]:
    """Where retry ``k``'s batch and stage numbers start: as it stored them when it began (``None`` stage: a retry
    of an earlier version), else after every batch and stage of the job and of its earlier retries."""
    stored = _stored_numbering(storage, f"{RETRIES_DIR}/{k}")
    if stored is not None:
        return stored
    job = _job_info(storage, "")
    first_batch = job.planned_batches if job is not None else 0
    first_stage = 1
    for folder in ["", *(f"{RETRIES_DIR}/{j}" for j in retry_numbers(storage) if j < k)]:
        if folder:
            earlier = _job_info(storage, folder)
            if earlier is not None:
                began = (earlier.spec.get("plan") or {}).get("first_batch", 0)
                first_batch = max(first_batch, int(began) + earlier.planned_batches)
        latest = latest_record_at(storage, folder)
        if latest is not None:
            first_stage = max(first_stage, latest.commit + 1, latest.last_stage + 1)
    return first_batch, first_stage


def _stored_numbering(storage: Storage, folder: str) -> tuple[int, int | None] | None:
    """The numbering a retry stored when it began (``(0, None)``: one of an earlier version); ``None`` when it
    stored nothing yet."""
    info = _job_info(storage, folder)
    if info is None:
        return None
    plan = info.spec.get("plan") or {}
    if "first_stage" not in plan:
        return 0, None
    return int(plan.get("first_batch", 0)), int(plan["first_stage"])


def _job_info(storage: Storage, folder: str) -> JobInfo | None:
    rel = f"{folder}/{JOB_FILE}" if folder else JOB_FILE
    try:
        return JobInfo.from_json(storage.read_json(rel), storage.url_of(rel))
    except FileNotFoundError:
        return None


def open_job_folder(storage: Storage, folder: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage of the retry in ``folder`` of ``storage`` as it runs: sharing the job's ``outputs/``, or, for a
    retry of an earlier version, rooted in its folder."""
    stored = _stored_numbering(storage, folder)
    if stored is not None and stored[1] is None:
        return open_storage(storage.url_of(folder), storage_options)
    return NestedStorage(open_storage(storage.url, storage_options), folder, storage_options)


def retry_first_stages(storage: Storage) -> dict[str, int]:
    """``retries/<k>`` -> the first stage number of each retry whose outputs are in the job's ``outputs/``
    (``outputs/commit_<s>/`` with ``s`` at or above it, below the next one's, are that retry's). Read-only."""
    firsts = {}
    for k in retry_numbers(storage):
        folder = f"{RETRIES_DIR}/{k}"
        try:
            stored = _stored_numbering(storage, folder)
        except Exception:  # noqa: BLE001 - a damaged job file: that retry's outputs are not told apart
            continue
        if stored is not None and stored[1] is not None:
            firsts[folder] = stored[1]
    return firsts


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
        numbering = {} if self.first_stage is None else {"first_batch": self.first_batch, "first_stage": self.first_stage}
        return {"retry_indices": len(self.indices), "sha256": digest, **numbering}

    def describe(self) -> str:
        first, last = self.first_batch, self.first_batch + self.num_batches - 1
        numbers = f" (batch_idx {first}..{last})" if self.num_batches else ""
        return f"retry of {self.num_examples} failed examples in {self.num_batches} batches of {self.batch_size}{numbers}"


def retry_numbers(storage: Storage) -> list[int]:
    """The numbers ``k`` of the job's retries (``retries/<k>/``), ascending."""
    return sorted(int(name) for name in storage.list(RETRIES_DIR) if name.isdigit())


def current_failures_root(storage: Storage) -> str:
    """The folder (relative to ``storage``) whose ``failures/`` lists the job's current failures: its latest
    finished retry, else the job itself (``""``)."""
    return _latest_finished(storage, retry_numbers(storage))


def next_retry(storage: Storage) -> tuple[int, str]:
    """The retry to run: the latest one when it is not finished (a resume), else a new one; and the folder
    whose failures it retries."""
    if not job_finished(storage):
        raise InvalidArgumentError(
            f"retry_failed=True: the job at {storage.url} is not finished; run it without retry_failed first "
            "(it resumes), then retry its failures"
        )
    numbers = retry_numbers(storage)
    if numbers and not job_finished(storage, f"{RETRIES_DIR}/{numbers[-1]}"):
        return numbers[-1], current_failures_root_before(storage, numbers[-1])
    return (numbers[-1] if numbers else 0) + 1, _latest_finished(storage, numbers)


def current_failures_root_before(storage: Storage, k: int) -> str:
    """The current failures' folder as it was when retry ``k`` started (the latest finished retry before it)."""
    return _latest_finished(storage, [j for j in retry_numbers(storage) if j < k])


def _latest_finished(storage: Storage, numbers: list[int]) -> str:
    """The folder of the latest finished retry among ``numbers`` (ascending), else the job's (``""``)."""
    for k in reversed(numbers):
        if job_finished(storage, f"{RETRIES_DIR}/{k}"):
            return f"{RETRIES_DIR}/{k}"
    return ""
