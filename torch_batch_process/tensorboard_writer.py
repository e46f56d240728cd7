"""TensorBoard event files of one rank, in ``context.get_tensorboard_path()``.

Written with ``torch.utils.tensorboard.SummaryWriter`` (only when the ``tensorboard`` package is
installed: extra ``tensorboard``). Each rank writes its own folder ``rank_<r>``, so TensorBoard shows
the ranks as runs side by side. Tags:

- ``<group>/<name>``: numbers of ``report_metrics(group, steps_completed, metrics)`` at step
  ``steps_completed`` (nested dicts are flattened with ``/``; strings and lists are only in JSONL).
- ``reduced/<name>``: reduced metrics (rank 0) at step = batches committed, when computed.
- ``progress/examples_per_s``, ``progress/fraction_done``, ``progress/examples_committed`` (rank 0)
  and ``throughput/examples_per_s``, ``time/<phase>_s`` (every rank: its own rate and seconds per
  phase), at step = batches committed, at most every ``scalar_interval`` seconds.

For local storage the folder *is* ``<storage_path>/tensorboard/rank_<r>``. For remote storage it is a
local temporary folder whose new or changed files (event files, profiler traces) are uploaded to
``<storage_path>/tensorboard/rank_<r>/`` at commits, at most every ``upload_interval`` seconds, and
when the job returns. Point TensorBoard at ``<storage_path>/tensorboard``.
"""

from __future__ import annotations

import logging
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
    """One rank's event file writer, with uploads to remote storage."""

    def __init__(
        self,
        local_dir: Path,
        rank: int,
        remote: Storage | None = None,
        *,
        upload_interval: float = 30.0,
        flush_secs: int = 10,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.local_dir = local_dir
        self.rank = rank
        self._remote = remote
        self._upload_interval = upload_interval
        self._next_upload = time.monotonic() + upload_interval
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._upload_failed = False
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

    def sync(self, *, force: bool = False) -> None:
        """Remote storage: flushes and uploads new or changed files, at most every ``upload_interval`` s."""
        if self._remote is None or self._upload_failed:
            return
        now = time.monotonic()
        if not force and now < self._next_upload:
            return
        self._next_upload = now + self._upload_interval
        self._writer.flush()
        try:
            for path in sorted(self.local_dir.rglob("*")):
                if not path.is_file():
                    continue
                stat = path.stat()
                signature = (stat.st_size, stat.st_mtime_ns)
                rel = path.relative_to(self.local_dir).as_posix()
                if self._uploaded.get(rel) == signature:
                    continue
                self._remote.put_file(path, f"{tensorboard_dir(self.rank)}/{rel}")
                self._uploaded[rel] = signature
        except Exception as exc:  # noqa: BLE001 - event files are a convenience, never a job failure
            self._upload_failed = True
            logger.warning(
                "uploading TensorBoard files to %s failed (%s); they stay in %s",
                self._remote.url_of(tensorboard_dir(self.rank)),
                exc,
                self.local_dir,
            )

    def close(self) -> None:
        """Writes everything, uploads it (remote storage) and closes the event file."""
        self._writer.flush()
        self.sync(force=True)
        self._writer.close()

