"""Staging of the files users write through ``context.upload_path()``.

Each ``upload_path()`` yields an empty local folder. When the ``with`` block ends, what was
written there joins this rank's stage of the next commit, ``_tbp/staging/<n>/rank_<r>/`` (see
:mod:`torch_batch_process.engine.checkpoint`):

- on local storage the folder lives next to the stages (``_tbp/staging/.incoming-rank_<r>-<id>``)
  and its files are renamed into the stage (no copy, whatever their size);
- on remote storage the folder is a local temporary one (under ``$TMPDIR``): its files are moved
  to a spool folder at once and uploaded in the background by ``TBP_UPLOAD_THREADS`` threads
  (default 8), streamed from disk (see :meth:`Storage.put_file`), each spool file deleted once
  uploaded. The commit waits for those uploads. Temporary folders of a process that was killed are
  removed by the next job on the host.

A folder left empty by its block is handed to the next ``upload_path()`` instead of being deleted
and made again, and the stage's folders are made once per commit: creating and removing folders
costs a few syscalls per batch (milliseconds on some filesystems, e.g. ext4 mounted with
``discard``), which is the stager's whole cost on local storage. Leftover local folders of a killed
job are removed by the repair at its next start (every non-numbered entry of ``_tbp/staging``).

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

from torch_batch_process.engine.checkpoint import STAGING_DIR, staging_dir
from torch_batch_process.processes import pid_alive
from torch_batch_process.storage.base import Storage

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
        self._spare: list[Path] = []  # empty folders of finished blocks, for the next upload_path()
        self._made_dirs: set[str] = set()  # folders of the pending stage that exist already
        self._tmp_root: Path | None = None
        self.files = 0
        self.bytes = 0

    @contextlib.contextmanager
    def upload_path(self) -> Iterator[Path]:
        """Yields an empty folder; its files join the pending commit when the block exits normally."""
        folder = self._take_folder()
        try:
            yield folder
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # a failed block contributes nothing
            raise
        emptied = False
        try:
            emptied = self._seal(folder)
        finally:
            if emptied:
                with self._lock:
                    self._spare.append(folder)
            else:
                shutil.rmtree(folder, ignore_errors=True)

    def _take_folder(self) -> Path:
        with self._lock:
            if self._spare:
                return self._spare.pop()
        if self._storage.is_local:
            folder = self._storage.local_path(f"{STAGING_DIR}/.incoming-rank_{self._rank}-{uuid.uuid4().hex[:10]}")
            folder.mkdir(parents=True, exist_ok=False)
            return folder
        return Path(tempfile.mkdtemp(prefix="block-", dir=self._tmp()))

    def _seal(self, folder: Path) -> bool:
        """Moves the block's files into the stage; returns True when that left ``folder`` empty."""
        files, has_dirs = _list_files(folder)
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
                target = self._storage.path(f"{target_dir}/{name}")
                parent = os.path.dirname(target)
                if parent not in self._made_dirs:
                    os.makedirs(parent, exist_ok=True)
                    self._made_dirs.add(parent)
                os.rename(path, target)
            else:
                # Move the file out of the user's folder so it can be cleaned now; upload it in the background.
                spool = self._tmp() / f"spool-{uuid.uuid4().hex}"
                os.rename(path, spool)  # same folder tree: a rename, never a copy
                self._submit(spool, f"{target_dir}/{name}")
        return not has_dirs

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
        self._made_dirs = set()

    def close(self) -> None:
        """Stops the upload threads and removes the spare and temporary folders (pending uploads are
        abandoned: their commit never happens)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        with self._lock:
            spare, self._spare = self._spare, []
        for folder in spare:
            shutil.rmtree(folder, ignore_errors=True)
        if self._tmp_root is not None:
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            self._tmp_root = None


def _list_files(folder: Path) -> tuple[list[Path], bool]:
    """The files (and symlinks) below ``folder``, sorted, and whether it holds any sub-folder."""
    files: list[Path] = []
    has_dirs = False
    pending = [folder]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    has_dirs = True
                    pending.append(Path(entry.path))
                else:
                    files.append(Path(entry.path))
    return sorted(files), has_dirs


def _remove_orphans() -> None:
    """Removes the temporary folders of stagers whose process is gone (killed before cleaning up)."""
    root = Path(tempfile.gettempdir())
    for folder in root.glob(f"{_TMP_PREFIX}*"):
        pid = folder.name[len(_TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


