"""Commit protocol: exactly-once outputs and exact progress across crashes and resumes.

Storage layout (below the job's storage path)::

    outputs/commit_<n>/rank_<r>/...   committed files written through upload_path() (published)
    result.json                       final result of a finished job (metrics, counts)
    _tbp/job.json                     the job's fingerprint and plan, written once at its first start
    _tbp/commits/<n>.json             commit record n: the durable truth (see below)
    _tbp/states/<n>/rank_<r>.pt       rank r's reducer summaries and processor state at commit n
    _tbp/staging/<n>/rank_<r>/...     files of commit n before they are published
    _tbp/lock, _tbp/lease.json        the job lock

Protocol of commit ``n`` (the numbers go on across attempts):

1. Every rank runs ``on_checkpoint_start()``; files written through ``upload_path()`` since commit
   ``n - 1`` are already in (or, on object stores, finish uploading to) ``staging/<n>/rank_<r>/``.
   Each rank writes ``states/<n>/rank_<r>.pt`` when it has reducers or processor state.
2. The ranks exchange votes (one ``all_gather_object``): status, batches completed since the last
   commit, whether a state file was written.
3. If every vote is OK, rank 0 writes ``commits/<n>.json`` atomically. **This write is the commit
   point**: the record holds the cumulative set of committed global batches, the state files of
   this and of earlier attempts, and the job's fingerprint.
4. Rank 0 tells every rank the outcome (one broadcast); then each rank *publishes* its stage:
   ``staging/<n>/rank_<r>`` moves to ``outputs/commit_<n>/rank_<r>`` (one atomic rename locally).
5. Rank 0 deletes what the new record no longer needs (older records and state files).

Crash anywhere: every step is idempotent and the next start repairs storage under the job lock
before any work (:meth:`CheckpointStore.repair`): stages of commits ``<= n`` (the latest record)
are published, stages and states of commits ``> n`` were never committed and are deleted. So a
file appears under ``outputs/`` only once the record covering it is durable, the batches of an
uncommitted step are processed again and their old files never become visible: every example's
output is committed exactly once.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_batch_process.errors import CheckpointCorruptError, JobMismatchError
from torch_batch_process.engine.ranges import RangeSet
from torch_batch_process.storage.base import TMP_MARKER, Storage

logger = logging.getLogger(__name__)

INTERNAL_DIR = "_tbp"
JOB_FILE = f"{INTERNAL_DIR}/job.json"
COMMITS_DIR = f"{INTERNAL_DIR}/commits"
STATES_DIR = f"{INTERNAL_DIR}/states"
STAGING_DIR = f"{INTERNAL_DIR}/staging"
OUTPUTS_DIR = "outputs"
RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"
ATTEMPT_FILE = f"{INTERNAL_DIR}/attempt.json"

RECORD_FORMAT = "torch_batch_process/commit/1"
JOB_FORMAT = "torch_batch_process/job/1"

_COMMIT_DIGITS = 8


def commit_name(commit: int) -> str:
    """Zero-padded name of commit ``commit`` (sorts in commit order)."""
    return f"{commit:0{_COMMIT_DIGITS}d}"


def staging_dir(commit: int, rank: int | None = None) -> str:
    """Relative path of the stage of ``commit`` (of one rank when ``rank`` is given)."""
    base = f"{STAGING_DIR}/{commit_name(commit)}"
    return base if rank is None else f"{base}/rank_{rank}"


def outputs_dir(commit: int, rank: int | None = None) -> str:
    """Relative path of the published outputs of ``commit`` (of one rank when given)."""
    base = f"{OUTPUTS_DIR}/commit_{commit_name(commit)}"
    return base if rank is None else f"{base}/rank_{rank}"


def state_file(commit: int, rank: int) -> str:
    """Relative path of rank ``rank``'s state file at ``commit``."""
    return f"{STATES_DIR}/{commit_name(commit)}/rank_{rank}.pt"


