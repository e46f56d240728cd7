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
- **Lock**: a heartbeat lease (:class:`~torch_batch_process.storage.lease.LeaseJobLock`), with conditional
  writes on S3 (:meth:`ObjectStorage.read_versioned`, :meth:`ObjectStorage.write_conditional`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import fsspec

from torch_batch_process.errors import StorageError
from torch_batch_process.storage.base import FileSink, MirroredFolder, Storage
from torch_batch_process.storage.errors import (
    describe,
    is_missing_backend,
    is_missing_bucket,
    is_precondition_failed,
    with_retries,
)
from torch_batch_process.storage.scratch import AppendedFiles, LocalScratch
from torch_batch_process.storage.uploads import UploadedFolder, UploadSink

if TYPE_CHECKING:
    from torch_batch_process.storage.lock import JobLock

__all__ = ["ConditionFailed", "ObjectStorage"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Which extra of this package installs the backend of a protocol.
_BACKEND_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs"}

# Part size and parts in flight per file for multipart uploads to S3: a large output is streamed from
# disk, holding at most UPLOAD_PART_BYTES * UPLOAD_PART_CONCURRENCY bytes in memory per file.
UPLOAD_PART_BYTES = 8 * 2**20
UPLOAD_PART_CONCURRENCY = 2
COPY_THREADS = 16
_S3_SIMPLE_COPY_BYTES = 5 * 2**30  # CopyObject's limit; larger objects take s3fs's multipart copy


class ConditionFailed(Exception):
    """A conditional write lost: the object changed (or appeared) since it was read."""


class ObjectStorage(Storage):
    """A folder of an fsspec filesystem that is not local (see the module docstring)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.protocol = url.split("://", 1)[0].lower()
        self._given_url = url
        self._options = _default_options(self.protocol, dict(storage_options or {}))
        self._pid = os.getpid()
        self._fs, root = self._open()
        self.root: str = root.rstrip("/")
        self.url = url.rstrip("/")
        self.supports_conditional_writes = self.protocol in ("s3", "s3a")
        self._appended = AppendedFiles(self.read_bytes, self.write_bytes)
        self._scratch = LocalScratch()

    def _open(self) -> tuple[fsspec.AbstractFileSystem, str]:
        url = self._given_url
        try:
            fs, root = fsspec.core.url_to_fs(url, **self._options)
            if self.protocol in ("s3", "s3a") and hasattr(fs, "retries"):
                fs.retries = 1  # our own instance (skip_instance_cache): this module's _call is the retry policy
            return fs, root
        except (ImportError, ValueError) as exc:
            if is_missing_backend(exc):
                extra = _BACKEND_EXTRAS.get(self.protocol)
                hint = (
                    f"pip install 'torch-batch-process[{extra}]'"
                    if extra
                    else f"install the fsspec implementation of the {self.protocol!r} protocol"
                )
                raise StorageError(
                    f"storage_path {url!r}: the filesystem backend of {self.protocol}:// is not installed; {hint}"
                ) from exc
            raise StorageError(f"storage_path {url!r} is not a valid fsspec URL: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - any backend error at construction
            raise StorageError(f"storage_path {url!r}: cannot open the filesystem: {describe(exc)}") from exc

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
        return StorageError(f"storage {self.url!r}: cannot {action}: {describe(exc)}")

    # ------------------------------------------------------------------ reads

    def check(self) -> None:
        if self.protocol in _BUCKET_PROTOCOLS:
            bucket = self.root.split("/", 1)[0]
            try:
                self._call("open the bucket", lambda: self.fs.info(bucket), missing_ok=False)
            except FileNotFoundError as exc:
                raise StorageError(
                    f"storage_path {self.url!r}: the bucket {bucket!r} does not exist (or is not visible with these "
                    "credentials); create it first or fix the URL"
                ) from exc
        self.list("")  # reachability and the permission to list

    def exists(self, rel: str) -> bool:
        return self._call(f"check {rel!r}", lambda: self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return self._call(f"read {rel!r}", lambda: self._cat(self.path(rel)), missing_ok=False)

    def _cat(self, path: str) -> bytes:
        if self.protocol in ("s3", "s3a"):
            return self.fs.cat_file(path, max_concurrency=1)  # one GET, no size probe first
        return self.fs.cat_file(path)

    def open_input(self, rel: str) -> BinaryIO:
        return self._call(f"open {rel!r}", lambda: self.fs.open(self.path(rel), "rb"), missing_ok=False)

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
        """Uploads (a copy: the local file stays). On S3 a file of up to ``2 * UPLOAD_PART_BYTES`` is one
        PUT; a larger one is a multipart upload read part by part."""
        source = os.fspath(local_file)
        if self.protocol in ("s3", "s3a"):
            upload = lambda: self.fs.put_file(  # noqa: E731
                source, self.path(rel), chunksize=UPLOAD_PART_BYTES, max_concurrency=UPLOAD_PART_CONCURRENCY
            )
        else:
            upload = lambda: self.fs.put_file(source, self.path(rel))  # noqa: E731
        self._call(f"upload to {rel!r}", upload)

    def read_versioned(self, rel: str) -> tuple[bytes, str]:
        """Reads a file and its version tag (S3: the ETag); ``FileNotFoundError`` when missing.

        Only where :attr:`supports_conditional_writes`.
        """
        if not self.supports_conditional_writes:
            raise NotImplementedError(f"{self.protocol}:// has no conditional writes")
        bucket, key = self._bucket_key(rel)

        def _get() -> tuple[bytes, str]:
            from fsspec.asyn import sync

            async def _read() -> tuple[bytes, str]:
                response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
                try:
                    return await response["Body"].read(), response["ETag"]
                finally:
                    response["Body"].close()

            return sync(self.fs.loop, _read)

        return self._call(f"read {rel!r}", _get, missing_ok=False)

    def write_conditional(self, rel: str, data: bytes, *, if_version: str | None) -> str:
        """Writes ``rel`` only if it is still at version ``if_version`` (``None``: only if absent).

        Returns the new version tag; raises :class:`ConditionFailed` when another writer won.
        Only where :attr:`supports_conditional_writes`.
        """
        if not self.supports_conditional_writes:
            raise NotImplementedError(f"{self.protocol}:// has no conditional writes")
        bucket, key = self._bucket_key(rel)
        condition = {"IfNoneMatch": "*"} if if_version is None else {"IfMatch": if_version}

        def _put() -> str:
            try:
                response = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
            except (OSError, FileNotFoundError) as exc:
                if is_precondition_failed(exc):
                    raise ConditionFailed(str(exc)) from exc
                raise
            return response["ETag"]

        try:
            return self._call(f"write {rel!r}", _put, missing_ok=False, passthrough=(ConditionFailed,))
        except FileNotFoundError as exc:  # If-Match on an object deleted meanwhile
            raise ConditionFailed(str(exc)) from exc

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        full = self.path(rel)
        bucket, _, key = full.partition("/")
        return bucket, key

    def _s3_copy(self, source: str, target: str) -> None:
        src_bucket, _, src_key = source.partition("/")
        dst_bucket, _, dst_key = target.partition("/")
        source_ref = {"Bucket": src_bucket, "Key": src_key}
        self.fs.call_s3("copy_object", Bucket=dst_bucket, Key=dst_key, CopySource=source_ref)

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
            if self.protocol in ("s3", "s3a") and files[rel_file] <= _S3_SIMPLE_COPY_BYTES:
                copy = lambda: self._s3_copy(source, target)  # noqa: E731 - one request, no size probe
            else:
                copy = lambda: self.fs.copy(source, target)  # noqa: E731
            self._call(f"copy {src}/{rel_file} to {dst}/", copy, missing_ok=False)

        if len(files) == 1:
            _copy(next(iter(files)))
        else:  # concurrent server-side copies, each retried on its own
            with ThreadPoolExecutor(max_workers=min(COPY_THREADS, len(files)), thread_name_prefix="tbp-copy") as pool:
                for future in [pool.submit(_copy, rel_file) for rel_file in files]:
                    future.result()
        self.delete_files([_below(src, rel_file) for rel_file in files])
        self.remove_empty_folder(src)

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        path = self.path(rel)

        def _rm() -> None:
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError as exc:
                if is_missing_bucket(exc):
                    raise

        self._call(f"delete {rel!r}", _rm)

    def delete_files(self, rels: list[str]) -> None:
        """One bulk request per 1000 files on S3."""
        if not rels:
            return
        paths = [self.path(rel) for rel in rels]

        def _rm() -> None:
            try:
                self.fs.rm(paths)
            except FileNotFoundError as exc:
                if is_missing_bucket(exc):
                    raise

        self._call(f"delete {len(rels)} file(s)", _rm)

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

    def scratch_folder(self, name: str) -> Path:
        return self._scratch.folder(name)

    def scratch_root(self) -> Path:
        """This process's local temporary folder (see :class:`~torch_batch_process.storage.scratch.LocalScratch`)."""
        return self._scratch.root()

    def file_sink(self) -> FileSink:
        return UploadSink(self)

    def mirrored_folder(self, rel: str, name: str) -> MirroredFolder:
        return UploadedFolder(self, rel, LocalScratch.mirror_path(name))

    def job_lock(self) -> JobLock:
        from torch_batch_process.storage.lease import LeaseJobLock

        return LeaseJobLock(self)

    def lock_holder(self) -> tuple[bool | None, dict[str, Any] | None]:
        from torch_batch_process.storage.lease import LeaseJobLock

        return LeaseJobLock.holder(self)

    def close(self) -> None:
        self._appended.close()
        self._scratch.close()

    # ---------------------------------------------------------------- helpers

    def _call(
        self,
        action: str,
        fn: Callable[[], T],
        *,
        missing_ok: bool = True,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        """Runs a remote operation with this storage's retry policy
        (:func:`~torch_batch_process.storage.errors.with_retries`)."""
        return with_retries(self.url, self.root.split("/", 1)[0], action, fn, passthrough=passthrough)


def _default_options(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """The library's defaults for a backend, under the user's explicit options."""
    if protocol in _BUCKET_PROTOCOLS:
        options.setdefault("use_listings_cache", False)
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})  # this module retries, see its docstring
        options["config_kwargs"] = config
        options.setdefault("skip_instance_cache", True)
    return options


def _below(folder: str, rel_file: str) -> str:
    """``folder/rel_file``; ``folder`` itself for ``""`` (a move of one file)."""
    return posixpath.join(folder, rel_file) if rel_file else folder
