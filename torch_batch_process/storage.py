"""Storage: every byte the library stores goes through this module, on top of fsspec.

A :class:`Storage` is rooted at the job's storage path: a local path, ``file://``, ``memory://``,
``s3://bucket/prefix`` (s3fs), ``gs://bucket/prefix`` (gcsfs) or any other fsspec URL. Paths given
to its methods are relative to that root and use ``/``.

Writes of records are atomic: on a local filesystem the bytes go to a temporary file in the same
folder which is then renamed over the target (readers see the old or the new file, never half of
one, even after ``kill -9``); on object stores a record is a single PUT, which is atomic.
Transient object-store errors are retried with exponential backoff, a bounded number of times.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from torch_batch_process.errors import StorageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Which extra of this package installs the backend of a protocol.
_BACKEND_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}

_RETRY_ATTEMPTS = 5
_RETRY_BASE_DELAY_S = 0.2

TMP_MARKER = ".tmp-"


class Storage:
    """A folder on any fsspec filesystem, with atomic writes and clear errors.

    Args:
        url: local path or fsspec URL of the folder.
        storage_options: options for the fsspec filesystem (credentials, endpoint...). When not
            given, the filesystem reads its usual environment (e.g. ``AWS_ENDPOINT_URL``).
    """

    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        url = os.fspath(url)
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        self.protocol = protocol
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as exc:
            if _is_missing_backend(exc):
                extra = _BACKEND_EXTRAS.get(protocol)
                hint = (
                    f"pip install 'torch-batch-process[{extra}]'"
                    if extra
                    else f"install the fsspec implementation of the {protocol!r} protocol"
                )
                raise StorageError(
                    f"storage_path {url!r}: the filesystem backend of {protocol}:// is not installed; {hint}"
                ) from exc
            raise StorageError(f"storage_path {url!r} is not a valid fsspec URL: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - any backend error at construction
            raise StorageError(f"storage_path {url!r}: cannot open the filesystem: {exc}") from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.is_local = isinstance(fs, LocalFileSystem)
        if self.is_local:
            root = os.path.abspath(root)
            self.url = root
        else:
            root = root.rstrip("/")
            self.url = url.rstrip("/")
        self.root: str = root

    # ------------------------------------------------------------------ paths

    def path(self, rel: str) -> str:
        """Filesystem path of ``rel`` (relative to the root)."""
        if not rel:
            return self.root
        if self.is_local:
            return os.path.join(self.root, *rel.split("/"))
        return posixpath.join(self.root, rel)

    def url_of(self, rel: str = "") -> str:
        """User-facing URL of ``rel`` (a local path for local storage)."""
        if not rel:
            return self.url
        return self.path(rel) if self.is_local else f"{self.url}/{rel}"

    def local_path(self, rel: str) -> Path:
        """Local path of ``rel``; only for local storage."""
        assert self.is_local, "local_path() needs local storage"
        return Path(self.path(rel))

    # ------------------------------------------------------------------ reads

    def exists(self, rel: str) -> bool:
        """Whether a file or folder exists at ``rel``."""
        if self.is_local:
            return os.path.exists(self.path(rel))
        return self._call(f"check {rel!r}", lambda: self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        """Reads a whole file; ``FileNotFoundError`` when it does not exist."""
        if self.is_local:
            try:
                with open(self.path(rel), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise self._error(f"read {rel!r}", exc) from exc
        return self._call(f"read {rel!r}", lambda: self.fs.cat_file(self.path(rel)), missing_ok=False)

    def read_json(self, rel: str) -> Any:
        """Reads a JSON file; ``FileNotFoundError`` when missing, ``ValueError`` when not JSON."""
        return json.loads(self.read_bytes(rel).decode("utf-8"))

    def list(self, rel: str) -> list[str]:
        """Names of the entries of folder ``rel`` (empty when it does not exist)."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path(rel)))
            except FileNotFoundError:
                return []
            except NotADirectoryError:
                return []
            except OSError as exc:
                raise self._error(f"list {rel!r}", exc) from exc

        def _ls() -> list[str]:
            try:
                entries = self.fs.ls(self.path(rel), detail=False, refresh=True)
            except FileNotFoundError:
                return []
            base = self.path(rel).rstrip("/")
            names = []
            for entry in entries:
                entry = entry.rstrip("/")
                if entry == base:
                    continue
                names.append(posixpath.basename(entry))
            return sorted(set(names))

        return self._call(f"list {rel!r}", _ls)

    def walk_files(self, rel: str) -> Iterator[str]:
        """Yields the paths (relative to ``rel``) of every file below folder ``rel``."""
        if self.is_local:
            base = self.path(rel)
            for dirpath, _dirnames, filenames in os.walk(base):
                for name in filenames:
                    full = os.path.join(dirpath, name)
                    yield os.path.relpath(full, base).replace(os.sep, "/")
            return
        base = self.path(rel).rstrip("/")
        found = self._call(f"list {rel!r}", lambda: self.fs.find(base, withdirs=False))
        for full in found:
            yield full[len(base) + 1 :] if full.startswith(base + "/") else posixpath.basename(full)

    def size(self, rel: str) -> int:
        """Size in bytes of file ``rel``."""
        if self.is_local:
            return os.path.getsize(self.path(rel))
        return int(self._call(f"stat {rel!r}", lambda: self.fs.size(self.path(rel))))

    # ----------------------------------------------------------------- writes

    def makedirs(self, rel: str) -> None:
        """Creates folder ``rel`` and its parents (a no-op on object stores, which have no folders)."""
        if self.is_local:
            try:
                os.makedirs(self.path(rel), exist_ok=True)
            except OSError as exc:
                raise self._error(f"create folder {rel!r}", exc) from exc
        else:
            self._call(f"create folder {rel!r}", lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def write_bytes(self, rel: str, data: bytes, *, fsync: bool = False) -> None:
        """Writes a whole file atomically (temporary file + rename locally, one PUT remotely)."""
        if self.is_local:
            target = self.path(rel)
            tmp = f"{target}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
            try:
                try:
                    f = open(tmp, "wb")
                except FileNotFoundError:  # the folder is missing: make it (only then: a commit writes often)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    f = open(tmp, "wb")
                with f:
                    f.write(data)
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, target)
            except OSError as exc:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise self._error(f"write {rel!r}", exc) from exc
            return
        self._call(f"write {rel!r}", lambda: self.fs.pipe_file(self.path(rel), data))

    def write_json(self, rel: str, value: Any, *, fsync: bool = False) -> None:
        """Writes a JSON file atomically."""
        self.write_bytes(rel, json.dumps(value, indent=1, sort_keys=True).encode("utf-8"), fsync=fsync)

    def put_file(self, local_file: str | os.PathLike[str], rel: str) -> None:
        """Uploads (or, locally, moves) a local file to ``rel``, streaming it."""
        if self.is_local:
            target = self.path(rel)
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.move(os.fspath(local_file), target)
            except OSError as exc:
                raise self._error(f"write {rel!r}", exc) from exc
            return
        self._call(f"upload to {rel!r}", lambda: self.fs.put_file(os.fspath(local_file), self.path(rel)))

    def move(self, src: str, dst: str) -> None:
        """Moves file or folder ``src`` to ``dst``, merging folders; safe to repeat after a crash.

        Locally a folder whose target does not exist yet is moved with one atomic rename. On object
        stores each object is copied then deleted: a crash midway leaves some objects at both
        places, and repeating the move finishes it.
        """
        if self.is_local:
            self._move_local(self.path(src), self.path(dst))
            return
        for rel_file in list(self.walk_files(src)):
            source = posixpath.join(self.path(src), rel_file)
            target = posixpath.join(self.path(dst), rel_file)
            self._call(f"copy {src}/{rel_file}", lambda s=source, t=target: self.fs.copy(s, t))
            self._call(f"delete {src}/{rel_file}", lambda s=source: self.fs.rm_file(s))

    def _move_local(self, source: str, target: str) -> None:
        try:
            if not os.path.exists(source):
                return
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                os.rename(source, target)
                return
            if os.path.isdir(source):
                for name in os.listdir(source):
                    self._move_local(os.path.join(source, name), os.path.join(target, name))
                os.rmdir(source)
            else:
                os.replace(source, target)
        except OSError as exc:
            raise StorageError(f"cannot move {source!r} to {target!r}: {exc}") from exc

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Deletes a file, or a folder with ``recursive=True``; missing paths are fine."""
        path = self.path(rel)
        if self.is_local:
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
            return

        def _rm() -> None:
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass

        self._call(f"delete {rel!r}", _rm)

    # ---------------------------------------------------------------- helpers

    def _error(self, action: str, exc: BaseException) -> StorageError:
        return StorageError(f"storage {self.url!r}: cannot {action}: {_describe(exc)}")

    def _call(self, action: str, fn: Callable[[], T], *, missing_ok: bool = True) -> T:
        """Runs a remote operation, retrying transient errors with backoff, mapping the rest."""
        delay = _RETRY_BASE_DELAY_S
        for attempt in range(1, _RETRY_ATTEMPTS + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except Exception as exc:  # noqa: BLE001 - classify every backend error
                if attempt < _RETRY_ATTEMPTS and _is_transient(exc):
                    logger.warning(
                        "storage %s: %s failed (%s); retry %d/%d in %.1fs",
                        self.url,
                        action,
                        _describe(exc),
                        attempt,
                        _RETRY_ATTEMPTS - 1,
                        delay,
                    )
                    time.sleep(delay * (1 + random.random() / 2))
                    delay *= 2
                    continue
                raise self._error(action, exc) from exc
        raise AssertionError("unreachable")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, PermissionError):
        return f"permission denied ({exc})"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return f"read-only filesystem ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _is_missing_backend(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, ImportError) or "install" in text or "not available" in text or "unknown protocol" in text


_TRANSIENT_NAMES = (
    "timeout",
    "throttl",
    "slowdown",
    "slow down",
    "serviceunavailable",
    "service unavailable",
    "internalerror",
    "internal error",
    "connectionreset",
    "connection reset",
    "temporarily",
    "requesttimeout",
    "503",
    "500",
)


def _is_transient(exc: BaseException) -> bool:
    """Whether an object-store error is worth retrying (throttling, timeouts, 5xx, resets)."""
    if isinstance(exc, (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return any(name in text for name in _TRANSIENT_NAMES)
