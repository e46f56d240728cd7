"""Object-store storage: every fsspec URL that is not a local folder (``s3://``, ``gs://``, ``memory://``...).

- **Atomic writes**: a file is one PUT (uploads above the multipart threshold are a multipart upload, which
  also becomes visible whole, at its completion).
- **Fresh views**: listings are never served from fsspec's listing cache (the job's own records are written
  by other processes too), and a filesystem created before a ``fork`` is not reused in the child.
- **Retries**: transient errors are retried with bounded backoff (:mod:`torch_batch_process.storage.errors`).
  On S3 the retry loops of botocore and s3fs are turned off on the library's own filesystem instance, so
  this is the one policy; other backends may retry by themselves as well (gcsfs does).
- **Files in**: output files are uploaded by background threads, streamed from disk (a large file is a
  multipart upload holding at most ``UPLOAD_PART_BYTES * UPLOAD_PART_CONCURRENCY`` bytes in memory).
- **Appends**: objects cannot be appended to, so the appender keeps a local copy of the file and uploads
  it whole, in one atomic PUT, at each append (:mod:`torch_batch_process.storage.scratch`, with the other
  local temporary folders).
- **No local paths, no locks**: the stored job holds a heartbeat lease instead
  (:class:`~torch_batch_process.jobstore.lease.LeaseJobLock`).

S3 is a subclass (:class:`~torch_batch_process.storage.s3.S3Storage`): conditional lease writes and S3's own
requests; this class holds what every object store shares.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import fsspec

from torch_batch_process.errors import StorageError
from torch_batch_process.storage.base import FileSink, MirroredFolder, Storage
from torch_batch_process.storage.errors import (
    describe,
    is_missing_backend,
    is_missing_bucket,
    missing_backend_hint,
    storage_error,
    with_retries,
)
from torch_batch_process.storage.scratch import AppendedFiles, LocalScratch
from torch_batch_process.storage.uploads import UploadedFolder, UploadSink

__all__ = ["COPY_THREADS", "ObjectStorage"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs"}

COPY_THREADS = 16

_PATTERN_CHARACTERS = re.compile(r"[*?\[]")
"""What fsspec's ``copy``/``rm`` read as a glob pattern in a path (``pred[0].pt``, ``s3://bucket/exp[1]``): paths with
one are removed and copied one by one, by name (see :meth:`ObjectStorage.delete_files`)."""


class ObjectStorage(Storage):
    """A folder of an fsspec filesystem that is not local (see the module docstring)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.protocol = url.split("://", 1)[0].lower()
        self._given_url = url
        self._options = self._default_options(dict(storage_options or {}))
        self._pid = os.getpid()
        self._fs, root = self._open()
        self.root: str = root.rstrip("/")
        self.url = url.rstrip("/")
        self._appended = AppendedFiles(self.read_bytes, self.write_bytes)
        self._scratch = LocalScratch()

    def _open(self) -> tuple[fsspec.AbstractFileSystem, str]:
        url = self._given_url
        try:
            fs, root = fsspec.core.url_to_fs(url, **self._options)
            self._configure(fs)
            return fs, root
        except (ImportError, ValueError) as exc:
            if is_missing_backend(exc):
                raise StorageError(
                    f"storage_path {url!r}: the filesystem backend of {self.protocol}:// is not installed; "
                    f"{missing_backend_hint(self.protocol)}"
                ) from exc
            raise StorageError(f"storage_path {url!r} is not a valid fsspec URL: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - any backend error at construction
            raise StorageError(f"storage_path {url!r}: cannot open the filesystem: {describe(exc)}") from exc

    def _default_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The library's defaults for this backend, under the user's explicit ``options``."""
        if self.protocol in _BUCKET_PROTOCOLS:
            options.setdefault("use_listings_cache", False)
        return options

    def _configure(self, fs: fsspec.AbstractFileSystem) -> None:
        """Sets up a filesystem just created (a backend's own settings)."""

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem; re-created in a forked child (the parent's one holds its event loop)."""
        if os.getpid() != self._pid:
            self._fs, _ = self._open()
            self._pid = os.getpid()
        return self._fs

    # ------------------------------------------------------------------ paths

    def path(self, rel: str) -> str:
        """Filesystem path of ``rel`` (relative to the root)."""
        return posixpath.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def _error(self, action: str, exc: BaseException) -> StorageError:
        return storage_error(self.url, action, exc)

    # ------------------------------------------------------------------ reads

    def check(self) -> None:
        if self.protocol in _BUCKET_PROTOCOLS:
            bucket = self.root.split("/", 1)[0]
            try:
                self._call("open the bucket", lambda: self.fs.info(bucket))
            except FileNotFoundError as exc:
                raise StorageError(
                    f"storage_path {self.url!r}: the bucket {bucket!r} does not exist (or is not visible with these "
                    "credentials); create it first or fix the URL"
                ) from exc
        self.list("")  # reachability and the permission to list

    def exists(self, rel: str) -> bool:
        return self._call(f"check {rel!r}", lambda: self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return self._call(f"read {rel!r}", lambda: self._cat(self.path(rel)))

    def _cat(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def open_input(self, rel: str) -> BinaryIO:
        return self._call(f"open {rel!r}", lambda: self.fs.open(self.path(rel), "rb"))

    def list(self, rel: str) -> list[str]:
        def _ls() -> list[str]:
            base = self.path(rel).rstrip("/")
            try:
                entries = self.fs.ls(base, detail=False, refresh=True)
            except (FileNotFoundError, NotADirectoryError) as exc:
                if is_missing_bucket(exc):
                    raise
                return []
            names = []
            for entry in entries:
                entry = entry.rstrip("/")
                if entry == base or entry == base.lstrip("/"):
                    continue
                names.append(posixpath.basename(entry))
            return sorted(set(names))

        return self._call(f"list {rel or 'the storage path'!r}", _ls)

    def _find_sizes(self, rel: str) -> dict[str, int]:
        """Files below folder ``rel`` (remote): relative path -> size in bytes (one listing); ``{"": size}`` when
        ``rel`` is a file."""
        base = self.path(rel).rstrip("/")

        def _find() -> dict[str, Any]:
            try:
                return dict(self.fs.find(base, withdirs=False, detail=True))
            except FileNotFoundError as exc:
                if is_missing_bucket(exc):
                    raise
                return {}

        files = {}
        for full, info in self._call(f"list {rel!r}", _find).items():
            full = full.rstrip("/")
            if full in (base, base.lstrip("/")):
                files[""] = int(info.get("size") or 0)
                continue
            for prefix in (base + "/", base.lstrip("/") + "/"):
                if full.startswith(prefix):
                    files[full[len(prefix) :]] = int(info.get("size") or 0)
                    break
        return files

    # ----------------------------------------------------------------- writes

    def write_bytes(self, rel: str, data: bytes, *, fsync: bool = False) -> None:
        self._call(f"write {rel!r}", lambda: self.fs.pipe_file(self.path(rel), data))

    def append(self, rel: str, data: bytes) -> None:
        self._appended.append(rel, data)

    def put_file(self, local_file: str | os.PathLike[str], rel: str) -> None:
        """Uploads (a copy: the local file stays)."""
        source = os.fspath(local_file)
        self._call(f"upload to {rel!r}", lambda: self.fs.put_file(source, self.path(rel)))

    def move(self, src: str, dst: str) -> None:
        """Moves file or folder ``src`` to ``dst``, merging folders; safe to repeat after a crash.

        The objects are copied (concurrently, server-side) then deleted (in bulk): a crash midway leaves
        some objects at both places, and repeating the move finishes it.
        """
        files = self._find_sizes(src)
        if not files:
            return

        def _copy(rel_file: str) -> None:
            source, target = _below(self.path(src), rel_file), _below(self.path(dst), rel_file)
            size = files[rel_file]
            copy = lambda: self._copy_object(source, target, size)  # noqa: E731
            self._call(f"copy {src}/{rel_file} to {dst}/", copy)

        if len(files) == 1:
            _copy(next(iter(files)))
        else:  # concurrent server-side copies, each retried on its own
            with ThreadPoolExecutor(max_workers=min(COPY_THREADS, len(files)), thread_name_prefix="tbp-copy") as pool:
                for future in [pool.submit(_copy, rel_file) for rel_file in files]:
                    future.result()
        self.delete_files([_below(src, rel_file) for rel_file in files])
        self.remove_empty_folder(src)

    def _copy_object(self, source: str, target: str, size: int) -> None:
        """Copies one object (filesystem paths) of ``size`` bytes, server-side where the backend can; by name
        (``copy()`` would read ``[ ] * ?`` in the name as a pattern)."""
        self.fs.cp_file(source, target)

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        path = self.path(rel)
        if _PATTERN_CHARACTERS.search(path):  # fsspec's rm() would delete what the path matches as a pattern
            files = self._find_sizes(rel) if recursive else {"": 0}
            self.delete_files([_below(rel, rel_file) for rel_file in files])
            if recursive:
                self.remove_empty_folder(rel)
            return
        self._call(f"delete {rel!r}", lambda: self._rm_missing_ok(lambda p: self.fs.rm(p, recursive=recursive), path))

    def delete_files(self, rels: list[str]) -> None:
        """One bulk request per 1000 files on S3; a file whose path holds ``[ ] * ?`` is deleted on its own, by name
        (fsspec's ``rm()`` reads such a path as a glob pattern: it deleted what the pattern matched, another job's
        files under ``s3://bucket/exp1`` for ``s3://bucket/exp[1]``, and left the file itself)."""
        paths = [self.path(rel) for rel in rels]
        plain = [path for path in paths if not _PATTERN_CHARACTERS.search(path)]
        if plain:
            self._call(f"delete {len(plain)} file(s)", lambda: self._rm_missing_ok(self.fs.rm, plain))
        for path in paths:
            if _PATTERN_CHARACTERS.search(path):
                self._call(f"delete {path!r}", lambda path=path: self._rm_missing_ok(self.fs.rm_file, path))

    @staticmethod
    def _rm_missing_ok(remove: Callable[[Any], None], paths: Any) -> None:
        """``remove(paths)``; files already gone are fine (a repeated move), a missing bucket is not."""
        try:
            remove(paths)
        except FileNotFoundError as exc:
            if is_missing_bucket(exc):
                raise

    def remove_empty_folder(self, rel: str) -> None:
        """Object stores have no folders, but ``memory://`` keeps them after their files move (a published stage
        would look still staged): there, the empty folders below ``rel`` go, deepest first."""
        if getattr(self.fs, "pseudo_dirs", None) is None:
            return
        base = self.path(rel)
        below = self.fs.find(base, withdirs=True, detail=True) if self.fs.exists(base) else {}
        for path in [*sorted((p for p, info in below.items() if info["type"] == "directory"), key=len)[::-1], base]:
            with contextlib.suppress(OSError):  # not empty, or gone already
                self.fs.rmdir(path)

    # ------------------------------------------- what differs between backends

    def scratch_folder(self, under: str, name: str) -> Path:
        return self._scratch.folder(name)

    def scratch_root(self) -> Path:
        """This process's local temporary folder (see :class:`~torch_batch_process.storage.scratch.LocalScratch`)."""
        return self._scratch.root()

    def file_sink(self) -> FileSink:
        return UploadSink(self, self.scratch_root)

    def mirrored_folder(self, rel: str, name: str) -> MirroredFolder:
        return UploadedFolder(self, rel, LocalScratch.mirror_path(name))

    def close(self) -> None:
        self._appended.close()
        self._scratch.close()

    # ---------------------------------------------------------------- helpers

    def _call(
        self,
        action: str,
        fn: Callable[[], T],
        *,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        """Runs a remote operation with this storage's retry policy
        (:func:`~torch_batch_process.storage.errors.with_retries`)."""
        return with_retries(self.url, self.root.split("/", 1)[0], action, fn, passthrough=passthrough)


def _below(folder: str, rel_file: str) -> str:
    """``folder/rel_file``; ``folder`` itself for ``""`` (a move of one file)."""
    return posixpath.join(folder, rel_file) if rel_file else folder
