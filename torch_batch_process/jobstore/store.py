"""The job's stored state on a :class:`~torch_batch_process.storage.base.Storage`: job file, commit records,
state files, stages, and their repair after a crash.

Names are those of :mod:`torch_batch_process.jobstore.layout`; the commit protocol that writes them is the
committer's (:mod:`torch_batch_process.engine.commit.committer`). Everything here is idempotent, so that a crash at
any point leaves storage that the next start repairs (:meth:`JobStore.repair`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
import zipfile
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from torch_batch_process.errors import CORRUPT_HINT, CheckpointCorruptError
from torch_batch_process.jobstore.formats import CommitRecord, JobInfo, parse_json
from torch_batch_process.jobstore.job_lock import FileJobLock, JobLock
from torch_batch_process.jobstore.layout import (
    ATTEMPT_FILE,
    COMMITS_DIR,
    FAILURES_DIR,
    INTERNAL_DIR,
    JOB_FILE,
    LOCK_FILE,
    METRICS_FILE,
    OUTPUTS_DIR,
    PARTIALS_DIR,
    RESULT_FILE,
    RETRIES_DIR,
    SCRATCH_DIR,
    STAGED_FAILURES_NAME,
    STAGING_DIR,
    STATES_DIR,
    TENSORBOARD_DIR,
    failures_file,
    number_name,
    outputs_dir,
    record_file,
    staging_dir,
    state_file,
)
from torch_batch_process.jobstore.lease import LeaseJobLock
from torch_batch_process.storage.base import TMP_MARKER, Storage
from torch_batch_process.storage.errors import NotAFileError, storage_error

__all__ = [
    "JobStore", "LeftoverRows", "job_finished", "job_info_at", "latest_record_at", "lock_holder", "output_stage",
    "take_job_lock", "unpublished_stages_at",
]

logger = logging.getLogger(__name__)

LeftoverRows = Callable[[Storage, "CommitRecord | None"], None]
"""What the repair calls to roll record rows left in segments into published shards (see :class:`JobStore`)."""

_LIST_AGAIN = 5
"""How often :func:`latest_record_at` lists a running job's records again when the latest one vanished while read."""


