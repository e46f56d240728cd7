"""Staging of the files users write through ``context.upload_path()``.

Each ``upload_path()`` yields an empty local folder (``storage.scratch_folder``: inside the storage for local
storage, so that files are renamed and never copied; a local temporary folder for object stores). When the
``with`` block ends, what was written there joins this rank's stage of its next commit,
``_tbp/staging/<s>/rank_<r>/`` (see :mod:`torch_batch_process.engine.commit.committer`), through the storage's
file sink: a rename locally, a background upload (streamed from disk) to object stores. The commit waits
for those uploads (:meth:`OutputStager.flush`). A block that raises contributes nothing.

A folder left empty by its block is handed to the next ``upload_path()`` instead of being deleted and made
again: creating and removing folders costs a few syscalls per batch (milliseconds on some filesystems),
which is the stager's whole cost on local storage. Scratch folders of a killed job are removed by the repair
at its next start (local storage) or by the next job on the host (temporary folders).

Two files with the same path in the same stage of one rank would overwrite each other, so that is an error.

With ``on_error="skip"`` or ``on_oom="split"`` (the default) the engine runs each batch (or part of one) between
:meth:`OutputStager.hold` and :meth:`OutputStager.release`: the blocks of a batch that fails are discarded, those of
one that succeeds join the stage; the parts of a split batch write under a sub-folder of their own (``prefix``, see
:mod:`torch_batch_process.engine.feed.failing_examples`). The failure records of the stage
(:meth:`OutputStager.add_failure`) are written next to its files at :meth:`OutputStager.flush` and published to
``failures/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.jobstore.layout import SCRATCH_DIR, STAGED_FAILURES_NAME, staging_dir
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.errors import file_error

__all__ = ["OutputStager"]


class OutputStager:
    """Collects one rank's output files into the stage of its next commit.

    Args:
        storage: the job's storage.
        rank: this rank.
    """

    def __init__(self, storage: Storage, rank: int) -> None:
        self._storage = storage
        self._rank = rank
        self.stage = 0
        self._names: set[str] = set()
        self._sink = storage.file_sink()
        self._lock = threading.Lock()
        self._spare: list[Path] = []  # empty folders of finished blocks, for the next upload_path()
        self._writers: list[Any] = []  # record writers (outputs/records.py): sealed before each commit
        self._held: list[tuple[Path, list[str], list[str], bool]] | None = None  # blocks of the running batch
        self._prefix = ""
        self._failures: list[str] = []  # JSON lines of the current stage's failure records
        self._stage_dir = staging_dir(0, rank)  # this rank's folder of the current stage

    @property
    def storage(self) -> Storage:
        """The job's storage."""
        return self._storage

    def attach(self, writer: Any) -> None:
        """Adds a writer of open files (record outputs): ``writer.seal()`` runs before each commit (its files
        join the stage being committed) and ``writer.close()`` when the stager closes."""
        self._writers.append(writer)

    def seal(self, closing: bool = False) -> None:
        """Before a commit: the attached writers hand their open files to the current stage (``closing``: the
        commit is a closing one, after which the job may stop: record shards roll over)."""
        for writer in self._writers:
            writer.seal(closing)

    def published(self, stage: int) -> None:
        """This rank's ``stage`` is published (any thread): the attached writers delete what it supersedes."""
        for writer in self._writers:
            writer.published(stage)

    def store_file(self, local_file: str | os.PathLike[str], rel: str) -> None:
        """Stores a finished local file at ``rel`` (relative to the storage, outside the stage: e.g. a record
        segment) through the stage's sink, so that :meth:`flush` waits for it too; it is moved away."""
        self._sink.add(local_file, rel)

    def advance(self, stage: int) -> None:
        """Starts collecting for ``stage`` (the previous one is committed or being committed)."""
        self.stage = stage
        self._stage_dir = staging_dir(stage, self._rank)
        self._names = set()
        self._failures = []

    @property
    def has_files(self) -> bool:
        """Whether the current stage has files (or failure records)."""
        return bool(self._names) or bool(self._failures)

    @property
    def has_outputs(self) -> bool:
        """Whether the current stage has output files (its failure records are published elsewhere)."""
        return any(name != STAGED_FAILURES_NAME for name in self._names)  # no copy of a large stage's names

    @property
    def has_failures(self) -> bool:
        """Whether the current stage has failure records (before or after :meth:`flush` wrote them)."""
        return bool(self._failures) or STAGED_FAILURES_NAME in self._names

    def hold(self, prefix: str = "") -> None:
        """From now on, finished blocks wait for :meth:`release`; their files are named ``prefix + name``."""
        self._held, self._prefix = [], prefix

    def release(self, keep: bool) -> None:
        """Ends :meth:`hold`: the held blocks join the stage (``keep``) or are discarded."""
        held, self._held, self._prefix = self._held or [], None, ""
        for folder, files, names, has_dirs in held:
            if keep:
                for path, name in zip(files, names, strict=True):
                    self._add(path, name)
            if keep and not has_dirs:
                with self._lock:
                    self._spare.append(folder)
            else:
                shutil.rmtree(folder, ignore_errors=True)

    def add_failure(self, record: dict[str, object]) -> None:
        """Adds a failed example's record to the current stage (written at :meth:`flush`)."""
        self._failures.append(json.dumps(record, default=str))

    def upload_path(self) -> contextlib.AbstractContextManager[Path]:
        """A context manager yielding an empty folder; its files join the current stage when the block exits
        normally (see :class:`_Block`)."""
        return _Block(self)

    def _finish_block(self, folder: Path) -> None:
        """A block exited normally: its files join the stage (or wait, held); the folder is kept when emptied."""
        if self._held is not None:
            self._hold_block(folder)
            return
        emptied = False
        try:
            emptied = self._seal(folder)
        finally:
            if emptied:
                with self._lock:
                    self._spare.append(folder)
            else:
                shutil.rmtree(folder, ignore_errors=True)

    def add_file(self, local_file: str | os.PathLike[str], name: str) -> None:
        """Adds a finished local file (e.g. a record shard) to the current stage as ``name``; it is moved away."""
        self._check_names([name])
        self._add(local_file, name)

    def _take_folder(self) -> Path:
        with self._lock:
            if self._spare:
                return self._spare.pop()
        return self._storage.scratch_folder(SCRATCH_DIR, f"block-rank_{self._rank}")

    def _seal(self, folder: Path) -> bool:
        """Moves the block's files into the stage; returns True when that left ``folder`` empty."""
        files, names, has_dirs = _list_files(folder)
        if not self._names.isdisjoint(names):  # the common case (disjoint) is checked without building sets
            self._check_names(names)
        for path, name in zip(files, names, strict=True):
            self._add(path, name)
        return not has_dirs

    def _hold_block(self, folder: Path) -> None:
        assert self._held is not None
        try:
            files, names, has_dirs = _list_files(folder)
            names = [self._prefix + name for name in names]
            self._check_names(names, held=True)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self._held.append((folder, files, names, has_dirs))

    def _check_names(self, names: list[str], held: bool = False) -> None:
        # the stage's names grow with its files: look each new name up, never copy them (a batch's blocks are few)
        pending = {name for block in self._held or [] for name in block[2]} if held else ()
        clashes = sorted(name for name in set(names) if name in self._names or name in pending)
        if clashes:
            raise FileExistsError(
                f"upload_path(): {clashes[0]!r} was already written by rank {self._rank} since its last commit; "
                "writing it again would overwrite it. Give each output file a unique name (e.g. include batch_idx)."
            )

    def _add(self, path: str | os.PathLike[str], name: str) -> None:
        self._names.add(name)
        self._sink.add(path, f"{self._stage_dir}/{name}")

    def flush(self) -> None:
        """Writes the stage's failure records, then waits until every file of the current stage is in storage;
        raises the first error."""
        if self._failures:
            lines, self._failures = self._failures, []
            folder = self._take_folder()
            path = folder / STAGED_FAILURES_NAME
            try:
                path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            except OSError as exc:  # a full disk: the library's own file, named, with the disk's errno
                raise file_error(str(path), "write the stage's failure records to", exc) from exc
            self._add(path, STAGED_FAILURES_NAME)
            with self._lock:
                self._spare.append(folder)
        self._sink.flush()

    def close(self) -> None:
        """Stops the sink (pending uploads are abandoned: their commit never happens) and removes the spare
        folders."""
        writers, self._writers = self._writers, []  # each writer holds this stager: no cycle left behind
        for writer in writers:
            writer.close()
        self._sink.close()
        with self._lock:
            spare, self._spare = self._spare, []
        for folder in spare:
            shutil.rmtree(folder, ignore_errors=True)


