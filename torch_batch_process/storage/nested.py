"""A job stored in a folder of another job's storage that shares that job's ``outputs/``: a retry.

``retry_failed=True`` (:mod:`torch_batch_process.engine.plan.retry`) runs a job of its own in ``retries/<k>/`` (its
commit records, states, staging, failures, result), but its committed files must appear where every reader of
the job looks: ``<storage_path>/outputs/`` (the documented glob, ``read_outputs``). :class:`NestedStorage` is the
retry's storage: every path maps into ``retries/<k>/``, except ``outputs/...``, which maps to the job's own
``outputs/``. A publication (a move from ``retries/<k>/_tbp/staging/`` to ``outputs/``) then stays one move of the
job's storage (one rename locally), and the retry's stage numbers, which follow every stage number the job used
before, keep its ``outputs/commit_<s>/`` folders apart from the job's.

What differs between backends (scratch folders, conditional writes, mirrored folders) is the folder's own storage's
(``retries/<k>/`` opened as a storage of the same kind), so the retry's lock and scratch files stay in its folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from torch_batch_process.storage.base import ConditionalWrites, FileSink, MirroredFolder, Storage
from torch_batch_process.storage.registry import open_storage

__all__ = ["NestedStorage"]


class NestedStorage(Storage):
    """The storage of the job in folder ``folder`` of ``parent``, sharing ``parent``'s ``shared`` folders.

    Args:
        parent: the enclosing job's storage (closed with this one).
        folder: the nested job's folder, relative to ``parent`` (``retries/3``).
        storage_options: the options ``parent`` was opened with (the folder's own storage is opened with them).
        shared: top-level folders that map to ``parent``'s own (default: ``outputs``).
    """

    def __init__(
        self,
        parent: Storage,
        folder: str,
        storage_options: dict[str, Any] | None = None,
        shared: tuple[str, ...] = ("outputs",),
    ) -> None:
        self.parent = parent
        self.folder = folder.strip("/")
        self.shared = shared
        self.own = open_storage(parent.url_of(self.folder), storage_options)
        self.url = self.own.url
        self.protocol = parent.protocol
        self.moves_are_renames = parent.moves_are_renames

    def _map(self, rel: str) -> str:
        """``rel`` of this storage as a path of ``parent``."""
        if rel.split("/", 1)[0] in self.shared:
            return rel
        return f"{self.folder}/{rel}" if rel else self.folder

    def url_of(self, rel: str = "") -> str:
        return self.parent.url_of(self._map(rel))

    def check(self) -> None:
        self.parent.check()

    def exists(self, rel: str) -> bool:
        return self.parent.exists(self._map(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.parent.read_bytes(self._map(rel))

    def open_input(self, rel: str) -> BinaryIO:
        return self.parent.open_input(self._map(rel))

    def list(self, rel: str) -> list[str]:
        return self.parent.list(self._map(rel))

    def write_bytes(self, rel: str, data: bytes, *, fsync: bool = False) -> None:
        self.parent.write_bytes(self._map(rel), data, fsync=fsync)

    def append(self, rel: str, data: bytes) -> None:
        self.parent.append(self._map(rel), data)

    def put_file(self, local_file: str | os.PathLike[str], rel: str) -> None:
        self.parent.put_file(local_file, self._map(rel))

    def move(self, src: str, dst: str) -> None:
        self.parent.move(self._map(src), self._map(dst))

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        if rel.strip("/") in self.shared:  # the enclosing job's files: a nested job never erases them
            raise ValueError(f"{self.url}: {rel!r} is the enclosing job's folder ({self.parent.url}); not deleted")
        self.parent.delete(self._map(rel), recursive=recursive)

    def delete_files(self, rels: list[str]) -> None:
        self.parent.delete_files([self._map(rel) for rel in rels])

    def remove_empty_folder(self, rel: str) -> None:
        self.parent.remove_empty_folder(self._map(rel))

    def scratch_folder(self, under: str, name: str) -> Path:
        return self.own.scratch_folder(under, name)

    def file_sink(self) -> FileSink:
        return _MappedSink(self.parent.file_sink(), self._map)

    def local_path(self, rel: str) -> str | None:
        return self.parent.local_path(self._map(rel))

    def mirrored_folder(self, rel: str, name: str) -> MirroredFolder:
        if self._map(rel) == rel:
            return self.parent.mirrored_folder(rel, name)
        return self.own.mirrored_folder(rel, name)

    def conditional_writes(self) -> ConditionalWrites | None:
        return self.own.conditional_writes()  # the folder's own storage: the same objects as this one's own paths

    def close(self) -> None:
        self.own.close()
        self.parent.close()


class _MappedSink(FileSink):
    """The enclosing storage's sink, taking this storage's paths."""

    def __init__(self, sink: FileSink, mapping: Any) -> None:
        self._sink = sink
        self._map = mapping

    def add(self, local_file: str | os.PathLike[str], rel: str) -> None:
        self._sink.add(local_file, self._map(rel))

    def flush(self) -> None:
        self._sink.flush()

    def close(self) -> None:
        self._sink.close()
