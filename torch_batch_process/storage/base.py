"""The storage interface: every byte the library stores goes through a :class:`Storage`.

A storage is rooted at the job's storage path; paths given to its methods are relative to that root and
use ``/``. :func:`~torch_batch_process.storage.registry.open_storage` picks the backend, like fsspec's
one-interface-many-backends:

- :class:`~torch_batch_process.storage.local.LocalStorage` for a local (or network-mounted) folder
  (plain paths and ``file://``): atomic writes by temporary file + rename + fsync, ``O_APPEND`` appends,
  an OS file lock, files staged by rename (no copy);
- :class:`~torch_batch_process.storage.object_store.ObjectStorage` for every other fsspec URL
  (``gs://``, ``memory://``...): one PUT per write, bounded retries of transient errors, a heartbeat lease,
  files uploaded in the background;
- :class:`~torch_batch_process.storage.s3.S3Storage` for ``s3://``: an object store whose lease writes are
  conditional, with S3's own requests where they are cheaper (one GET, one CopyObject, multipart uploads).

Callers never ask which backend they have: what differs (how a file gets in, whether a file can be written
conditionally, where a folder that is written locally lives) is a method of the backend. What the stored job makes
of them (its job lock, its names) is the stored job's (:mod:`torch_batch_process.jobstore`), never a method here.
Credentials and endpoints come from the backend's usual environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``GOOGLE_APPLICATION_CREDENTIALS``...)
or from ``storage_options`` (passed to the fsspec filesystem). Every failure is a
:class:`~torch_batch_process.errors.StorageError` naming the URL, the action and the cause
(:mod:`torch_batch_process.storage.errors`).
"""

from __future__ import annotations

import abc
import io
import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Protocol

__all__ = ["ConditionFailed", "ConditionalWrites", "FileSink", "MirroredFolder", "Storage", "TMP_MARKER"]

TMP_MARKER = ".tmp-"
"""Part of the name of a file being written (a crash may leave one; the next start removes it)."""


