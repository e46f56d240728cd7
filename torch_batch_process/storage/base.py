"""Storage: every byte the library stores goes through this module, on top of fsspec.

A :class:`Storage` is rooted at the job's storage path: a local path, ``file://``, ``memory://``,
``s3://bucket/prefix`` (s3fs), ``gs://bucket/prefix`` (gcsfs) or any other fsspec URL. Paths given
to its methods are relative to that root and use ``/``.

- **Options.** Credentials and endpoints come from the backend's usual environment
  (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``GOOGLE_APPLICATION_CREDENTIALS``...) or from
  ``storage_options`` (passed to the fsspec filesystem as keyword arguments). A URL whose backend is
  not installed is an error naming the extra to install (``pip install 'torch-batch-process[s3]'``).
- **Atomic writes.** A record is written whole or not at all: locally the bytes go to a temporary
  file in the same folder, are flushed to disk, and the file is renamed over the target (readers see
  the old or the new file, never part of one, even after ``kill -9`` or a power cut); on object
  stores a record is one PUT (uploads above the multipart threshold are a multipart upload, which
  also becomes visible whole, at its completion).
- **Fresh views.** Listings are never served from fsspec's listing cache (the job's own records are
  written by other processes too), and a filesystem created before a ``fork`` is not reused in the
  child.
- **Errors.** Every failure is a :class:`StorageError` naming the URL, the action and the cause
  (unreachable endpoint, missing bucket, permission denied, read-only filesystem...). Transient
  object-store errors (throttling, 5xx, timeouts, dropped connections) are retried with jittered
  exponential backoff, at most ``TBP_STORAGE_RETRIES`` attempts (default 5) and never past
  ``TBP_STORAGE_RETRY_S`` seconds (default 30) after the first one. On S3 the retry loops of
  botocore and s3fs are turned off (on the library's own filesystem instance), so this is the one
  policy; other backends may retry by themselves as well (gcsfs does).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from torch_batch_process.errors import StorageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Which extra of this package installs the backend of a protocol.
_BACKEND_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs"}

TMP_MARKER = ".tmp-"

# Part size and parts in flight per file for multipart uploads to S3: a large output is streamed from
# disk, holding at most UPLOAD_PART_BYTES * UPLOAD_PART_CONCURRENCY bytes in memory per file.
UPLOAD_PART_BYTES = 8 * 2**20
UPLOAD_PART_CONCURRENCY = 2
COPY_THREADS = 16
_S3_SIMPLE_COPY_BYTES = 5 * 2**30  # CopyObject's limit; larger objects take s3fs's multipart copy


class ConditionFailed(Exception):
    """A conditional write lost: the object changed (or appeared) since it was read."""


def retry_attempts() -> int:
    """Most attempts of one storage operation (``TBP_STORAGE_RETRIES``, default 5)."""
    return max(1, int(os.environ.get("TBP_STORAGE_RETRIES", "5")))


def retry_budget_s() -> float:
    """No retry starts later than this many seconds after the first attempt (``TBP_STORAGE_RETRY_S``)."""
    return float(os.environ.get("TBP_STORAGE_RETRY_S", "30"))


_RETRY_BASE_DELAY_S = 0.2
_RETRY_MAX_DELAY_S = 5.0


class Storage:
    """A folder on any fsspec filesystem, with atomic writes, bounded retries and clear errors.

    Args:
        url: local path or fsspec URL of the folder.
        storage_options: options of the fsspec filesystem (credentials, endpoint...). When not
            given, the filesystem reads its usual environment (e.g. ``AWS_ENDPOINT_URL``).
    """

    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
        url = os.fspath(url)
        self.protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
        self._given_url = url
        self._options = _default_options(self.protocol, dict(storage_options or {}))
        self._pid = os.getpid()
        self._fs, root = self._open()
        self.is_local = isinstance(self._fs, LocalFileSystem)
        if self.is_local:
            root = os.path.abspath(root)
            self.url = root
        else:
            root = root.rstrip("/")
            self.url = url.rstrip("/")
        self.root: str = root
        self.is_memory = self.protocol == "memory"
        self.supports_conditional_writes = self.protocol in ("s3", "s3a")
        self._memory_lock = threading.Lock()

    def _open(self) -> tuple[fsspec.AbstractFileSystem, str]:
        url = self._given_url
        try:
            fs, root = fsspec.core.url_to_fs(url, **self._options)
            if self.protocol in ("s3", "s3a") and hasattr(fs, "retries"):
                fs.retries = 1  # our own instance (skip_instance_cache): this module's _call is the retry policy
            return fs, root
        except (ImportError, ValueError) as exc:
            if _is_missing_backend(exc):
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
            raise StorageError(f"storage_path {url!r}: cannot open the filesystem: {_describe(exc)}") from exc

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

    # ------------------------------------------------------------- preflight

    def check(self) -> None:
        """Fails early and clearly when the storage cannot be read: missing bucket, unreachable
        endpoint, no permission, a file where the folder should be. Writes nothing (the job lock
        is the first write, and fails as clearly when the storage is read-only)."""
        if self.is_local:
            path = self.root
            while not os.path.exists(path) and os.path.dirname(path) != path:
                path = os.path.dirname(path)
            if not os.path.isdir(path):
                raise StorageError(f"storage_path {self.url!r}: {path!r} is a file, not a folder")
            if path == self.root and not os.access(path, os.R_OK | os.X_OK):
                raise StorageError(f"storage_path {self.url!r}: permission denied (cannot read the folder)")
            return
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
        return self._call(f"read {rel!r}", lambda: self._cat(self.path(rel)), missing_ok=False)

    def _cat(self, path: str) -> bytes:
        if self.protocol in ("s3", "s3a"):
            return self.fs.cat_file(path, max_concurrency=1)  # one GET, no size probe first
        return self.fs.cat_file(path)

    def read_json(self, rel: str) -> Any:
        """Reads a JSON file; ``FileNotFoundError`` when missing, ``ValueError`` when not JSON."""
        return json.loads(self.read_bytes(rel).decode("utf-8"))

    def list(self, rel: str) -> list[str]:
        """Names of the entries of folder ``rel`` (empty when it does not exist)."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path(rel)))
            except (FileNotFoundError, NotADirectoryError):
                return []
            except OSError as exc:
                raise self._error(f"list {rel or 'the storage path'!r}", exc) from exc

        def _ls() -> list[str]:
            base = self.path(rel).rstrip("/")
            try:
                entries = self.fs.ls(base, detail=False, refresh=True)
            except (FileNotFoundError, NotADirectoryError) as exc:
                if _is_missing_bucket(exc):
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

    def walk_files(self, rel: str) -> Iterator[str]:
        """Yields the paths (relative to ``rel``) of every file below folder ``rel``."""
        if self.is_local:
            base = self.path(rel)
            for dirpath, _dirnames, filenames in os.walk(base):
                for name in filenames:
                    full = os.path.join(dirpath, name)
                    yield os.path.relpath(full, base).replace(os.sep, "/")
            return
        yield from self._find_sizes(rel)

    def _find_sizes(self, rel: str) -> dict[str, int]:
        """Files below folder ``rel`` (remote): relative path -> size in bytes (one listing)."""
        base = self.path(rel).rstrip("/")

        def _find() -> dict[str, Any]:
            try:
                return dict(self.fs.find(base, withdirs=False, detail=True))
            except FileNotFoundError as exc:
                if _is_missing_bucket(exc):
                    raise
                return {}

        files = {}
        for full, info in self._call(f"list {rel!r}", _find).items():
            full = full.rstrip("/")
            for prefix in (base + "/", base.lstrip("/") + "/"):
                if full.startswith(prefix):
                    files[full[len(prefix) :]] = int(info.get("size") or 0)
                    break
        return files

    def size(self, rel: str) -> int:
        """Size in bytes of file ``rel``."""
        if self.is_local:
            return os.path.getsize(self.path(rel))
        return int(self._call(f"stat {rel!r}", lambda: self.fs.size(self.path(rel)), missing_ok=False))

    # ----------------------------------------------------------------- writes

    def makedirs(self, rel: str) -> None:
        """Creates folder ``rel`` and its parents (a no-op on object stores, which have no folders)."""
        if self.is_local:
            try:
                os.makedirs(self.path(rel), exist_ok=True)
            except OSError as exc:
                raise self._error(f"create folder {rel or 'the storage path'!r}", exc) from exc
        elif self.protocol not in _BUCKET_PROTOCOLS:
            self._call(f"create folder {rel!r}", lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def write_bytes(self, rel: str, data: bytes, *, fsync: bool = False) -> None:
        """Writes a whole file atomically (temporary file + rename locally, one PUT remotely).

        With ``fsync=True`` the file and its folder are flushed to disk before returning (local
        storage), so the write also survives a power cut, not only a killed process.
        """
        if self.is_local:
            target = self.path(rel)
            tmp = f"{target}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
            try:
                folder = os.path.dirname(target)
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
            return
        self._call(f"write {rel!r}", lambda: self.fs.pipe_file(self.path(rel), data))

    def append_bytes(self, rel: str, data: bytes) -> None:
        """Appends ``data`` to a local file with one ``write()`` on an ``O_APPEND`` descriptor, so a
        killed process leaves it whole or absent. Local storage only: objects cannot be appended to."""
        assert self.is_local, "append_bytes() needs local storage"
        path = self.path(rel)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._error(f"append to {rel!r}", exc) from exc

    def write_json(self, rel: str, value: Any, *, fsync: bool = False, compact: bool = False) -> None:
        """Writes a JSON file atomically; ``compact`` (one line) for frequent writes such as commit records.

        Indented output makes ``json`` fall back to its pure-Python encoder, several times slower.
        """
        text = json.dumps(value, separators=(",", ":"), sort_keys=True) if compact else json.dumps(value, indent=1, sort_keys=True)
        self.write_bytes(rel, text.encode("utf-8"), fsync=fsync)

    def put_file(self, local_file: str | os.PathLike[str], rel: str) -> None:
        """Uploads (or, locally, renames) a local file to ``rel``, streamed from disk.

        On S3 a file of up to ``2 * UPLOAD_PART_BYTES`` is one PUT; a larger one is a multipart
        upload read part by part, so memory stays bounded whatever the file's size.
        """
        if self.is_local:
            target = self.path(rel)
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.move(os.fspath(local_file), target)
            except OSError as exc:
                raise self._error(f"write {rel!r}", exc) from exc
            return
        source = os.fspath(local_file)
        if self.protocol in ("s3", "s3a"):
            upload = lambda: self.fs.put_file(  # noqa: E731
                source, self.path(rel), chunksize=UPLOAD_PART_BYTES, max_concurrency=UPLOAD_PART_CONCURRENCY
            )
        else:
            upload = lambda: self.fs.put_file(source, self.path(rel))  # noqa: E731
        self._call(f"upload to {rel!r}", upload)

    # ------------------------------------------------- conditional writes (leases)

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
                if _is_precondition_failed(exc):
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

        Locally a folder whose target does not exist yet is moved with one atomic rename. On object
        stores the objects are copied (concurrently, server-side) then deleted (in bulk): a crash
        midway leaves some objects at both places, and repeating the move finishes it.
        """
        if self.is_local:
            self._move_local(self.path(src), self.path(dst))
            return
        files = self._find_sizes(src)
        if not files:
            return

        def _copy(rel_file: str) -> None:
            source, target = posixpath.join(self.path(src), rel_file), posixpath.join(self.path(dst), rel_file)
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
        self.delete_files([posixpath.join(src, rel_file) for rel_file in files])

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
            raise StorageError(f"storage {self.url!r}: cannot move {source!r} to {target!r}: {_describe(exc)}") from exc

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
            except FileNotFoundError as exc:
                if _is_missing_bucket(exc):
                    raise

        self._call(f"delete {rel!r}", _rm)

    def delete_files(self, rels: list[str]) -> None:
        """Deletes files (one bulk request per 1000 on S3); missing ones are fine."""
        if not rels:
            return
        if self.is_local:
            for rel in rels:
                self.delete(rel)
            return
        paths = [self.path(rel) for rel in rels]

        def _rm() -> None:
            try:
                self.fs.rm(paths)
            except FileNotFoundError as exc:
                if _is_missing_bucket(exc):
                    raise

        self._call(f"delete {len(rels)} file(s)", _rm)

    # ---------------------------------------------------------------- helpers

    def _error(self, action: str, exc: BaseException) -> StorageError:
        return StorageError(f"storage {self.url!r}: cannot {action}: {_describe(exc)}")

    def _call(
        self,
        action: str,
        fn: Callable[[], T],
        *,
        missing_ok: bool = True,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        """Runs a remote operation, retrying transient errors with bounded backoff, mapping the rest.

        ``FileNotFoundError`` passes through (callers decide what a missing file means), except for a
        missing bucket, which is a :class:`StorageError`. So do the exception types in ``passthrough``.
        """
        attempts = retry_attempts()
        deadline = time.monotonic() + retry_budget_s()
        delay = _RETRY_BASE_DELAY_S
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except passthrough:
                raise
            except FileNotFoundError as exc:
                if _is_missing_bucket(exc):
                    bucket = self.root.split("/", 1)[0]
                    raise StorageError(
                        f"storage {self.url!r}: cannot {action}: the bucket {bucket!r} does not exist ({exc})"
                    ) from exc
                raise
            except StorageError:
                raise
            except Exception as exc:  # noqa: BLE001 - classify every backend error
                pause = min(delay, _RETRY_MAX_DELAY_S) * (0.5 + random.random())
                if attempt < attempts and _is_transient(exc) and time.monotonic() + pause < deadline:
                    logger.warning(
                        "storage %s: %s failed (%s); retry %d/%d in %.1fs",
                        self.url,
                        action,
                        _describe(exc),
                        attempt,
                        attempts - 1,
                        pause,
                    )
                    time.sleep(pause)
                    delay *= 2
                    continue
                tried = f" (after {attempt} attempts)" if attempt > 1 else ""
                raise StorageError(f"storage {self.url!r}: cannot {action}{tried}: {_describe(exc)}") from exc
        raise AssertionError("unreachable")


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


# ---------------------------------------------------------------- error classes


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _client_error(exc: BaseException) -> tuple[str, int] | None:
    """Error code and HTTP status of the object store's answer behind ``exc``, if any."""
    for cause in _causes(exc):
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response["Error"].get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code, status
    return None


def _is_missing_bucket(exc: BaseException) -> bool:
    answer = _client_error(exc)
    if answer is not None:
        return answer[0] == "NoSuchBucket"
    return "bucket does not exist" in str(exc).lower()


def _is_precondition_failed(exc: BaseException) -> bool:
    answer = _client_error(exc)
    return answer is not None and (answer[0] == "PreconditionFailed" or answer[1] == 412)


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionRefusedError"}


def _describe(exc: BaseException) -> str:
    """A short human cause for ``exc``: permission denied, missing bucket, unreachable..."""
    answer = _client_error(exc)
    if isinstance(exc, PermissionError) or (answer and answer[1] == 403):
        return f"permission denied ({exc})"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return f"read-only filesystem ({exc})"
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied ({exc})"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"no space left ({exc})"
    if _class_names(exc) & _UNREACHABLE:
        return f"cannot reach the storage endpoint ({type(exc).__name__}: {exc})"
    if answer and answer[1] >= 500:
        return f"the object store answered HTTP {answer[1]} {answer[0]} ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _is_missing_backend(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, ImportError) or "install" in text or "not available" in text or "unknown protocol" in text


_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "OperationAborted",
    "XAmzContentSHA256Mismatch",
}
_TRANSIENT_CLASSES = {
    # botocore
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "HTTPClientError",
    "ResponseStreamingError",
    "ResponseParserError",
    "IncompleteReadError",
    "IncompleteRead",
    # aiohttp (gcsfs, http)
    "ClientConnectionError",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
}
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE}
if hasattr(errno, "EREMOTEIO"):
    _TRANSIENT_ERRNOS.add(errno.EREMOTEIO)
_TRANSIENT_TEXT = ("throttl", "slow down", "service unavailable", "temporarily", "timed out", "connection reset")


def _is_transient(exc: BaseException) -> bool:
    """Whether an object-store error is worth retrying (throttling, timeouts, 5xx, dropped connections)."""
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    answer = _client_error(exc)
    if answer is not None:
        code, status = answer
        return code in _TRANSIENT_CODES or status >= 500 or status in (408, 429)
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if any(_class_names(cause) & _TRANSIENT_CLASSES for cause in _causes(exc)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return any(name in text for name in _TRANSIENT_TEXT)
