"""Staging of the files users write through ``context.upload_path()``.

Each ``upload_path()`` yields a fresh, empty local folder. When the ``with`` block ends, what was
written there joins this rank's stage of the next commit, ``_tbp/staging/<n>/rank_<r>/`` (see
:mod:`torch_batch_process.checkpoint`):

- on local storage the folder already lives next to the stage and its files are renamed into it
  (no copy, whatever their size);
- on remote storage the folder is a local temporary one (under ``$TMPDIR``): its files are moved
  to a spool folder at once (so the user's folder is removed when the block ends) and uploaded in
  the background by ``TBP_UPLOAD_THREADS`` threads (default 8), streamed from disk (see
  :meth:`Storage.put_file`), each spool file deleted once uploaded. The commit waits for those
  uploads. Temporary folders of a process that was killed are removed by the next job on the host.

Two files with the same path in the same commit of one rank would overwrite each other, so that is
an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from torch_batch_process.checkpoint import STAGING_DIR, commit_name, staging_dir
from torch_batch_process.storage import Storage

logger = logging.getLogger(__name__)

UPLOAD_THREADS = int(os.environ.get("TBP_UPLOAD_THREADS", "8"))
_TMP_PREFIX = "tbp-upload-"


class OutputStager:
    """Collects one rank's ``upload_path()`` files into the stage of the pending commit."""

    def __init__(self, storage: Storage, rank: int, commit: int) -> None:
        self._storage = storage
        self._rank = rank
        self.commit = commit
        self._names: set[str] = set()
        self._pending: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._tmp_root: Path | None = None
        self.files = 0
        self.bytes = 0

    @contextlib.contextmanager
    def upload_path(self) -> Iterator[Path]:
        """Yields a fresh folder; its files join the pending commit when the block exits normally."""
        if self._storage.is_local:
            rel = f"{STAGING_DIR}/{commit_name(self.commit)}/.incoming-rank_{self._rank}-{uuid.uuid4().hex[:10]}"
            folder = self._storage.local_path(rel)
            folder.mkdir(parents=True, exist_ok=False)
        else:
            folder = Path(tempfile.mkdtemp(prefix="block-", dir=self._tmp()))
        try:
            yield folder
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # a failed block contributes nothing
            raise
        try:
            self._seal(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _seal(self, folder: Path) -> None:
        files = sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())
        names = [p.relative_to(folder).as_posix() for p in files]
        clashes = sorted(set(names) & self._names)
        if clashes:
            raise FileExistsError(
                f"upload_path(): {clashes[0]!r} was already written through upload_path() by rank "
                f"{self._rank} since the last commit; writing it again would overwrite it. Give each output "
                "file a unique name (e.g. include batch_idx)."
            )
        target_dir = staging_dir(self.commit, self._rank)
        for path, name in zip(files, names, strict=True):
            size = path.lstat().st_size
            self.files += 1
            self.bytes += size
            self._names.add(name)
            if self._storage.is_local:
                target = self._storage.local_path(f"{target_dir}/{name}")
                target.parent.mkdir(parents=True, exist_ok=True)
                os.rename(path, target)
            else:
                # Move the file out of the user's folder so it can be cleaned now; upload it in the background.
                spool = self._tmp() / f"spool-{uuid.uuid4().hex}"
                os.rename(path, spool)  # same folder tree: a rename, never a copy
                self._submit(spool, f"{target_dir}/{name}")

    def _submit(self, local: Path, rel: str) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=UPLOAD_THREADS, thread_name_prefix="tbp-upload")
            self._pending.append(self._pool.submit(self._upload, local, rel))

    def _upload(self, local: Path, rel: str) -> None:
        try:
            self._storage.put_file(local, rel)
        finally:
            with contextlib.suppress(OSError):
                local.unlink()

    def _tmp(self) -> Path:
        """This stager's local temporary folder (remote storage), created on first use."""
        if self._tmp_root is None:
            _remove_orphans()
            self._tmp_root = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-r{self._rank}-"))
        return self._tmp_root

    def flush(self) -> None:
        """Waits until every file of the pending commit is in storage; raises the first upload error."""
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

    @property
    def has_files(self) -> bool:
        return bool(self._names)

    def advance(self, commit: int) -> None:
        """Starts collecting for ``commit`` (after the previous one is durable)."""
        self.commit = commit
        self._names = set()

    def close(self) -> None:
        """Stops the upload threads and removes the temporary files (pending uploads are abandoned:
        their commit never happens)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._tmp_root is not None:
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            self._tmp_root = None


def _remove_orphans() -> None:
    """Removes the temporary folders of stagers whose process is gone (killed before cleaning up)."""
    root = Path(tempfile.gettempdir())
    for folder in root.glob(f"{_TMP_PREFIX}*"):
        pid = folder.name[len(_TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
