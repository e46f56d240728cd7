"""Integrity checks of a job's stored progress before a resume: damage is an error, never a restart from zero.

A resume trusts the latest commit record. Two kinds of damage would make it silently redo (and duplicate)
committed work, or fail hours later: commit records missing while the job clearly committed before (a partial
copy or restore), and files the latest record needs (state files, committed output folders) that are gone.
Nothing here changes storage.
"""

from __future__ import annotations

import logging

from torch_batch_process.errors import CheckpointCorruptError
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.layout import (
    COMMITS_DIR,
    METRICS_FILE,
    OUTPUTS_DIR,
    RESULT_FILE,
    number_name,
    outputs_dir,
    record_file,
)
from torch_batch_process.jobstore.retries import retry_first_stages
from torch_batch_process.jobstore.store import JobStore, output_stage
from torch_batch_process.storage.base import Storage

__all__ = ["check_integrity", "warn_of_strays"]

logger = logging.getLogger(__name__)


def check_integrity(store: JobStore, latest: CommitRecord | None) -> None:
    """Raises :class:`CheckpointCorruptError` when the stored progress is damaged.

    Two kinds of damage would otherwise make a resume silently redo (and duplicate) committed work, or
    fail hours later: commit records missing while the job clearly committed before (its ``outputs/``,
    ``result.json`` or ``metrics.jsonl`` exist: a partial copy or restore), and state files that the
    latest record needs but that are gone (of a finished job only a warning: its result is in the record).
    """
    if latest is None:
        evidence = [rel for rel in (RESULT_FILE, METRICS_FILE) if _present(store.storage, rel)]
        if store.has_outputs() if store.first_stage > 1 else _present(store.storage, OUTPUTS_DIR):
            evidence.insert(0, OUTPUTS_DIR)  # a retry's: its own stages' folders, not those of the job it retries
        if evidence:
            raise CheckpointCorruptError(
                f"storage_path {store.storage.url!r} holds a job that has committed before ({', '.join(evidence)} "
                f"exist) but its commit records ({store.storage.url_of(COMMITS_DIR)}/) are missing, so its "
                "progress is unknown; resuming would process everything again and duplicate outputs. Nothing was "
                "changed. Restore the missing records, or start afresh with resume=False (this erases the "
                "stored progress and outputs) or a new storage_path."
            )
        return
    present: dict[str, set[str]] = {}  # one listing per state folder, not one request per file
    missing = []
    for rel in sorted(latest.referenced_files()):
        folder, name = rel.rsplit("/", 1)
        if folder not in present:
            present[folder] = set(store.storage.list(folder))
        if name not in present[folder]:
            missing.append(rel)
    if missing and latest.finished:  # its result is in the record: the state files are not needed to report it
        logger.warning(
            "commit record %s names %d state file(s) that are missing (first: %s): the job finished; its result "
            "stands",
            store.storage.url_of(record_file(latest.commit)), len(missing), store.storage.url_of(missing[0]),
        )
    elif missing:
        raise CheckpointCorruptError(
            f"commit record {store.storage.url_of(record_file(latest.commit))} needs {len(missing)} state file(s) "
            f"that are missing (first: {store.storage.url_of(missing[0])}); the job cannot resume with exact "
            "metrics and processor state. Nothing was changed. Restore them, or start afresh with resume=False "
            "(this erases the stored progress and outputs) or a new storage_path."
        )
    _check_outputs(store, latest)


def _check_outputs(store: JobStore, latest: CommitRecord) -> None:
    """Committed output folders that are gone (deleted by hand, a partial copy): a resume refuses, since the
    job would end with their examples' outputs missing; a finished job only warns (its outputs were made)."""
    if latest.output_stages is None or not len(latest.output_stages):
        return
    present = {name for name in store.storage.list(OUTPUTS_DIR) if name.startswith("commit_")}
    present.update(f"commit_{number_name(stage)}" for stage, ranks in store.staged().items() if ranks)
    missing = [stage for stage in latest.output_stages if f"commit_{number_name(stage)}" not in present]
    if not missing:
        return
    message = (
        f"{len(missing)} committed output folder(s) are missing (first: "
        f"{store.storage.url_of(outputs_dir(missing[0]))}; committed by "
        f"{store.storage.url_of(record_file(latest.commit))})"
    )
    if latest.finished:
        logger.warning("%s: the job finished; its result stands, but those outputs are gone", message)
        return
    raise CheckpointCorruptError(
        f"{message}: resuming would end the job with their examples' outputs missing. Nothing was changed. "
        "Restore them, or start afresh with resume=False (this erases the stored progress and outputs) or a new "
        "storage_path."
    )


def warn_of_strays(store: JobStore, latest: CommitRecord) -> None:
    """Warns of ``outputs/commit_<s>`` folders that no commit record covers. The job cannot have written them (it
    publishes a stage only once a record covers it), so they were copied in by hand; they are left alone, but a
    reader that globs ``outputs/`` would see their files. The folders of the job's retries (``retry_failed``: their
    stages come after the job's) are theirs, and those of the job a retry retries (below its first stage) its."""
    if latest.output_stages is None:
        return
    published = (name for name in store.storage.list(OUTPUTS_DIR) if name.startswith("commit_"))
    strays = [name for name in published if not _covered(name, latest)]
    if strays:
        strays = _not_of_other_jobs(store, strays)
    if strays:
        logger.warning(
            "%d folder(s) under %s are not covered by the job's commit records, so the job did not write them "
            "(first: %s); they are left as they are, but anything that reads outputs/ by a glob sees their files: "
            "remove them",
            len(strays),
            store.storage.url_of(OUTPUTS_DIR),
            strays[0],
        )


def _not_of_other_jobs(store: JobStore, names: list[str]) -> list[str]:
    """``names`` less the output folders of the other jobs that share ``outputs/``: the job a retry retries (below
    the retry's first stage), and the retries of a job (from the first stage of its first retry on)."""
    firsts = retry_first_stages(store.storage).values()
    limit = min(firsts) if firsts else None
    kept = []
    for name in names:
        stage = output_stage(name)
        if stage is not None and (stage < store.first_stage or (limit is not None and stage >= limit)):
            continue
        kept.append(name)
    return sorted(kept)


def _covered(folder: str, latest: CommitRecord) -> bool:
    """Whether output folder ``commit_<s>`` is stage ``s`` of a record, by its canonical name."""
    stem = folder[len("commit_") :]
    if not (stem.isdigit() and stem == number_name(int(stem))):
        return False
    # a committed stage without output files gets one when the next start rolls record segments over (segments.py)
    return int(stem) in latest.output_stages or latest.has_stage(int(stem))


def _present(storage: Storage, rel: str) -> bool:
    """Whether file ``rel`` exists, or folder ``rel`` holds anything."""
    return bool(storage.list(rel)) or storage.exists(rel)
