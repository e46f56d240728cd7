"""The numbering of a job's retries (``retry_failed=True``, DESIGN §11): which retries a job has, which one runs
next, and whose failures are the job's current ones.

A retry ``k`` is a job of its own stored in ``retries/<k>/`` below the job's storage path
(:mod:`torch_batch_process.engine.plan.retry` runs one). The job's current failures are those of its latest
finished retry, else its own: a failure that succeeds in a retry is cleared, one that fails again is listed once,
by the retry. Read-only: the read side (``read_outputs``, ``read_failures``) uses it too.
"""

from __future__ import annotations

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.jobstore.layout import RETRIES_DIR
from torch_batch_process.jobstore.store import job_finished
from torch_batch_process.storage.base import Storage

__all__ = ["current_failures_root", "current_failures_root_before", "next_retry", "retry_numbers"]


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