class _Block:
    """One ``upload_path()`` block: a class rather than a generator-based context manager, which costs a frame
    and a generator per batch (this runs once per batch, see BENCHMARKS.md, "The tiny-batch job")."""

    __slots__ = ("_folder", "_stager")

    def __init__(self, stager: OutputStager) -> None:
        self._stager = stager
        self._folder: Path | None = None

    def __enter__(self) -> Path:
        self._folder = self._stager._take_folder()
        return self._folder

    def __fspath__(self) -> str:
        raise _not_a_path()

    def __truediv__(self, other: Any) -> Any:
        raise _not_a_path()

    def __str__(self) -> str:  # f"{context.upload_path()}/x": not a path either (repr() stays the default)
        raise _not_a_path()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        folder, self._folder = self._folder, None
        assert folder is not None
        if exc_type is not None:
            shutil.rmtree(folder, ignore_errors=True)  # a failed block contributes nothing; its error goes on
            return
        self._stager._finish_block(folder)


def _not_a_path() -> InvalidArgumentError:
    """The error of ``context.upload_path()`` used as a path instead of in a ``with`` block."""
    return InvalidArgumentError(
        "context.upload_path() is a context manager, not a path: write 'with context.upload_path() as path:' and put "
        "the files in path (they are committed when the block ends)"
    )


def _list_files(folder: Path) -> tuple[list[str], list[str], bool]:
    """The files (and symlinks) below ``folder`` sorted by name: their paths, their names relative to ``folder``
    (``/``-separated), and whether ``folder`` holds any sub-folder. Strings, not pathlib: this runs per batch."""
    top = os.fspath(folder)
    names: list[str] = []
    with os.scandir(top) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return _walk_files(top)
            names.append(entry.name)
    names.sort()
    return [top + os.sep + name for name in names], names, False


def _walk_files(top: str) -> tuple[list[str], list[str], bool]:
    """:func:`_list_files` of a folder that holds sub-folders."""
    found: list[tuple[str, str]] = []
    pending = [(top, "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, f"{prefix}{entry.name}/"))
                else:
                    found.append((f"{prefix}{entry.name}", entry.path))
    found.sort()
    return [path for _, path in found], [name for name, _ in found], True
