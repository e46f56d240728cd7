"""Files going up to an object store in the background: output files of commits, and mirrored folders."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from torch_batch_process import settings
from torch_batch_process.storage.base import FileSink, MirroredFolder, Storage

__all__ = ["UploadSink", "UploadedFolder", "upload_threads"]

logger = logging.getLogger(__name__)


def upload_threads() -> int:
    """Threads uploading output files: ``$TBP_UPLOAD_THREADS``, default 8 (read when a sink starts uploading)."""
    return settings.current().upload_threads


class UploadSink(FileSink):
    """Uploads files with :func:`upload_threads` threads; each local file is deleted once uploaded.

    Args:
        storage: the object store.
        spool_root: this process's local temporary folder (on the files' filesystem: they are renamed there).
    """

    def __init__(self, storage: Storage, spool_root: Callable[[], Path]) -> None:
        self._storage = storage
        self._spool_root = spool_root
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def add(self, local_file: str | os.PathLike[str], rel: str) -> None:
        # Out of the caller's folder at once (a rename: same temporary tree), so the folder can be reused.
        spool = self._spool_root() / f"spool-{uuid.uuid4().hex}"
        os.rename(local_file, spool)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=upload_threads(), thread_name_prefix="tbp-upload")
            self._pending.append(self._pool.submit(self._upload, spool, rel))

    def _upload(self, local_file: Path, rel: str) -> None:
        try:
            self._storage.put_file(local_file, rel)
        finally:
            with contextlib.suppress(OSError):
                local_file.unlink()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        error: BaseException | None = None
        for future in pending:
            try:
                future.result()
            except BaseException as exc:  # noqa: BLE001 - wait for all, then raise the first
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class UploadedFolder(MirroredFolder):
    """A local temporary folder whose new or changed files are uploaded to ``rel`` (at most every
    ``interval`` seconds when asked by :meth:`due`, and at :meth:`close`)."""

    def __init__(self, storage: Storage, rel: str, path: Path, *, interval: float = 30.0) -> None:
        self.path = path
        self._storage = storage
        self._rel = rel
        self._interval = interval
        self._next = time.monotonic() + interval
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._failed = False

    def due(self) -> bool:
        return not self._failed and time.monotonic() >= self._next

    def sync(self) -> bool:
        self._next = time.monotonic() + self._interval
        if self._failed or not self.path.is_dir():
            return not self._failed
        try:
            for path in sorted(self.path.rglob("*")):
                if not path.is_file():
                    continue
                stat = path.stat()
                signature = (stat.st_size, stat.st_mtime_ns)
                rel = path.relative_to(self.path).as_posix()
                if self._uploaded.get(rel) == signature:
                    continue
                self._storage.put_file(path, f"{self._rel}/{rel}")
                self._uploaded[rel] = signature
        except Exception as exc:  # noqa: BLE001 - a convenience (event files), never a job failure
            self._failed = True
            logger.warning("uploading %s to %s failed (%s); the files stay there", self.path, self._storage.url_of(self._rel), exc)
        return not self._failed

    def close(self) -> None:
        if self.sync():
            shutil.rmtree(self.path, ignore_errors=True)
