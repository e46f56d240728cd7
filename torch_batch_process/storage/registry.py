"""Opening a storage: the backend for a URL (the factory above the interface of
:mod:`torch_batch_process.storage.base`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.local import LocalStorage
from torch_batch_process.storage.object_store import ObjectStorage
from torch_batch_process.storage.s3 import S3Storage
from torch_batch_process.storage.urls import check_storage_url

__all__ = ["check_storage_options", "open_storage"]

_BACKENDS: dict[str, type[ObjectStorage]] = {"s3": S3Storage, "s3a": S3Storage}
"""Object-store protocols with a backend of their own; any other fsspec protocol is an :class:`ObjectStorage`."""


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage rooted at ``url``: a local path or ``file://`` URL, or any other fsspec URL.

    Args:
        url: local path or fsspec URL of the folder.
        storage_options: options of the fsspec filesystem (credentials, endpoint...). When not given, the
            filesystem reads its usual environment (e.g. ``AWS_ENDPOINT_URL``).
    """
    text = check_storage_url(url)
    storage_options = check_storage_options(storage_options)
    protocol = text.split("://", 1)[0].lower() if "://" in text else "file"
    if protocol in ("file", "local"):
        return LocalStorage(text.split("://", 1)[1] if "://" in text else text)
    return _BACKENDS.get(protocol, ObjectStorage)(text, storage_options)


def check_storage_options(storage_options: Any, name: str = "storage_options") -> dict[str, Any] | None:
    """``storage_options`` as a dict (``None`` stays ``None``); raises :class:`InvalidArgumentError` naming ``name``
    for anything but a mapping (the one check of fsspec options: a call's, a read's, a source's)."""
    if storage_options is None:
        return None
    if not isinstance(storage_options, Mapping):
        raise InvalidArgumentError(
            f"{name} must be a dict of fsspec filesystem options or None, got {type(storage_options).__name__}"
        )
    return dict(storage_options)