class JobStore:
    """Reads and writes a job's records, states, stages and outputs.

    Args:
        storage: the job's storage.
        first_stage: the job's first stage number. A retry (:mod:`torch_batch_process.engine.plan.retry`) shares the
            ``outputs/`` of the job it retries, with stage numbers after those the job used: the
            ``outputs/commit_<s>/`` folders below its first stage are the job's, not the retry's.
        leftovers: called by :meth:`repair` with the latest record once the committed stages are published: rolls
            the record rows a kill left in segments into published shards (the engine passes
            :func:`torch_batch_process.outputs.segments.roll_leftovers`; the stored job does not write shards).
    """

    def __init__(self, storage: Storage, first_stage: int = 1, leftovers: LeftoverRows | None = None) -> None:
        self.storage = storage
        self.first_stage = first_stage
        self._leftovers = leftovers
        self._lock: JobLock | None = None

    # ------------------------------------------------------------------ the job lock

    def take_lock(self) -> None:
        """Rank 0: takes the job lock (see :func:`take_job_lock`), held until :meth:`release_lock`."""
        if self._lock is None:
            self._lock = take_job_lock(self.storage)

    def check_lock(self) -> None:
        """Raises :class:`~torch_batch_process.errors.JobLockedError` when the lock was lost (before every record: a
        job never commits after losing it)."""
        assert self._lock is not None, "records are written under the job lock"
        self._lock.check()

    def release_lock(self) -> None:
        """Releases the job lock, if this process took it."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    # ------------------------------------------------------------------ reading

    def load_job(self) -> JobInfo | None:
        """The stored job info, ``None`` for a fresh storage path."""
        return job_info_at(self.storage)

    def record_numbers(self) -> list[int]:
        """Numbers of the commit records present, ascending."""
        return _record_numbers(self.storage, COMMITS_DIR)

    def load_latest(self) -> CommitRecord | None:
        """The latest commit record, ``None`` when nothing was committed.

        Raises:
            CheckpointCorruptError: the latest record exists but cannot be read; never falls back.
        """
        numbers = self.record_numbers()
        if not numbers:
            return None
        rel = record_file(numbers[-1])
        where = self.storage.url_of(rel)
        try:
            raw = _read(self.storage, rel, "commit record")
        except FileNotFoundError as exc:  # deleted between list and read: a newer commit's clean-up
            raise CheckpointCorruptError(f"commit record {where} vanished while reading it. {CORRUPT_HINT}.") from exc
        record = CommitRecord.from_json(parse_json(raw, where), where)
        if record.commit != numbers[-1]:
            raise CheckpointCorruptError(f"commit record {where} says it is commit {record.commit}. {CORRUPT_HINT}.")
        return record

    def load_state(self, rel: str) -> dict[str, Any]:
        """Loads a state file written by :meth:`write_state`."""
        import torch  # only state files need torch: `tbp status` does not

        where = self.storage.url_of(rel)
        try:
            raw = _read(self.storage, rel, "state file")
        except FileNotFoundError as exc:
            message = f"state file {where} referenced by the last commit is missing. {CORRUPT_HINT}."
            raise CheckpointCorruptError(message) from exc
        damage = _archive_damage(raw)
        if damage is not None:
            raise CheckpointCorruptError(f"state file {where} is damaged ({damage}). {CORRUPT_HINT}.")
        try:
            state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unpickling error means a damaged file
            raise CheckpointCorruptError(f"state file {where} cannot be read ({exc}). {CORRUPT_HINT}.") from exc
        if not isinstance(state, dict) or "reducers" not in state:
            raise CheckpointCorruptError(f"state file {where} is not a torch_batch_process state file. {CORRUPT_HINT}.")
        return state

    def staged(self) -> dict[int, list[str]]:
        """Stage number -> the ranks' folders (``rank_<r>``) staged under it."""
        stages = {}
        for name in self.storage.list(STAGING_DIR):
            if name.isdigit():
                entries = self.storage.list(staging_dir(int(name)))
                stages[int(name)] = [entry for entry in entries if entry.startswith("rank_")]
        return stages

    def unpublished_stages(self, latest: CommitRecord) -> list[int]:
        """Stages committed by ``latest`` whose files are still staged (a crash while publishing)."""
        return unpublished_stages_at(self.storage, latest)

    def finished_repair_due(self, latest: CommitRecord) -> bool:
        """Whether a finished job needs :meth:`repair`: a kill left committed stages unpublished, or came between
        the final record and ``result.json``."""
        return bool(self.unpublished_stages(latest)) or not self.result_written()

    def result_written(self) -> bool:
        """Whether ``result.json`` is written (a finished run writes it last)."""
        return self.storage.exists(RESULT_FILE)

    def has_outputs(self) -> bool:
        """Whether ``outputs/`` holds anything of this job (of a retry: an ``outputs/commit_<s>/`` folder of its
        stages)."""
        names = self.storage.list(OUTPUTS_DIR)
        if self.first_stage <= 1:
            return bool(names)
        return any((stage := output_stage(name)) is not None and stage >= self.first_stage for name in names)

    # ------------------------------------------------------------------ writing

    def write_job(self, job: JobInfo) -> None:
        self.storage.write_json(JOB_FILE, job.to_json(), fsync=True)

    def write_state(self, stage: int, rank: int, reducers: list[Any], processor: Any) -> str:
        """Writes rank ``rank``'s state at ``stage``; returns its relative path."""
        import torch

        buffer = io.BytesIO()
        torch.save({"reducers": reducers, "processor": processor}, buffer)
        rel = state_file(stage, rank)
        self.storage.write_bytes(rel, buffer.getvalue(), fsync=True)
        return rel

    def write_record(self, record: CommitRecord) -> None:
        """Writes a commit record atomically: the commit point."""
        self.storage.write_json(record_file(record.commit), record.to_json(), fsync=True, compact=True)

    def next_attempt(self, latest: CommitRecord | None, world_size: int) -> int:
        """Counts this start as a new attempt (also attempts that crashed before their first commit)."""
        previous = latest.attempt if latest else 0
        try:
            stored = json.loads(_read(self.storage, ATTEMPT_FILE, "attempt file"))  # a folder there: an error
            previous = max(previous, int(stored.get("attempt", 0)))
        except (FileNotFoundError, ValueError, AttributeError, TypeError):  # a damaged count: the record's stands
            pass
        attempt = previous + 1
        self.storage.write_json(ATTEMPT_FILE, {"attempt": attempt, "started": time.time(), "world_size": world_size})
        return attempt

    def write_result(self, result: dict[str, Any]) -> None:
        """Writes ``result.json``: a copy of the final record's result, written right after that record."""
        self.storage.write_json(RESULT_FILE, result)

    def restore_result(self, latest: CommitRecord | None) -> None:
        """Writes the ``result.json`` of a finished job when it is missing (a kill between the final record,
        the commit point, and ``result.json``); nothing otherwise."""
        if latest is None or not latest.finished or latest.result is None or self.storage.exists(RESULT_FILE):
            return
        where = self.storage.url_of(RESULT_FILE)
        logger.info("writing %s from the final commit record (the job was killed before writing it)", where)
        self.write_result(latest.result)

    def publish(self, stage: int, rank: int | None = None, *, sole: bool = False, failures: bool = True) -> None:
        """Moves the staged files of ``stage`` (one rank's, or all of it) into ``outputs/``, and their failure
        records into ``failures/``; idempotent. ``sole``: ``rank`` is the only rank of the stage (one process),
        so the stage's folder moves whole, with one rename and no folder made or removed. ``failures=False``:
        the caller knows that the stage holds no failure records, so none are looked for (on local storage a
        publication is then one rename)."""
        if rank is not None and sole:
            if failures:
                self.storage.move(f"{staging_dir(stage, rank)}/{STAGED_FAILURES_NAME}", failures_file(stage, rank))
                self.remove_empty_stage(stage, rank)  # a stage with failures only
            self.storage.move(staging_dir(stage), outputs_dir(stage))
            return
        ranks = [rank] if rank is not None else [
            int(name[len("rank_") :]) for name in self.storage.list(staging_dir(stage)) if name.startswith("rank_")
        ]
        for r in ranks:
            if failures:
                self.storage.move(f"{staging_dir(stage, r)}/{STAGED_FAILURES_NAME}", failures_file(stage, r))
                self.storage.remove_empty_folder(staging_dir(stage, r))  # a stage with failures only
            self.storage.move(staging_dir(stage, r), outputs_dir(stage, r))
        self.storage.remove_empty_folder(staging_dir(stage))

    def remove_empty_stage(self, stage: int, rank: int) -> None:
        """Removes a rank's stage folder that no file came to (and the stage's folder once empty)."""
        self.storage.remove_empty_folder(staging_dir(stage, rank))
        self.storage.remove_empty_folder(staging_dir(stage))

    # -------------------------------------------------------------- maintenance

    def repair(self, latest: CommitRecord | None) -> None:
        """Brings storage in line with the latest record after a crash (rank 0, under the job lock, before
        any other rank writes).

        Publishes the stages the record commits, deletes stages and state files it does not (they were never
        committed), rolls the committed record segments a kill left into published shards
        (:mod:`torch_batch_process.outputs.segments`), removes scratch folders and temporary files of interrupted
        writes, and writes the ``result.json`` of a finished job that was killed before writing it.
        """
        for stage, ranks in self.staged().items():
            if ranks and latest is not None and latest.has_stage(stage):
                logger.info("publishing the outputs of stage %d, interrupted before they were published", stage)
                self.publish(stage)
            else:
                if ranks:
                    logger.info("discarding the uncommitted outputs of stage %d", stage)
                self.storage.delete(staging_dir(stage), recursive=True)
        for name in self.storage.list(STAGING_DIR):
            if not name.isdigit():
                self.storage.delete(f"{STAGING_DIR}/{name}", recursive=True)
        self.storage.delete(SCRATCH_DIR, recursive=True)
        if self._leftovers is not None:  # record rows left in segments by a kill: into published shards
            self._leftovers(self.storage, latest)
        keep_dirs = {rel.rsplit("/", 1)[0] for rel in (latest.referenced_files() if latest else set())}
        for name in self.storage.list(STATES_DIR):
            if f"{STATES_DIR}/{name}" not in keep_dirs:
                self.storage.delete(f"{STATES_DIR}/{name}", recursive=True)
        hints = latest.hint_files() if latest else set()
        for name in self.storage.list(PARTIALS_DIR):
            if f"{PARTIALS_DIR}/{name}" not in hints:
                self.storage.delete(f"{PARTIALS_DIR}/{name}")  # a stop's partial answers its record never named
        last = latest.commit if latest else 0
        for name in self.storage.list(COMMITS_DIR):
            stem = name[: -len(".json")] if name.endswith(".json") else ""
            if TMP_MARKER in name or (stem.isdigit() and int(stem) < last):
                self.storage.delete(f"{COMMITS_DIR}/{name}")  # interrupted writes, superseded records
        for name in self.storage.list(INTERNAL_DIR):
            if TMP_MARKER in name:
                self.storage.delete(f"{INTERNAL_DIR}/{name}")
        self.restore_result(latest)

    def repair_finished(self) -> None:
        """Rank 0, on a finished job: the repairs of :meth:`repair` (stages a kill left unpublished, a missing
        ``result.json``) under the job lock, taken only when one is due; nothing on a job that is not finished."""
        latest = self.load_latest()
        if latest is None or not latest.finished:
            return
        if not self.finished_repair_due(latest):
            return
        self.take_lock()
        try:
            self.repair(self.load_latest())
        finally:
            self.release_lock()

    def collect_garbage(
        self, record: CommitRecord, previous: CommitRecord | None, skipped: Sequence[CommitRecord] = ()
    ) -> None:
        """Deletes what ``record`` supersedes: the previous record and the state files it no longer needs (also
        those of ``skipped``: records of the same group commit that were never written).

        One bulk delete on object stores, no listing (older leftovers are removed by :meth:`repair` at the
        start of an attempt).
        """
        earlier: set[str] = set().union(*(r.referenced_files() | r.hint_files() for r in skipped))
        if previous is not None:
            earlier |= previous.referenced_files() | previous.hint_files()
        doomed = sorted(earlier - record.referenced_files() - record.hint_files())
        files = [*doomed, record_file(previous.commit)] if previous is not None else doomed
        if not files:
            return
        self.storage.delete_files(files)
        for folder in sorted({rel.rsplit("/", 1)[0] for rel in doomed}):
            self.storage.remove_empty_folder(folder)  # once the other ranks' files of the stage are gone too

    def erase(self) -> None:
        """Deletes everything the library stored (``resume=False``): records, states, outputs.

        The job file goes first and the commit records last, so that a crash midway leaves a storage path
        that a resume refuses (records without a job file) instead of one it would resume with outputs gone
        or duplicated.
        """
        for rel in (
            JOB_FILE,
            RESULT_FILE,
            OUTPUTS_DIR,
            FAILURES_DIR,
            RETRIES_DIR,
            STAGING_DIR,
            SCRATCH_DIR,
            STATES_DIR,
            PARTIALS_DIR,
            ATTEMPT_FILE,
            METRICS_FILE,
            TENSORBOARD_DIR,
            COMMITS_DIR,
        ):
            self.storage.delete(rel, recursive=True)


