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
end). See :mod:`torch_batch_process.observe`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from torch_batch_process.storage import Storage

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (rank 0). Object stores get the whole file re-uploaded."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._mirror: Path | None = None

    def append(self, records: list[dict[str, Any]], *, commit: int, attempt: int) -> None:
        if not records:
            return
        now = time.time()
        lines = "".join(
            json.dumps({**record, "time": record.get("time", now), "commit": commit, "attempt": attempt}, sort_keys=True)
            + "\n"
            for record in records
        )
        if self._storage.is_local:
            path = self._storage.local_path(METRICS_FILE)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(lines)
            return
        mirror = self._local_mirror()
        with open(mirror, "a", encoding="utf-8") as f:
            f.write(lines)
        upload = mirror.with_suffix(".upload")
        shutil.copyfile(mirror, upload)
        self._storage.put_file(upload, METRICS_FILE)

    def _local_mirror(self) -> Path:
        if self._mirror is None:
            folder = Path(tempfile.mkdtemp(prefix="tbp-metrics-"))
            self._mirror = folder / METRICS_FILE
            try:
                self._mirror.write_bytes(self._storage.read_bytes(METRICS_FILE))
            except FileNotFoundError:
                self._mirror.write_bytes(b"")
        return self._mirror

    def close(self) -> None:
        if self._mirror is not None:
            shutil.rmtree(self._mirror.parent, ignore_errors=True)
            self._mirror = None