@dataclass
class JobSpec:
    """What identifies a job: a resume must match it exactly (its fingerprint)."""

    dataset_length: int
    batch_size: int
    processor: str
    """Module-qualified class name (``module.Class``): two jobs with the same class name differ."""
    max_batches: int | None
    dataset_type: str
    """Module-qualified type of the dataset."""

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset_length": self.dataset_length,
            "batch_size": self.batch_size,
            "processor": self.processor,
            "max_batches": self.max_batches,
            "dataset_type": self.dataset_type,
        }

    def differences(self, stored: dict[str, Any]) -> list[str]:
        """Human-readable differences between this spec and a stored one."""
        mine = self.to_json()
        keys = sorted(set(mine) | set(stored))
        return [f"{key}: stored {stored.get(key)!r}, now {mine.get(key)!r}" for key in keys if stored.get(key) != mine.get(key)]


@dataclass
class JobInfo:
    """Contents of ``_tbp/job.json``: the fingerprint and the plan fixed at the job's first start."""

    spec: dict[str, Any]
    planned_batches: int
    job_name: str
    created: float

    def to_json(self) -> dict[str, Any]:
        return {
            "format": JOB_FORMAT,
            "spec": self.spec,
            "planned_batches": self.planned_batches,
            "job_name": self.job_name,
            "created": self.created,
        }

    @classmethod
    def from_json(cls, value: Any, where: str) -> JobInfo:
        try:
            if value.get("format") != JOB_FORMAT:
                raise ValueError(f"unknown format {value.get('format')!r}")
            return cls(
                spec=dict(value["spec"]),
                planned_batches=int(value["planned_batches"]),
                job_name=str(value["job_name"]),
                created=float(value["created"]),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"job file {where} is not a valid job record: {exc}") from exc


