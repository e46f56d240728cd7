"""``retry_failed=True``: process only the recorded failures of a finished job (DESIGN §11).

A retry is a job of its own, stored below the job's storage path in ``retries/<k>/`` (``k`` = 1, 2, ...), with
the same dataset, processor and options, whose plan (:class:`IndexPlan`) holds only the dataset indices listed
as failed when it starts, cut into batches of ``batch_size`` in index order. It has everything a job has:
commits, exactly-once outputs (under ``retries/<k>/outputs/``), resume after a kill (the same ``k`` is used again
until it finishes), ``on_error``, ``max_failures``. ``context.batch_indices`` gives the original dataset
indices; ``batch_idx`` is the batch's index in the retry's plan.

The failures a retry records replace the ones it retried: the job's current failures are those of its latest
finished retry (``retries/<k>/failures/``), else its own
(:func:`~torch_batch_process.jobstore.retries.current_failures_root`); so a failure that
succeeds in a retry is cleared, and one that fails again is listed once, by the retry. The result of a retry
call is the retry job's (``failed_examples``: the failures left).

A job or retry is finished when its latest commit record is the final one
(:func:`~torch_batch_process.jobstore.store.job_finished`); its
``result.json`` is a copy written after that record, which a kill in between leaves unwritten: rank 0 writes
it before a retry starts (:func:`choose_retry`), and opening the finished job does too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.jobstore.layout import RETRIES_DIR
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.jobstore.retries import next_retry
from torch_batch_process.jobstore.store import JobStore, latest_record_at
from torch_batch_process.storage.registry import open_storage

__all__ = ["IndexPlan", "choose_retry", "prepare_retry"]

if TYPE_CHECKING:
    from torch_batch_process.arguments import JobArguments
    from torch_batch_process.engine.distributed import Collectives
    from torch_batch_process.jobstore.schema import RecordSchema

logger = logging.getLogger(__name__)


def prepare_retry(
    args: JobArguments, collectives: Collectives
) -> tuple[JobArguments, IndexPlan, RecordSchema | None]:
    """Every rank: the arguments and plan of the retry to run for the finished job of ``args`` (see the module
    docstring), and the record schema its rows must unify with (the retried job's: ``read_outputs`` reads them
    together). Rank 0 repairs and reads storage (:func:`choose_retry`); every rank gets its answer, or raises
    what it raised."""
    k, url, indices, schema = collectives.from_rank0(lambda: choose_retry(args), "choosing the retry")
    logger.info(
        "retry %d of job %s: %d failed example(s) to process again, stored in %s", k, args.job_name, len(indices), url
    )
    options = dataclasses.replace(args.failures, retry_failed=False)
    retry_args = dataclasses.replace(args, storage_path=url, max_batches=None, lengths=None, failures=options)
    return retry_args, IndexPlan(indices, args.batch_size), schema


def choose_retry(args: JobArguments) -> tuple[int, str, list[int], RecordSchema | None]:
    """Rank 0: the retry to run (its number and URL), the dataset indices it retries and the record schema of
    the job or retry whose failures it retries (``None``: no rows).

    The job, and the retry whose failures are retried, get the repairs of a finished job first (their last
    failures published, their ``result.json`` written: :meth:`JobStore.repair_finished`), so that the failures
    read are all those committed.
    """
    from torch_batch_process.observe.failures import read_failure_records

    storage = open_storage(args.storage_path, args.storage_options)
    try:
        k, source = next_retry(storage)
        for root in dict.fromkeys(["", source]):
            job = open_storage(storage.url_of(root), args.storage_options) if root else storage
            try:
                JobStore(job).repair_finished()
            finally:
                if job is not storage:
                    job.close()
        indices = sorted({int(r["index"]) for r in read_failure_records(storage, source)})
        latest = latest_record_at(storage, source)
        return k, storage.url_of(f"{RETRIES_DIR}/{k}"), indices, latest.record_schema if latest else None
    finally:
        storage.close()


class IndexPlan(Plan):
    """Batches of ``batch_size`` over given dataset indices, in their order."""

    def __init__(self, indices: Sequence[int], batch_size: int, num_batches: int | None = None) -> None:
        self.indices = [int(i) for i in indices]
        self.batch_size = batch_size
        full = -(-len(self.indices) // batch_size)
        self.num_batches = full if num_batches is None else min(num_batches, full)

    def cut(self, num_batches: int) -> IndexPlan:
        return IndexPlan(self.indices, self.batch_size, num_batches)

    def batch_indices(self, batch: int) -> list[int]:
        return self.indices[batch * self.batch_size : (batch + 1) * self.batch_size]

    def count_examples(self, batches: RangeSet) -> int:
        total = 0
        for start, stop in batches.ranges():
            stop = min(stop, self.num_batches)
            if start < stop:
                total += min(stop * self.batch_size, len(self.indices)) - start * self.batch_size
        return total

    def fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256(",".join(map(str, self.indices)).encode()).hexdigest()[:16]
        return {"retry_indices": len(self.indices), "sha256": digest}

    def describe(self) -> str:
        return f"retry of {self.num_examples} failed examples in {self.num_batches} batches of {self.batch_size}"
