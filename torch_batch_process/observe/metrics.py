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

Locally the lines of one commit are appended with a single ``write()`` (a killed process leaves
whole lines). Object stores cannot append: rank 0 keeps a local copy of the file (under
``$TMPDIR``) and uploads it whole, in one atomic PUT, at each commit that adds lines.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from torch_batch_process.storage.base import Storage

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends records to ``metrics.jsonl`` (rank 0)."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._mirror: Path | None = None
        self._lock = threading.Lock()  # one append (and upload) at a time

    def append(self, records: list[dict[str, Any]], *, commit: int, attempt: int) -> None:
        if not records:
            return
        now = time.time()
        lines = "".join(
            json.dumps({**record, "time": record.get("time", now), "commit": commit, "attempt": attempt}, sort_keys=True)
            + "\n"
            for record in records
        ).encode("utf-8")
        with self._lock:
            if self._storage.is_local:
                self._storage.append_bytes(METRICS_FILE, lines)
                return
            mirror = self._local_mirror()
            with open(mirror, "ab") as f:
                f.write(lines)
            self._storage.write_bytes(METRICS_FILE, mirror.read_bytes())

    def _local_mirror(self) -> Path:
        if self._mirror is None:
            folder = Path(tempfile.mkdtemp(prefix="tbp-metrics-"))
            mirror = folder / METRICS_FILE
            try:
                mirror.write_bytes(self._storage.read_bytes(METRICS_FILE))
            except FileNotFoundError:
                mirror.write_bytes(b"")
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            self._mirror = mirror
        return self._mirror

    def close(self) -> None:
        if self._mirror is not None:
            shutil.rmtree(self._mirror.parent, ignore_errors=True)
            self._mirror = None