@dataclass
class CommitRecord:
    """A durable commit: the state of the job right after commit ``commit``."""

    commit: int
    attempt: int
    world_size: int
    committed: RangeSet
    state_files: list[str | None]
    """State file of each rank of this attempt at this commit (``None``: that rank wrote none)."""
    frozen_state_files: list[str]
    """Last state files of the ranks of earlier attempts: extra reducer slots."""
    reducers: list[dict[str, Any]]
    finished: bool = False
    result: dict[str, Any] | None = None
    time: float = field(default_factory=time.time)
    stats: dict[str, Any] = field(default_factory=dict)
    provenance: list[dict[str, Any]] = field(default_factory=list)
    """Model versions and checkpoints the job reported using (see :mod:`torch_batch_process.provenance`)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "commit": self.commit,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "committed": self.committed.to_json(),
            "state_files": self.state_files,
            "frozen_state_files": self.frozen_state_files,
            "reducers": self.reducers,
            "finished": self.finished,
            "result": self.result,
            "time": self.time,
            "stats": self.stats,
            "provenance": self.provenance,
        }

    @classmethod
    def from_json(cls, value: Any, where: str) -> CommitRecord:
        try:
            if value.get("format") != RECORD_FORMAT:
                raise ValueError(f"unknown format {value.get('format')!r}")
            return cls(
                commit=int(value["commit"]),
                attempt=int(value["attempt"]),
                world_size=int(value["world_size"]),
                committed=RangeSet.from_json(value["committed"]),
                state_files=list(value["state_files"]),
                frozen_state_files=list(value["frozen_state_files"]),
                reducers=list(value["reducers"]),
                finished=bool(value["finished"]),
                result=value.get("result"),
                time=float(value["time"]),
                stats=dict(value.get("stats") or {}),
                provenance=list(value.get("provenance") or []),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"commit record {where} is not a valid record: {exc}") from exc

    def referenced_files(self) -> set[str]:
        """State files this record needs."""
        return {f for f in self.state_files if f} | set(self.frozen_state_files)

    def slot_files(self) -> list[str]:
        """State files whose reducer summaries are slots of the final reduction."""
        return list(self.frozen_state_files) + [f for f in self.state_files if f]


class CheckpointStore:
    """Reads and writes the job's records, states, stages and outputs on a :class:`Storage`."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # ------------------------------------------------------------------ reading

    def load_job(self) -> JobInfo | None:
        """The stored job info, ``None`` for a fresh storage path."""
        try:
            raw = self.storage.read_bytes(JOB_FILE)
        except FileNotFoundError:
            return None
        return JobInfo.from_json(_parse_json(raw, self.storage.url_of(JOB_FILE)), self.storage.url_of(JOB_FILE))

    def commit_numbers(self) -> list[int]:
        """Numbers of the commit records present, ascending."""
        numbers = []
        for name in self.storage.list(COMMITS_DIR):
            stem = name[: -len(".json")] if name.endswith(".json") else ""
            if stem.isdigit():
                numbers.append(int(stem))
        return sorted(numbers)

    def load_latest(self) -> CommitRecord | None:
        """The latest commit record, ``None`` when nothing was committed.

        Raises:
            CheckpointCorruptError: the latest record exists but cannot be read; never falls back.
        """
        numbers = self.commit_numbers()
        if not numbers:
            return None
        rel = f"{COMMITS_DIR}/{commit_name(numbers[-1])}.json"
        where = self.storage.url_of(rel)
        try:
            raw = self.storage.read_bytes(rel)
        except FileNotFoundError as exc:  # deleted between list and read: another job's GC
            raise CheckpointCorruptError(f"commit record {where} vanished while reading it") from exc
        record = CommitRecord.from_json(_parse_json(raw, where), where)
        if record.commit != numbers[-1]:
            raise CheckpointCorruptError(f"commit record {where} says it is commit {record.commit}")
        return record

    def load_state(self, rel: str) -> dict[str, Any]:
        """Loads a state file written by :meth:`write_state`."""
        where = self.storage.url_of(rel)
        try:
            raw = self.storage.read_bytes(rel)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"state file {where} referenced by the last commit is missing") from exc
        try:
            state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unpickling error means a damaged file
            raise CheckpointCorruptError(f"state file {where} cannot be read: {exc}") from exc
        if not isinstance(state, dict) or "reducers" not in state:
            raise CheckpointCorruptError(f"state file {where} is not a torch_batch_process state file")
        return state

    def unpublished_commits(self, latest: CommitRecord) -> list[int]:
        """Commits ``<= latest`` whose staged files are not all published yet (a crash while publishing)."""
        numbers = []
        for name in self.storage.list(STAGING_DIR):
            if name.isdigit() and int(name) <= latest.commit:
                if any(entry.startswith("rank_") for entry in self.storage.list(staging_dir(int(name)))):
                    numbers.append(int(name))
        return numbers

    def check_integrity(self, latest: CommitRecord | None) -> None:
        """Raises :class:`CheckpointCorruptError` when the stored progress is damaged.

        Two kinds of damage would otherwise make a resume silently redo (and duplicate) committed work
        or fail hours later: commit records missing while the job clearly committed before (its
        ``outputs/``, ``result.json`` or ``metrics.jsonl`` exist: a partial copy or restore), and state
        files that the latest record needs but that are gone.
        """
        if latest is None:
            evidence = [rel for rel in (OUTPUTS_DIR, RESULT_FILE, METRICS_FILE) if self._present(rel)]
            if evidence:
                raise CheckpointCorruptError(
                    f"storage_path {self.storage.url!r} holds a job that has committed before ({', '.join(evidence)} "
                    f"exist) but its commit records ({self.storage.url_of(COMMITS_DIR)}/) are missing, so its "
                    "progress is unknown; resuming would process everything again and duplicate outputs. Nothing was "
                    "changed. Restore the missing records, or start afresh with resume=False (this erases the "
                    "stored progress and outputs) or a new storage_path."
                )
            return
        present: dict[str, set[str]] = {}  # one listing per state folder, not one request per file
        for rel in latest.referenced_files():
            folder = rel.rsplit("/", 1)[0]
            if folder not in present:
                present[folder] = set(self.storage.list(folder))
        missing = sorted(rel for rel in latest.referenced_files() if rel.rsplit("/", 1)[1] not in present[rel.rsplit("/", 1)[0]])
        if missing:
            raise CheckpointCorruptError(
                f"commit record {self.storage.url_of(f'{COMMITS_DIR}/{commit_name(latest.commit)}.json')} needs "
                f"{len(missing)} state file(s) that are missing (first: {self.storage.url_of(missing[0])}); the job "
                "cannot resume with exact metrics and processor state. Nothing was changed. Restore them, or start "
                "afresh with resume=False (this erases the stored progress and outputs) or a new storage_path."
            )

    def _present(self, rel: str) -> bool:
        """Whether file ``rel`` exists, or folder ``rel`` holds anything."""
        return bool(self.storage.list(rel)) or self.storage.exists(rel)

    # ------------------------------------------------------------------ writing

    def write_job(self, job: JobInfo) -> None:
        self.storage.write_json(JOB_FILE, job.to_json(), fsync=True)

    def write_state(self, commit: int, rank: int, reducers: list[Any], processor: Any) -> str:
        """Writes rank ``rank``'s state at ``commit``; returns its relative path."""
        buffer = io.BytesIO()
        torch.save({"reducers": reducers, "processor": processor}, buffer)
        rel = state_file(commit, rank)
        self.storage.write_bytes(rel, buffer.getvalue(), fsync=True)
        return rel

    def write_record(self, record: CommitRecord) -> None:
        """Writes a commit record atomically: the commit point."""
        self.storage.write_json(
            f"{COMMITS_DIR}/{commit_name(record.commit)}.json", record.to_json(), fsync=True, compact=True
        )

    def next_attempt(self, latest: CommitRecord | None, world_size: int) -> int:
        """Counts this start as a new attempt (also attempts that crashed before their first commit)."""
        previous = latest.attempt if latest else 0
        try:
            stored = self.storage.read_json(ATTEMPT_FILE)
            previous = max(previous, int(stored.get("attempt", 0)))
        except (FileNotFoundError, ValueError, AttributeError, TypeError):
            pass
        attempt = previous + 1
        self.storage.write_json(ATTEMPT_FILE, {"attempt": attempt, "started": time.time(), "world_size": world_size})
        return attempt

    def write_result(self, result: dict[str, Any]) -> None:
        self.storage.write_json(RESULT_FILE, result)

    def publish(self, commit: int, rank: int | None = None) -> None:
        """Moves the stage of ``commit`` (one rank's, or all of it) into ``outputs/``; idempotent."""
        if rank is not None:
            self.storage.move(staging_dir(commit, rank), outputs_dir(commit, rank))
            return
        for name in self.storage.list(staging_dir(commit)):
            if name.startswith("rank_"):
                self.storage.move(f"{staging_dir(commit)}/{name}", f"{outputs_dir(commit)}/{name}")
        self.storage.delete(staging_dir(commit), recursive=True)

    # -------------------------------------------------------------- maintenance

    def repair(self, latest: CommitRecord | None) -> None:
        """Brings storage in line with the latest record after a crash (rank 0, under the job lock).

        Publishes the stages of committed commits, deletes stages and state files of commits that
        never became durable, and removes temporary files of interrupted writes.
        """
        last = latest.commit if latest else 0
        for name in self.storage.list(STAGING_DIR):
            if not name.isdigit():
                self.storage.delete(f"{STAGING_DIR}/{name}", recursive=True)
                continue
            number = int(name)
            if not any(entry.startswith("rank_") for entry in self.storage.list(staging_dir(number))):
                self.storage.delete(staging_dir(number), recursive=True)  # nothing staged, or already published
            elif number <= last:
                logger.info("publishing the outputs of commit %d, interrupted before they were published", number)
                self.publish(number)
            else:
                logger.info("discarding the uncommitted outputs of commit %d", number)
                self.storage.delete(staging_dir(number), recursive=True)
        keep = latest.referenced_files() if latest else set()
        keep_dirs = {rel.rsplit("/", 1)[0] for rel in keep}
        for name in self.storage.list(STATES_DIR):
            rel_dir = f"{STATES_DIR}/{name}"
            if rel_dir not in keep_dirs:
                self.storage.delete(rel_dir, recursive=True)
        for name in self.storage.list(COMMITS_DIR):
            stem = name[: -len(".json")] if name.endswith(".json") else ""
            if TMP_MARKER in name or (stem.isdigit() and int(stem) < last):
                self.storage.delete(f"{COMMITS_DIR}/{name}")  # interrupted writes, superseded records
        for name in self.storage.list(INTERNAL_DIR):
            if TMP_MARKER in name:
                self.storage.delete(f"{INTERNAL_DIR}/{name}")

    def collect_garbage(self, record: CommitRecord, previous: CommitRecord | None) -> None:
        """Deletes what ``record`` supersedes: the previous record and its unreferenced state files.

        One bulk delete on object stores, no listing (records older than ``previous`` are removed by
        :meth:`repair` at the start of an attempt).
        """
        if previous is None:
            return
        doomed = sorted(previous.referenced_files() - record.referenced_files())
        doomed.append(f"{COMMITS_DIR}/{commit_name(previous.commit)}.json")
        self.storage.delete_files(doomed)
        if self.storage.is_local:
            for folder in sorted({rel.rsplit("/", 1)[0] for rel in doomed[:-1]}):
                try:
                    self.storage.delete(folder)  # the folder, once empty
                except Exception:  # noqa: BLE001 - not empty yet: another rank's file stays
                    pass
            try:
                self.storage.delete(staging_dir(previous.commit))
            except Exception:  # noqa: BLE001 - a rank may still be publishing into it
                pass

    def erase(self) -> None:
        """Deletes everything the library stored (``resume=False``): records, states, outputs.

        The job file goes first and the commit records last, so that a crash midway leaves a storage
        path that a resume refuses (records without a job file) instead of one it would resume
        with outputs gone or duplicated.
        """
        for rel in (
            JOB_FILE,
            RESULT_FILE,
            OUTPUTS_DIR,
            STAGING_DIR,
            STATES_DIR,
            ATTEMPT_FILE,
            METRICS_FILE,
            "tensorboard",
            COMMITS_DIR,
        ):
            self.storage.delete(rel, recursive=True)

    def has_outputs(self) -> bool:
        """Whether ``outputs/`` holds anything."""
        return bool(self.storage.list(OUTPUTS_DIR))


def _parse_json(raw: bytes, where: str) -> Any:
    import json

    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{where} is corrupt ({exc}). The job cannot resume from it; to start the job afresh, "
            "pass resume=False (this erases the stored progress and outputs) or use a new storage_path."
        ) from exc


def qualified_name(cls: type) -> str:
    """``module.QualifiedName`` of a class, as stored in a job's fingerprint."""
    return f"{cls.__module__}.{cls.__qualname__}"


def check_fingerprint(job: JobInfo, spec: JobSpec, url: str) -> None:
    """Raises :class:`JobMismatchError` when the stored job is not this one."""
    differences = spec.differences(job.spec)
    if differences:
        raise JobMismatchError(
            f"storage_path {url!r} holds another job ({'; '.join(differences)}). Nothing was changed. "
            "To resume it, run it with its original settings; to start this job afresh there, pass "
            "resume=False (this erases the stored progress and outputs), or use a new storage_path."
        )