def job_finished(storage: Storage, root: str = "") -> bool:
    """Whether the job stored in folder ``root`` of ``storage`` (``""``: its root) is finished: its latest commit
    record is the final one.

    ``result.json`` is written after the final record, so when it exists the job is finished (one request);
    without it the latest record decides (a kill may come between the two).
    """
    if storage.exists(f"{root}/{RESULT_FILE}" if root else RESULT_FILE):
        return True
    latest = latest_record_at(storage, root)
    return latest is not None and latest.finished


def job_info_at(storage: Storage, root: str = "") -> JobInfo | None:
    """The job info stored in folder ``root`` of ``storage`` (a retry's or an incremental run's: ``retries/<k>``);
    ``None`` when it has none yet.

    Raises:
        CheckpointCorruptError: the job file is damaged (not JSON, not a job's) or not a file.
    """
    rel = f"{root}/{JOB_FILE}" if root else JOB_FILE
    where = storage.url_of(rel)
    try:
        raw = _read(storage, rel, "job file")
    except FileNotFoundError:
        return None
    return JobInfo.from_json(parse_json(raw, where), where)


def latest_record_at(storage: Storage, root: str = "") -> CommitRecord | None:
    """The latest commit record of the job stored in folder ``root`` of ``storage`` (``None``: none yet).

    Read-only and safe while the job runs: a record deleted while it is read (a newer commit superseded it) makes
    it list again.
    """
    folder = f"{root}/{COMMITS_DIR}" if root else COMMITS_DIR
    for _ in range(_LIST_AGAIN):
        numbers = _record_numbers(storage, folder)
        if not numbers:
            return None
        rel = f"{root}/{record_file(numbers[-1])}" if root else record_file(numbers[-1])
        try:
            raw = _read(storage, rel, "commit record")
        except FileNotFoundError:
            continue
        where = storage.url_of(rel)
        return CommitRecord.from_json(parse_json(raw, where), where)
    raise CheckpointCorruptError(f"the commit records in {storage.url_of(folder)} keep vanishing while they are read")


