"""Metrics log: ``report_metrics()`` records and final metrics as JSON Lines in storage.

Schema of ``<storage_path>/metrics.jsonl``, one JSON object per line::

    {"group": "inference", "steps_completed": 40, "rank": 1, "metrics": {...}, "time": 1732200000.0,
     "commit": 8, "attempt": 1}

Records reach storage at the commit that follows them (written by rank 0 after the commit record,
so a crash before a commit loses only records whose batches are processed again). Groups written
by the library itself: ``"reduced"`` (reduced metrics, ``steps_completed`` = batches committed: at
the end, at a preemption, and "so far" every ``TBP_METRICS_INTERVAL`` seconds; the last one of a
finished job is its result) and ``"progress"`` (``batches_committed``, ``examples_committed``,
``fraction_done``, ``examples_per_s``, ``elapsed_s``; every ``progress_interval`` seconds and at the
end) and ``"hparams"`` (the job config's ``hyperparameters`` as ``metrics``, from ``tbp run``; once per
attempt, with its first commit, ``steps_completed`` = batches committed when the attempt started).
See :mod:`torch_batch_process.observe.observer`.

The lines of one commit are appended at once (``storage.append``): locally with a single ``write()`` (a
killed process leaves whole lines); object stores cannot append, so the storage keeps a local copy of the
file and uploads it whole, in one atomic PUT, at each commit that adds lines.
"""

from __future__ import annotations

import json
import time
from typing import Any

from torch_batch_process.jobstore.layout import METRICS_FILE
from torch_batch_process.storage.base import Storage


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (rank 0)."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage

    def append(self, records: list[dict[str, Any]], *, commit: int, attempt: int) -> None:
        if not records:
            return
        now = time.time()
        lines = "".join(
            json.dumps({**record, "time": record.get("time", now), "commit": commit, "attempt": attempt}, sort_keys=True)
            + "\n"
            for record in records
        ).encode("utf-8")
        self._storage.append(METRICS_FILE, lines)
