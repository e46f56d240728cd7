"""The local temporary space of an object-store storage (:mod:`torch_batch_process.storage.object_store`).

An object store has no local folder, so three kinds of local files stand in for it on each host:

- *scratch folders*: the folders ``upload_path()`` yields, and files spooled for upload
  (:mod:`torch_batch_process.storage.uploads`), under one folder per process,
  ``<tmp>/tbp-scratch-<pid>-...``, created on first use;
- *mirrored folders* (TensorBoard): ``<tmp>/tbp-scratch-<pid>-<name>-...``, uploaded by their owner;
- *appended files*: objects cannot be appended to, so an appended file has a local copy, read from storage
  the first time, and each append uploads the whole copy in one atomic PUT.

Everything is removed when the storage closes. A process killed before that leaves its folders behind; the
next process on the host that needs scratch space removes those of processes that are gone.

The spill folders of a keyed job's planner and read-back (:func:`process_folder`: partitions of keys, up to a few
GB for 10**8 keys) follow the same rule, so a kill -9 mid-plan does not leave them on the host for good.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from torch_batch_process.processes import pid_alive

__all__ = ["AppendedFiles", "LocalScratch", "process_folder"]

logger = logging.getLogger(__name__)

TMP_PREFIX = "tbp-scratch-"
"""The name prefix of every local temporary folder of object-store storage (``<prefix><pid>-...``)."""


class LocalScratch:
    """This process's local temporary folders (see the module docstring); safe to use after a ``fork``."""

    def __init__(self) -> None:
        self._root: Path | None = None
        self._pid = 0

    def root(self) -> Path:
        """This process's scratch folder (created on first use, after removing those of dead processes)."""
        if self._root is None or os.getpid() != self._pid:
            _remove_orphans()
            self._root = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
            self._pid = os.getpid()
        return self._root

    def folder(self, name: str) -> Path:
        """A new empty folder in :meth:`root`."""
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root()))

    @staticmethod
    def mirror_path(name: str) -> Path:
        """The path of a new mirrored folder (not created: its owner creates and removes it)."""
        return Path(tempfile.gettempdir()) / f"{TMP_PREFIX}{os.getpid()}-{name}-{uuid.uuid4().hex[:8]}"

    def close(self) -> None:
        """Removes this process's scratch folder (a forked child leaves its parent's alone)."""
        if self._root is not None and os.getpid() == self._pid:
            shutil.rmtree(self._root, ignore_errors=True)
        self._root = None


class AppendedFiles:
    """Appends to files of a storage that cannot append: a local copy per file, uploaded whole at each append.

    Args:
        read: reads a stored file (``FileNotFoundError`` when missing).
        write: writes a stored file in one atomic PUT.
    """

    def __init__(self, read: Callable[[str], bytes], write: Callable[[str, bytes], None]) -> None:
        self._read = read
        self._write = write
        self._copies: dict[str, Path] = {}  # stored path -> local copy
        self._warned: set[str] = set()  # stored paths whose local copy could not be kept (warned once)
        self._lock = threading.Lock()

    def append(self, rel: str, data: bytes) -> None:
        """Appends ``data`` to the stored file ``rel`` (created when missing).

        When the local copy cannot be written (a full ``$TMPDIR``), this append is uploaded from memory (the stored
        file's lines and ``data``, once) and the copy is dropped, so no line is lost nor cut; the next append reads
        the file from storage again."""
        with self._lock:
            try:
                copy = self._copy(rel)
                with open(copy, "ab") as f:
                    f.write(data)
            except OSError as exc:
                self._forget(rel)  # it may end in part of a line now
                if rel not in self._warned:
                    self._warned.add(rel)
                    logger.warning(
                        "cannot keep the local copy of %s in %s (%s): each append to it uploads it from memory",
                        rel, tempfile.gettempdir(), exc,
                    )
                self._write(rel, self._stored_lines(rel) + data)
                return
            self._write(rel, copy.read_bytes())

    def _copy(self, rel: str) -> Path:
        """The local copy of ``rel``, read from storage the first time."""
        if rel not in self._copies:
            folder = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-append-"))
            copy = folder / posixpath.basename(rel)
            try:
                copy.write_bytes(self._stored_lines(rel))
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            self._copies[rel] = copy
        return self._copies[rel]

    def _stored_lines(self, rel: str) -> bytes:
        """The whole lines of the stored file ``rel`` (empty when missing)."""
        try:
            stored = self._read(rel)
        except FileNotFoundError:
            return b""
        whole = stored[: stored.rfind(b"\n") + 1]  # a last line cut off (damage) is dropped
        if len(whole) < len(stored):
            logger.warning("%s: dropping its last %d bytes, a line cut off", rel, len(stored) - len(whole))
        return whole

    def _forget(self, rel: str) -> None:
        """Drops the local copy of ``rel``."""
        copy = self._copies.pop(rel, None)
        if copy is not None:
            shutil.rmtree(copy.parent, ignore_errors=True)

    def close(self) -> None:
        """Removes the local copies (what they hold is stored)."""
        for copy in self._copies.values():
            shutil.rmtree(copy.parent, ignore_errors=True)
        self._copies.clear()


def process_folder(name: str, parent: str | Path | None = None) -> Path:
    """A new temporary folder of this process, ``<parent>/tbp-scratch-<pid>-<name>-...`` (default parent: the
    system's temporary folder), made after removing the folders that processes now gone left there. Its maker
    removes it; a process killed first leaves it to the next one."""
    _remove_orphans(parent)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-{name}-", dir=parent))


def _remove_orphans(parent: str | Path | None = None) -> None:
    """Removes the temporary folders of processes that are gone (killed before cleaning up)."""
    root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    for folder in root.glob(f"{TMP_PREFIX}*"):
        pid = folder.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
