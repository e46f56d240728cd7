"""Opening a job: rank 0 reads, checks and repairs what is stored, under the job lock; its :class:`Start` (or its
exception) goes to every rank before any work (:mod:`torch_batch_process.engine.commit.shared_start`).

Rank 0 refuses another job (a different fingerprint) and damaged progress, returns the stored result of a
finished job (its final commit record's; after publishing files a kill left unpublished and writing a
``result.json`` a kill left unwritten, under the job lock), erases the job with ``resume=False``, repairs
what a crash left (:meth:`~torch_batch_process.jobstore.store.JobStore.repair`), brings a table target in line
with the latest record (:meth:`~torch_batch_process.outputs.tables.commits.TableCommits.reconcile`, given as a
:class:`TableReconciler`), writes the job file at the first start and counts the attempt.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch_batch_process.arguments import Script
from torch_batch_process.errors import CheckpointCorruptError, JobMismatchError
from torch_batch_process.jobstore.formats import CommitRecord, JobInfo, JobSpec, check_fingerprint, check_script
from torch_batch_process.jobstore.integrity import check_integrity, warn_of_strays
from torch_batch_process.jobstore.store import JobStore, LeftoverRows
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.nested import NestedStorage

__all__ = ["JobOpener", "Start", "TableReconciler"]

logger = logging.getLogger(__name__)


@dataclass
class Start:
    """What rank 0 found in storage, given to every rank before any work."""

    attempt: int
    next_number: int
    """The first commit (and stage) number of this attempt."""
    planned_batches: int
    latest: CommitRecord | None = None
    """The latest record of earlier attempts (``None``: nothing committed yet)."""
    finished_result: dict[str, Any] | None = None
    job_id: str = ""
    """The job's unique id (:attr:`JobInfo.uid`): a table target's data files and transactions carry it."""
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Names this call's keys in the rendezvous store (the store may outlive the call: torchrun's agent)."""

    @property
    def frozen_state_files(self) -> list[str]:
        """State files of earlier attempts, whose reducer summaries stay slots of the final reduction."""
        return self.latest.slot_files() if self.latest is not None else []


class TableReconciler(Protocol):
    """A table target's transactions as opening the job uses them
    (:class:`~torch_batch_process.outputs.tables.commits.TableCommits`)."""

    def due(self, latest: CommitRecord, job_id: str) -> bool:
        """Whether the finished record ``latest`` has rows the table lacks."""
        ...

    def reconcile(
        self, latest: CommitRecord | None, job_id: str, *, committed_stages: Callable[[int], bool],
        finishing: bool = False,
    ) -> bool:
        """Adds the committed rows the table lacks, deletes the data files of stages never committed; compacts a
        finished job's table when it added rows or when ``finishing`` (the last run ended before its result)."""
        ...


