"""S3 storage (``s3://``, ``s3a://``): an object store with conditional writes and S3's own cheaper requests.

What differs from :class:`~torch_batch_process.storage.object_store.ObjectStorage`:

- **Lease**: every write of the job lease is conditional (``If-None-Match: *`` to create, ``If-Match: <etag>`` to
  renew or take over: :meth:`S3Storage.read_versioned`, :meth:`S3Storage.write_conditional`), so two jobs
  racing for it cannot both win (:mod:`torch_batch_process.jobstore.lease`);
- **Retries**: the retry loops of botocore and s3fs are turned off on the library's own filesystem instance, so
  the storage's retry policy (:func:`~torch_batch_process.storage.errors.with_retries`) is the only one;
- **Requests**: a read is one GET (no size probe first); a copy of up to 5 GiB is one ``CopyObject``; an upload
  larger than ``2 * UPLOAD_PART_BYTES`` is a multipart upload read part by part, holding at most
  ``UPLOAD_PART_BYTES * UPLOAD_PART_CONCURRENCY`` bytes in memory per file.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec

from torch_batch_process.storage.base import ConditionalWrites, ConditionFailed
from torch_batch_process.storage.errors import is_precondition_failed
from torch_batch_process.storage.object_store import ObjectStorage

__all__ = ["UPLOAD_PART_BYTES", "UPLOAD_PART_CONCURRENCY", "S3Storage"]

UPLOAD_PART_BYTES = 8 * 2**20
"""Part size of multipart uploads: a large output is streamed from disk."""
UPLOAD_PART_CONCURRENCY = 2
"""Parts in flight per file."""
_SIMPLE_COPY_BYTES = 5 * 2**30  # CopyObject's limit; larger objects take s3fs's multipart copy


class S3Storage(ObjectStorage):
    """A folder of an S3 bucket (see the module docstring)."""

    def _default_options(self, options: dict[str, Any]) -> dict[str, Any]:
        options = super()._default_options(options)
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})  # this storage retries, see the module docstring
        options["config_kwargs"] = config
        options.setdefault("skip_instance_cache", True)
        return options

    def _configure(self, fs: fsspec.AbstractFileSystem) -> None:
        if hasattr(fs, "retries"):
            fs.retries = 1  # our own instance (skip_instance_cache): the storage's _call is the retry policy
        _without_expect_continue(fs)

    def _cat(self, path: str) -> bytes:
        return self.fs.cat_file(path, max_concurrency=1)  # one GET, no size probe first

    def put_file(self, local_file: str | os.PathLike[str], rel: str) -> None:
        """Uploads (a copy: the local file stays): a file of up to ``2 * UPLOAD_PART_BYTES`` is one PUT; a larger one
        is a multipart upload read part by part."""
        source = os.fspath(local_file)
        upload = lambda: self.fs.put_file(  # noqa: E731
            source, self.path(rel), chunksize=UPLOAD_PART_BYTES, max_concurrency=UPLOAD_PART_CONCURRENCY
        )
        self._call(f"upload to {rel!r}", upload)

    def _copy_object(self, source: str, target: str, size: int) -> None:
        if size > _SIMPLE_COPY_BYTES:
            super()._copy_object(source, target, size)
            return
        src_bucket, _, src_key = source.partition("/")  # one request, no size probe
        dst_bucket, _, dst_key = target.partition("/")
        source_ref = {"Bucket": src_bucket, "Key": src_key}
        self.fs.call_s3("copy_object", Bucket=dst_bucket, Key=dst_key, CopySource=source_ref)

    # ------------------------------------------------------------ conditional writes

    def read_versioned(self, rel: str) -> tuple[bytes, str]:
        """Reads a file and its version tag (the ETag); ``FileNotFoundError`` when missing."""
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

        return self._call(f"read {rel!r}", _get)

    def write_conditional(self, rel: str, data: bytes, *, if_version: str | None) -> str:
        """Writes ``rel`` only if it is still at version ``if_version`` (``None``: only if absent).

        Returns the new version tag; raises :class:`~torch_batch_process.storage.base.ConditionFailed` when another
        writer won.
        """
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
            return self._call(f"write {rel!r}", _put, passthrough=(ConditionFailed,))
        except FileNotFoundError as exc:  # If-Match on an object deleted meanwhile
            raise ConditionFailed(str(exc)) from exc

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        full = self.path(rel)
        bucket, _, key = full.partition("/")
        return bucket, key

    def conditional_writes(self) -> ConditionalWrites:
        return self


def _without_expect_continue(fs: fsspec.AbstractFileSystem) -> None:
    """Makes ``fs``'s requests go without ``Expect: 100-continue``, so that an endpoint that stalls is a read
    timeout (then a retry, then a :class:`~torch_batch_process.storage.errors.StorageError`), never a hang.

    botocore asks for ``100 Continue`` before the body of every PUT whose body is file-like (uploads, and any PUT
    whose body its checksums wrap), and aiohttp waits for that answer with no timeout: an endpoint that accepts the
    connection and never answers (a stalled proxy or server) held a write forever, a job's lease renewal and its
    SIGTERM stop with it. Without the header the request is sent whole and s3fs's read timeout bounds the wait for
    the answer. The header only saves sending a body the server would refuse. The session is the filesystem's own,
    made here as s3fs would make it (a ``session=`` of the caller's is left as it is)."""
    if getattr(fs, "session", False) is not None:  # not s3fs, or the caller's own session
        return
    from aiobotocore.session import AioSession
    from botocore.handlers import add_expect_header

    session = AioSession(**getattr(fs, "kwargs", {}))
    session.unregister("before-call.s3", add_expect_header)
    fs.session = session
    fs._session_is_owned = True  # s3fs's: it may make a new one on an explicit refresh, as with its own

