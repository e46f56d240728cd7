"""The numbering of a job's retries (``retry_failed=True``, DESIGN §11): which retries a job has, which one runs
next, whose failures are the job's current ones, and where each retry's batch and stage numbers start.

A retry ``k`` is a job of its own stored in ``retries/<k>/`` below the job's storage path
(:mod:`torch_batch_process.engine.plan.retry` runs one). The job's current failures are those of its latest
finished retry, else its own: a failure that succeeds in a retry is cleared, one that fails again is listed once,
by the retry (a keyed job's incremental runs, stored as retries too, keep each key's newest failure instead:
:func:`torch_batch_process.outputs.keyed.runs.current_failures`). A retry's outputs are published to the job's own
``outputs/`` with stage numbers after every one used before (:func:`retry_numbering`; :func:`retry_first_stages`
tells them apart), except a retry stored by an earlier version, whose outputs stay in its folder
(:func:`open_job_folder`). Read-only: the read side
(``read_outputs``, ``read_failures``) uses it too.
"""

from __future__ import annotations

from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.jobstore.layout import RETRIES_DIR
from torch_batch_process.jobstore.store import job_finished, job_info_at, latest_record_at
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.nested import NestedStorage
from torch_batch_process.storage.registry import open_storage

__all__ = [
    "current_failures_root",
    "current_failures_root_before",
    "next_retry",
    "open_job_folder",
    "retry_first_stages",
    "retry_numbering",
    "retry_numbers",
]


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


def retry_numbering(storage: Storage, k: int) -> tuple[int, int | None]:
    """Where retry ``k``'s batch and stage numbers start: as it stored them when it began (``None`` stage: a retry
    of an earlier version), else after every batch and stage of the job and of its earlier retries."""
    stored = _stored_numbering(storage, f"{RETRIES_DIR}/{k}")
    if stored is not None:
        return stored
    job = job_info_at(storage)
    first_batch = job.planned_batches if job is not None else 0
    first_stage = 1
    for folder in ["", *(f"{RETRIES_DIR}/{j}" for j in retry_numbers(storage) if j < k)]:
        if folder:
            earlier = job_info_at(storage, folder)
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
    info = job_info_at(storage, folder)
    if info is None:
        return None
    plan = info.spec.get("plan") or {}
    if "first_stage" not in plan:
        return 0, None
    return int(plan.get("first_batch", 0)), int(plan["first_stage"])


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