class JobOpener:
    """Rank 0's reading of the stored job (see the module docstring).

    Args:
        storage: the job's storage.
        spec: this job's fingerprint.
        job_name: stored in the job file at the first start.
        resume: ``False`` erases a stored job first.
        world_size: ranks of this attempt (stored with the attempt count).
        table: rank 0's table transactions (``table=``), reconciled with the latest record at the start.
        script: the script that runs this call (recorded at the first start; another one is refused on a resume).
        first_stage: the first commit and stage number of a fresh job (a retry's come after those of the job it
            retries, whose ``outputs/`` it shares: see :mod:`torch_batch_process.engine.plan.retry`).
        leftovers: rolls record rows a kill left in segments into shards at the repair (see
            :class:`~torch_batch_process.jobstore.store.JobStore`).
    """

    def __init__(
        self,
        storage: Storage,
        spec: JobSpec,
        job_name: str,
        resume: bool,
        world_size: int,
        table: TableReconciler | None = None,
        script: Script | None = None,
        first_stage: int = 1,
        leftovers: LeftoverRows | None = None,
    ) -> None:
        self.table = table
        self.storage = storage
        self.store = JobStore(storage, first_stage, leftovers)
        self.spec = spec
        self.job_name = job_name
        self.resume = resume
        self.world_size = world_size
        self.script = script
        self._damaged: CheckpointCorruptError | None = None  # resume=False: the damaged job erased

    def read(self, planned: int, planned_examples: int) -> Start:
        """Rank 0: the :class:`Start` of this attempt, after the checks and repairs (see the module docstring).

        Args:
            planned: the number of global batches of a fresh job (the plan's, after ``max_batches``).
            planned_examples: the examples in them.
        """
        self.storage.check()  # unreachable, missing bucket, no permission: a clear error before anything else
        job, latest = self._read_and_check()
        if latest is not None and self.resume:
            warn_of_strays(self.store, latest)
        if latest is not None and latest.finished and self.resume and latest.result is not None:
            table_due = self.table is not None and job is not None and self.table.due(latest, job.uid)
            if self.store.finished_repair_due(latest) or table_due:
                self.store.take_lock()
                job, latest = self._read_and_check()
                assert latest is not None
                # the result file comes last in a finished run (after the table's compaction): without it, the run
                # may have been killed in the compaction, which the table then runs again, before the repair
                # writes the result (a kill in this compaction leaves it due again)
                self._reconcile_table(job, latest, finishing=not self.store.result_written())
                self.store.repair(latest)
            return Start(
                attempt=latest.attempt,
                next_number=latest.commit + 1,
                planned_batches=job.planned_batches if job else 0,
                latest=latest,
                finished_result=latest.result,
            )
        self.store.take_lock()  # the first write to storage
        job, latest = self._read_and_check()  # again, now that no other job can change it
        if not self.resume and (job is not None or latest is not None or self._damaged is not None):
            logger.warning("resume=False: erasing the job stored at %s", self.storage.url)
            self.store.erase()
            job, latest = None, None
        self.store.repair(latest)
        if job is None:
            job = JobInfo(self.spec.to_json(), planned, self.job_name, time.time(), planned_examples, self.script)
            self.store.write_job(job)
        self._reconcile_table(job, latest)
        if latest is not None and latest.finished:  # finished, but resume=False was handled above
            latest = None
        return Start(
            attempt=self.store.next_attempt(latest, self.world_size),
            next_number=max(latest.commit, latest.last_stage) + 1 if latest else self.store.first_stage,
            planned_batches=job.planned_batches,
            latest=latest,
            job_id=job.uid,
        )

    def _reconcile_table(self, job: JobInfo | None, latest: CommitRecord | None, *, finishing: bool = False) -> None:
        """A table target: adds the committed rows it lacks, deletes data files of stages never committed (and
        compacts, see :meth:`TableReconciler.reconcile`)."""
        if self.table is None or job is None:
            return
        committed = latest.has_stage if latest is not None else (lambda stage: False)
        self.table.reconcile(latest, job.uid, committed_stages=committed, finishing=finishing)

    def _read_and_check(self) -> tuple[JobInfo | None, CommitRecord | None]:
        if not self.resume:
            return self._read_to_erase()
        job = self.store.load_job()
        latest = self.store.load_latest()
        if self.resume and job is not None:
            run_of = self.storage.parent.url if isinstance(self.storage, NestedStorage) else None  # retries/<k>
            check_fingerprint(job, self.spec, self.storage.url, run_of)
            check_script(job, self.script, self.storage.url)  # a job of another script of the same name
            check_integrity(self.store, latest)  # damaged progress is an error, never a restart from zero
        if self.resume and job is None and (latest is not None or self.store.has_outputs()):
            raise JobMismatchError(
                f"storage_path {self.storage.url!r} holds {'commit records' if latest else 'outputs'} but no job file "
                "(a previous erase was interrupted, or files were removed by hand). Nothing was changed. Pass "
                "resume=False to erase it and start afresh, or use a new storage_path."
            )
        return job, latest

    def _read_to_erase(self) -> tuple[JobInfo | None, CommitRecord | None]:
        """``resume=False``: the stored job is erased, so damage in it is no error (the error messages of damaged
        progress give resume=False as the fix)."""
        try:
            return self.store.load_job(), self.store.load_latest()
        except CheckpointCorruptError as exc:
            self._damaged = exc
            return None, None

    def release(self) -> None:
        """Releases the job lock (when rank 0 took it)."""
        self.store.release_lock()