def unpublished_stages_at(storage: Storage, latest: CommitRecord, root: str = "") -> list[int]:
    """Stages committed by ``latest`` whose files are still staged in the job stored in folder ``root`` of
    ``storage`` (``""``: its root): a kill while publishing them; the next start publishes them. Read-only."""
    staging = f"{root}/{STAGING_DIR}" if root else STAGING_DIR
    stages = [int(name) for name in storage.list(staging) if name.isdigit() and latest.has_stage(int(name))]
    return [s for s in stages if any(e.startswith("rank_") for e in storage.list(f"{staging}/{number_name(s)}"))]


def _archive_damage(raw: bytes) -> str | None:
    """What is damaged in the ``torch.save`` archive ``raw`` (a zip whose entries carry a CRC-32), ``None`` when every
    entry matches its CRC-32 or ``raw`` is no zip (``torch.load`` then says what is wrong).

    ``torch.load`` does not check the CRC-32s: a flipped byte in a tensor or in the pickle of a reducer's count would
    load as another value and silently change the resumed job's state and metrics."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    with archive:
        for info in archive.infolist():
            if info.CRC == 0 and info.file_size:  # saved with torch.serialization.set_crc32_options(False)
                continue
            try:
                with archive.open(info) as entry:
                    while entry.read(1 << 24):  # zipfile checks the CRC-32 when the entry's end is read
                        pass
            except (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error) as exc:
                return f"entry {info.filename}: {exc}"
    return None


def _read(storage: Storage, rel: str, what: str) -> bytes:
    """The bytes of a stored job file; something other than a file in its place is damaged progress."""
    try:
        return storage.read_bytes(rel)
    except NotAFileError as exc:
        raise CheckpointCorruptError(f"{what} {storage.url_of(rel)} is not a file ({exc}). {CORRUPT_HINT}.") from exc


def _record_numbers(storage: Storage, folder: str) -> list[int]:
    """Numbers of the commit records in ``folder`` (``<n>.json``, zero-padded as :func:`record_file` names
    them), ascending. Other names (``7.json``, ``7.json.tmp``) are not records and are left alone."""
    stems = (name[: -len(".json")] for name in storage.list(folder) if name.endswith(".json"))
    return sorted(int(stem) for stem in stems if stem.isdigit() and stem == number_name(int(stem)))


def output_stage(name: str) -> int | None:
    """The stage ``s`` of an output folder named ``commit_<s>`` (zero-padded as :func:`outputs_dir` names it),
    ``None`` for any other name."""
    stem = name[len("commit_") :] if name.startswith("commit_") else ""
    return int(stem) if stem.isdigit() and stem == number_name(int(stem)) else None


def take_job_lock(storage: Storage) -> JobLock:
    """Takes the job lock of the job stored in ``storage``: an OS file lock where the storage is a folder of this
    machine's file system, else a heartbeat lease (written conditionally where the storage can). Raises
    :class:`~torch_batch_process.errors.JobLockedError` when another job holds it."""
    path = storage.local_path(LOCK_FILE)
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as exc:
            raise storage_error(storage.url, "create the job lock", exc) from exc
        return FileJobLock(storage, path)
    return LeaseJobLock(storage, conditional=storage.conditional_writes())


def lock_holder(storage: Storage) -> tuple[bool | None, dict[str, Any] | None]:
    """Whether a job holds the job lock of ``storage`` now (``None``: cannot tell from here), and its
    ``{host, pid}``."""
    path = storage.local_path(LOCK_FILE)
    if path is not None:
        return FileJobLock.holder(storage, path)
    return LeaseJobLock.holder(storage)
