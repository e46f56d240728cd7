"""What ``tbp report`` and ``tbp dashboard`` show, read from a stored job (local or any fsspec URL).

Everything comes from what the job stores, read-only (safe while it runs): ``tbp status``'s reading of the job
file and the latest commit record (:func:`~torch_batch_process.observe.status.read_status`), ``metrics.jsonl``
(timeline points, the ``job`` lines with each attempt's arguments and plan, progress lines, hyperparameters:
see :mod:`~torch_batch_process.observe.timeline` and :mod:`~torch_batch_process.observe.observer`) and the
failure records (:mod:`~torch_batch_process.observe.failures`). Only the ``metrics.jsonl`` lines of those groups
are parsed (a substring test skips the others, e.g. millions of ``report_metrics()`` lines).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.errors import BatchProcessError
from torch_batch_process.jobstore.layout import METRICS_FILE
from torch_batch_process.observe.failures import current_failure_records
from torch_batch_process.observe.status import read_status
from torch_batch_process.observe.timeline import TIMELINE_GROUP
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.registry import open_storage

__all__ = ["JobData", "read_job_data"]

_GROUPS = (TIMELINE_GROUP, "job", "progress", "hparams")
_WANTED = re.compile(b'"group": "(?:' + b"|".join(group.encode() for group in _GROUPS) + b')"')


@dataclass
class JobData:
    """A stored job as the report sees it."""

    status: dict[str, Any]
    """``tbp status --json``'s object."""
    points: list[dict[str, Any]] = field(default_factory=list)
    """Timeline points (``metrics.jsonl`` lines of group ``timeline``), in file order."""
    jobs: list[dict[str, Any]] = field(default_factory=list)
    """The ``job`` lines: each attempt's arguments, world and plan."""
    progress: list[dict[str, Any]] = field(default_factory=list)
    """The ``progress`` lines (older jobs have these but no timeline)."""
    hparams: dict[str, Any] | None = None
    """The job config's hyperparameters (latest ``hparams`` line)."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """The current failure records, by dataset index."""
    failures_error: str | None = None
    """Why the failure records cannot be read (damaged files), else ``None``."""
    metrics_error: str | None = None
    """Why ``metrics.jsonl`` cannot be read (or which lines were skipped), else ``None``."""
    read_at: float = field(default_factory=time.time)


def read_job_data(storage_path: str, storage_options: dict[str, Any] | None = None) -> JobData:
    """Reads everything the report shows from the job stored at ``storage_path``.

    Raises:
        NoJobError: nothing is stored there.
        CheckpointCorruptError: the job file or the latest commit record cannot be read.
        StorageError: the storage cannot be read.
    """
    status = read_status(storage_path, storage_options)
    storage = open_storage(storage_path, storage_options)
    try:
        data = JobData(status=status)
        _read_metrics(storage, data)
        if status.get("failed_examples"):
            try:
                records = current_failure_records(storage)[1]
                data.failures = [{k: v for k, v in r.items() if k != "traceback"} for r in records]  # not shown
            except BatchProcessError as exc:
                data.failures_error = str(exc)
        return data
    finally:
        storage.close()


def _read_metrics(storage: Storage, data: JobData) -> None:
    try:
        raw = storage.read_bytes(METRICS_FILE)
    except FileNotFoundError:
        return
    except BatchProcessError as exc:
        data.metrics_error = f"{storage.url_of(METRICS_FILE)} cannot be read: {exc}"
        return
    bad = 0
    for line in raw.splitlines():
        if _WANTED.search(line) is None:
            continue
        try:
            record = json.loads(line)
            group, metrics = record["group"], record["metrics"]
            if not isinstance(metrics, dict):
                raise ValueError("metrics is not an object")
        except (ValueError, KeyError, TypeError):
            bad += 1  # a line cut by a crash, or edited by hand
            continue
        if group == TIMELINE_GROUP:
            data.points.append(record)
        elif group == "job":
            data.jobs.append(record)
        elif group == "progress":
            data.progress.append(record)
        elif group == "hparams":
            data.hparams = metrics
    if bad:
        data.metrics_error = f"{bad} line(s) of {storage.url_of(METRICS_FILE)} could not be read and were skipped"
