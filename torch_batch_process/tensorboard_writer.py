"""TensorBoard: each rank's event files in ``context.get_tensorboard_path()``, and their upload.

Event files are written with ``torch.utils.tensorboard.SummaryWriter`` (only when the
``tensorboard`` package is installed: extra ``tensorboard``). Each rank writes its own folder
``rank_<r>``, so TensorBoard shows the ranks as runs side by side. Tags:

- ``<group>/<name>``: numbers of ``report_metrics(group, steps_completed, metrics)`` at step
  ``steps_completed`` (nested dicts are flattened with ``/``; strings and lists are only in JSONL).
- ``reduced/<name>``: reduced metrics (rank 0) at step = batches committed, when computed.
- ``progress/examples_per_s``, ``progress/fraction_done``, ``progress/examples_committed`` (rank 0)
  and ``throughput/examples_per_s``, ``time/<phase>_s`` (every rank: its own busy rate and seconds
  per phase), at step = batches committed, at most every 10 seconds and at the end.

For local storage the folder *is* ``<storage_path>/tensorboard/rank_<r>``. For remote storage it is
a fresh local temporary folder whose new or changed files (these event files, profiler traces, and
whatever the processor writes there) are uploaded through :class:`Storage` to
``<storage_path>/tensorboard/rank_<r>/`` at commits (at most every ``interval`` seconds) and when the
job returns; the temporary folder is then deleted. Point TensorBoard at ``<storage_path>/tensorboard``.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from torch_batch_process.storage import Storage

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"


def tensorboard_dir(rank: int) -> str:
    """Path of rank ``rank``'s TensorBoard folder, relative to the storage root."""
    return f"{TENSORBOARD_DIR}/rank_{rank}"


class TensorBoardLog:
    """One rank's event file (``SummaryWriter``)."""

    def __init__(self, local_dir: Path, *, flush_secs: int = 10) -> None:
        from torch.utils.tensorboard import SummaryWriter

        local_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(local_dir), flush_secs=flush_secs)

    def scalars(self, values: dict[str, Any], step: int, prefix: str = "") -> None:
        """Adds every number of ``values`` (flattening nested dicts) as a scalar at ``step``."""
        for key, value in values.items():
            tag = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, dict):
                self.scalars(value, step, tag)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, value, step)

    def records(self, records: list[dict[str, Any]]) -> None:
        """Adds ``report_metrics`` records (``group``, ``steps_completed``, ``metrics``)."""
        for record in records:
            self.scalars(record["metrics"], record["steps_completed"], record["group"])

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class FolderUploader:
    """Uploads the new or changed files of a local folder to ``tensorboard/rank_<r>/`` of remote storage."""

    def __init__(self, local_dir: Path, rank: int, storage: Storage, *, interval: float = 30.0) -> None:
        self.local_dir = local_dir
        self.rank = rank
        self._storage = storage
        self._interval = interval
        self._next = time.monotonic() + interval
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._failed = False

    def due(self) -> bool:
        """Whether :meth:`sync` should run now (``interval`` seconds since the last one)."""
        return not self._failed and time.monotonic() >= self._next

    def sync(self) -> bool:
        """Uploads what changed since the last sync; returns False (and warns once) when it failed."""
        self._next = time.monotonic() + self._interval
        if self._failed or not self.local_dir.is_dir():
            return not self._failed
        try:
            for path in sorted(self.local_dir.rglob("*")):
                if not path.is_file():
                    continue
                stat = path.stat()
                signature = (stat.st_size, stat.st_mtime_ns)
                rel = path.relative_to(self.local_dir).as_posix()
                if self._uploaded.get(rel) == signature:
                    continue
                self._storage.put_file(path, f"{tensorboard_dir(self.rank)}/{rel}")
                self._uploaded[rel] = signature
        except Exception as exc:  # noqa: BLE001 - event files are a convenience, never a job failure
            self._failed = True
            logger.warning(
                "uploading TensorBoard files to %s failed (%s); they stay in %s",
                self._storage.url_of(tensorboard_dir(self.rank)),
                exc,
                self.local_dir,
            )
        return not self._failed

    def close(self) -> None:
        """Uploads what is left, then deletes the local temporary folder (kept when an upload failed)."""
        if self.sync():
            shutil.rmtree(self.local_dir, ignore_errors=True)


def temporary_folder(job_name: str, rank: int) -> Path:
    """A fresh local folder name (not created) for the TensorBoard files of a job on remote storage."""
    import tempfile
    import uuid

    return Path(tempfile.gettempdir()) / f"tbp-tensorboard-{job_name}-rank{rank}-{uuid.uuid4().hex[:12]}"
