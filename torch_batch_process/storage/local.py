"""Local storage: a folder on a local or network-mounted filesystem (plain paths and ``file://`` URLs).

- **Atomic writes**: bytes go to a temporary file in the same folder, are flushed to disk when asked, and
  the file is renamed over the target, so readers see the old or the new file even after ``kill -9`` or a
  power cut.
- **Appends**: one ``write()`` on an ``O_APPEND`` descriptor, so a killed process leaves a line whole or
  absent. A last line without its newline (a file cut off by damage or a machine's crash) is dropped before
  this process's first append to the file, so that new lines never join it.
- **Files in**: output files are written in scratch folders inside the storage and renamed into place
  (no copy, whatever their size).
- **Local paths**: a file can be appended in place or locked by the OS (the stored job's lock,
  :class:`~torch_batch_process.jobstore.job_lock.FileJobLock`, released by the kernel when the holder dies).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import BinaryIO

from torch_batch_process.errors import StorageError
from torch_batch_process.storage.base import TMP_MARKER, FileSink, MirroredFolder, Storage
from torch_batch_process.storage.errors import NotAFileError, describe, storage_error

__all__ = ["LocalStorage"]

logger = logging.getLogger(__name__)



class LocalStorage(Storage):
    """A local folder (see the module docstring)."""

    protocol = "file"
    moves_are_renames = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(path))
        self.url = self.root
        self._appended: set[str] = set()  # files whose last line this process checked (append)

    # ------------------------------------------------------------------ paths

    def path(self, rel: str) -> str:
        """Filesystem path of ``rel``."""
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def url_of(self, rel: str = "") -> str:
        return self.path(rel)

    def _error(self, action: str, exc: BaseException) -> StorageError:
        return storage_error(self.url, action, exc)

    # ------------------------------------------------------------------ reads

    def check(self) -> None:
        path = self.root
        while not os.path.exists(path) and os.path.dirname(path) != path:
            path = os.path.dirname(path)
        if not os.path.isdir(path):
            raise StorageError(f"storage_path {self.url!r}: {path!r} is a file, not a folder")
        if path == self.root and not os.access(path, os.R_OK | os.X_OK):
            raise StorageError(f"storage_path {self.url!r}: permission denied (cannot read the folder)")

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        try:
            with _open_regular(self.path(rel)) as f:
                return f.read()
        except (FileNotFoundError, NotAFileError):
            raise
        except OSError as exc:
            raise self._error(f"read {rel!r}", exc) from exc

    def open_input(self, rel: str) -> BinaryIO:
        try:
            return _open_regular(self.path(rel))
        except (FileNotFoundError, NotAFileError):
            raise
        except OSError as exc:
            raise self._error(f"open {rel!r}", exc) from exc

    def list(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise self._error(f"list {rel or 'the storage path'!r}", exc) from exc

    # ----------------------------------------------------------------- writes

    def makedirs(self, rel: str) -> None:
        """Creates folder ``rel`` and its parents."""
        try:
            os.makedirs(self.path(rel), exist_ok=True)
        except OSError as exc:
            raise self._error(f"create folder {rel or 'the storage path'!r}", exc) from exc

    def write_bytes(self, rel: str, data: bytes, *, fsync: bool = False) -> None:
        target = self.path(rel)
        tmp = f"{target}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
        folder = os.path.dirname(target)
        try:
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:  # the folder is missing: make it (only then: a commit writes often)
                os.makedirs(folder, exist_ok=True)
                f = open(tmp, "wb")
            with f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, target)
            if fsync:
                _fsync_dir(folder)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise self._error(f"write {rel!r}", exc) from exc

    def append(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if path not in self._appended:
                    _drop_partial_line(fd, rel)
                    self._appended.add(path)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._error(f"append to {rel!r}", exc) from exc

    def put_file(self, local_file: str | os.PathLike[str], rel: str) -> None:
        target = self.path(rel)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.move(os.fspath(local_file), target)
        except OSError as exc:
            raise self._error(f"write {rel!r}", exc) from exc

    def move(self, src: str, dst: str) -> None:
        """A folder whose target does not exist yet is moved with one atomic rename."""
        self._move(self.path(src), self.path(dst))

    def _move(self, source: str, target: str) -> None:
        try:
            os.rename(source, target)  # the common case: one syscall (a target that is an empty folder is replaced)
            return
        except OSError:
            pass  # missing source or target folder, a non-empty target folder: the general path below
        try:
            if not os.path.exists(source):
                return
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                os.rename(source, target)
                return
            if os.path.isdir(source):
                for name in os.listdir(source):
                    self._move(os.path.join(source, name), os.path.join(target, name))
                os.rmdir(source)
            else:
                os.replace(source, target)
        except OSError as exc:
            raise StorageError(f"storage {self.url!r}: cannot move {source!r} to {target!r}: {describe(exc)}") from exc

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        path = self.path(rel)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                if recursive:
                    shutil.rmtree(path)
                else:
                    os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error(f"delete {rel!r}", exc) from exc

    def delete_files(self, rels: list[str]) -> None:
        for rel in rels:
            self.delete(rel)

    def remove_empty_folder(self, rel: str) -> None:
        try:
            os.rmdir(self.path(rel))
        except OSError:  # missing, or not empty (yet): nothing to do
            pass

    # ------------------------------------------- what differs between backends

    def scratch_folder(self, under: str, name: str) -> Path:
        folder = Path(self.path(f"{under}/{name}-{uuid.uuid4().hex[:10]}"))
        try:
            folder.mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            raise self._error("create a scratch folder", exc) from exc
        return folder

    def file_sink(self) -> FileSink:
        return _RenameSink(self)

    def local_path(self, rel: str) -> str | None:
        return self.path(rel)

    def mirrored_folder(self, rel: str, name: str) -> MirroredFolder:
        return _SameFolder(Path(self.path(rel)))


class _RenameSink(FileSink):
    """Files move into place at once with a rename (scratch folders are on the same filesystem)."""

    def __init__(self, storage: LocalStorage) -> None:
        self._storage = storage
        self._made: dict[str, str] = {}  # parent folders known to exist (rel -> path): making folders costs syscalls

    def add(self, local_file: str | os.PathLike[str], rel: str) -> None:
        parent_rel, _, name = rel.rpartition("/")
        parent = self._made.get(parent_rel)
        try:
            if parent is None:
                parent = self._storage.path(parent_rel)
                os.makedirs(parent, exist_ok=True)
                self._made[parent_rel] = parent
            os.rename(local_file, parent + os.sep + name)
        except OSError as exc:
            raise self._storage._error(f"write {rel!r}", exc) from exc

    def flush(self) -> None:
        self._made.clear()  # the next commit's folders are new

    def close(self) -> None:
        pass


class _SameFolder(MirroredFolder):
    def __init__(self, path: Path) -> None:
        self.path = path


def _drop_partial_line(fd: int, rel: str) -> None:
    """Truncates the open file after its last newline when its last line has none (see the module docstring)."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return  # whole lines
    keep, end = 0, size - 1
    while end > 0:
        start = max(0, end - 65536)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            keep = start + cut + 1
            break
        end = start
    logger.warning("%s: dropping its last %d bytes, a line cut off (damaged storage or a crash)", rel, size - keep)
    os.ftruncate(fd, keep)


def _open_regular(path: str) -> BinaryIO:
    """Opens a file for reading; something else in its place raises :class:`NotAFileError` at once (a plain
    ``open`` of a FIFO would block until a writer comes)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise NotAFileError(errno.EISDIR, "a folder, not a file", path)
        if not stat.S_ISREG(mode):
            raise NotAFileError(errno.EINVAL, "not a regular file (a FIFO, socket or device)", path)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