class Storage(abc.ABC):
    """A folder on some filesystem, with atomic writes and clear errors.

    Attributes:
        url: the user-facing URL of the root (a local path for local storage).
        protocol: ``file``, ``s3``, ``gs``, ``memory``...
    """

    url: str
    protocol: str
    moves_are_renames: bool = False
    """Whether :meth:`move` of a folder is one cheap local operation (a rename): the engine then publishes on its
    own thread, where handing each publication to a background thread would cost more than the rename."""

    # ------------------------------------------------------------------ paths

    @abc.abstractmethod
    def url_of(self, rel: str = "") -> str:
        """User-facing URL of ``rel`` (a local path for local storage)."""

    # ------------------------------------------------------------------ reads

    @abc.abstractmethod
    def check(self) -> None:
        """Fails early and clearly when the storage cannot be read (missing bucket, unreachable endpoint,
        no permission, a file where the folder should be). Writes nothing."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether a file or folder exists at ``rel``."""

    @abc.abstractmethod
    def read_bytes(self, rel: str) -> bytes:
        """Reads a whole file; ``FileNotFoundError`` when it does not exist."""

    def open_input(self, rel: str) -> BinaryIO:
        """A readable, seekable binary file for ``rel`` (record shards are read in parts, never whole)."""
        return io.BytesIO(self.read_bytes(rel))

    def read_json(self, rel: str) -> Any:
        """Reads a JSON file; ``FileNotFoundError`` when missing, ``ValueError`` when not JSON."""
        return json.loads(self.read_bytes(rel).decode("utf-8"))

    def read_json_object(self, rel: str) -> dict[str, Any] | None:
        """A JSON object file that is only informative (who holds the lock, the attempt count): ``None`` when it is
        missing, not JSON or not an object."""
        try:
            value = self.read_json(rel)
        except (FileNotFoundError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    @abc.abstractmethod
    def list(self, rel: str) -> list[str]:
        """Sorted names of the entries of folder ``rel`` (empty when it does not exist)."""

    # ----------------------------------------------------------------- writes

    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes, *, fsync: bool = False) -> None:
        """Writes a whole file atomically: readers see the old or the new file, never part of one.

        With ``fsync=True`` a local file and its folder are flushed to disk before returning, so the write
        also survives a power cut, not only a killed process.
        """

    def write_json(self, rel: str, value: Any, *, fsync: bool = False, compact: bool = False) -> None:
        """Writes a JSON file atomically; ``compact`` (one line) for frequent writes such as commit records.

        Indented output makes ``json`` fall back to its pure-Python encoder, several times slower.
        """
        if compact:
            text = json.dumps(value, separators=(",", ":"), sort_keys=True)
        else:
            text = json.dumps(value, indent=1, sort_keys=True)
        self.write_bytes(rel, text.encode("utf-8"), fsync=fsync)

    @abc.abstractmethod
    def append(self, rel: str, data: bytes) -> None:
        """Appends ``data`` to file ``rel`` (whole lines in, whole lines stored, even after ``kill -9``).

        Only one process appends to a given file (rank 0 for ``metrics.jsonl``).
        """

    @abc.abstractmethod
    def put_file(self, local_file: str | os.PathLike[str], rel: str) -> None:
        """Stores the local file at ``rel``, streamed from disk (moved locally, uploaded to object stores)."""

    @abc.abstractmethod
    def move(self, src: str, dst: str) -> None:
        """Moves file or folder ``src`` to ``dst``, merging folders; safe to repeat after a crash."""

    @abc.abstractmethod
    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Deletes a file, or a folder with ``recursive=True``; a missing path is fine."""

    @abc.abstractmethod
    def delete_files(self, rels: list[str]) -> None:
        """Deletes files (in bulk where the backend can); missing ones are fine."""

    @abc.abstractmethod
    def remove_empty_folder(self, rel: str) -> None:
        """Removes folder ``rel`` if it is empty (object stores have no folders: nothing to do)."""

    # ------------------------------------------- what differs between backends

    @abc.abstractmethod
    def scratch_folder(self, under: str, name: str) -> Path:
        """A fresh local folder (created) whose files :meth:`file_sink` can take in cheaply.

        Locally it lies inside the storage, in its folder ``under`` (on the same filesystem: files are later renamed,
        never copied); for object stores it is a local temporary folder. ``name`` ends up in its name.
        """

    @abc.abstractmethod
    def file_sink(self) -> FileSink:
        """A sink that stores local files at paths of this storage (see :class:`FileSink`)."""

    def local_path(self, rel: str) -> str | None:
        """The path of ``rel`` in this machine's file system when the storage is a folder of it (a file there can
        be appended in place, e.g. a segment log), else ``None`` (object stores: a file is written whole)."""
        return None

    @abc.abstractmethod
    def mirrored_folder(self, rel: str, name: str) -> MirroredFolder:
        """A local folder whose files appear at ``rel`` in this storage (see :class:`MirroredFolder`)."""

    def conditional_writes(self) -> ConditionalWrites | None:
        """The storage's writes that succeed only when a file is still the version read (S3's conditional PUTs), or
        ``None`` when it has none (a lease is then written and read back: :mod:`torch_batch_process.jobstore.lease`)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Releases local resources (temporary mirrors)."""


class FileSink(abc.ABC):
    """Stores local files at paths of a storage: at once (a rename) or in the background (an upload)."""

    @abc.abstractmethod
    def add(self, local_file: str | os.PathLike[str], rel: str) -> None:
        """Takes ``local_file`` (it is moved away or deleted once stored) to be stored at ``rel``."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Waits until every file added so far is stored; raises the first error."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops the sink; files not stored yet are abandoned (their commit never happens)."""


class MirroredFolder(abc.ABC):
    """A local folder (``path``) whose files appear at a path of the storage.

    Locally it *is* that folder; for object stores it is a temporary folder whose new or changed files
    :meth:`sync` uploads (at most every ``interval`` seconds when :meth:`due`).
    """

    path: Path

    def due(self) -> bool:
        """Whether :meth:`sync` has something to do now."""
        return False

    def sync(self) -> bool:
        """Makes the storage show the folder's files; False (after a warning) when that failed."""
        return True

    def close(self) -> None:  # noqa: B027 - optional
        """A last :meth:`sync`, then local clean-up."""


class ConditionFailed(Exception):
    """A conditional write lost: the object changed (or appeared) since it was read."""


class ConditionalWrites(Protocol):
    """Writes that succeed only when the object is still the version read (S3:
    :class:`~torch_batch_process.storage.s3.S3Storage`)."""

    def read_versioned(self, rel: str) -> tuple[bytes, str]:
        """Reads a file and its version tag; ``FileNotFoundError`` when missing."""
        ...

    def write_conditional(self, rel: str, data: bytes, *, if_version: str | None) -> str:
        """Writes ``rel`` only if it is still at version ``if_version`` (``None``: only if absent); returns the new
        version tag; raises :class:`ConditionFailed` when another writer won."""
        ...
