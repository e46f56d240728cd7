"""The committed failure records of a job as stored (``on_error="skip"``, DESIGN §11), read back and checked.

A job's failing examples are committed as JSON lines in ``<root>/failures/*.jsonl`` (written by
:mod:`torch_batch_process.engine.feed.failing_examples`), and each commit record counts them
(``stats["failed_examples"]``). Three readers depend on every record being there: ``tbp failures`` and
:func:`~torch_batch_process.read_failures` list them, ``retry_failed=True`` retries them, and a keyed job's read-back
and incremental planner treat each one as its key's newest event (a tombstone that hides the key's older row,
:mod:`torch_batch_process.outputs.keyed.runs`). A damaged file, or files deleted or copied in, would make them list,
retry or serve the wrong examples silently: :func:`read_failure_records` raises
:class:`~torch_batch_process.errors.OutputCorruptError` naming the file or folder instead. Read-only.
"""

from __future__ import annotations

import json
from typing import Any

from torch_batch_process.errors import CheckpointCorruptError, OutputCorruptError
from torch_batch_process.jobstore.layout import FAILURES_DIR
from torch_batch_process.jobstore.store import latest_record_at
from torch_batch_process.outputs.completeness import still_staged
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.errors import NotAFileError

__all__ = ["read_failure_records"]


def read_failure_records(storage: Storage, root: str = "") -> list[dict[str, Any]]:
    """The committed failure records in ``<root>/failures/`` of ``storage``, ordered by dataset index.

    Raises:
        OutputCorruptError: a failures file cannot be read, or a finished job's files hold another number of
            records than its commit records count (files deleted or copied in): a retry would silently forget
            the missing ones, a keyed job's read-back would serve a failed key's stale row.
    """
    expected = _committed_failures(storage, root)  # before listing failures/: a stage moves from staging to there
    folder = f"{root}/{FAILURES_DIR}" if root else FAILURES_DIR
    records: list[dict[str, Any]] = []
    for name in storage.list(folder):
        if name.endswith(".jsonl"):
            rel = f"{folder}/{name}"
            try:
                lines = storage.read_bytes(rel).decode("utf-8").splitlines()
                found = [json.loads(line) for line in lines if line.strip()]
                if not all(isinstance(record, dict) for record in found):
                    raise ValueError("a line is not a JSON object")
            except (ValueError, NotAFileError) as exc:  # bad JSON or UTF-8, a folder in its place
                raise OutputCorruptError(
                    f"{storage.url_of(rel)}: this committed failures file cannot be read ({exc}); it is damaged. "
                    "Restore it from a backup: until then its examples can be neither listed nor retried (by "
                    "retry_failed=True, or a keyed job's incremental=True), nor hidden from a keyed job's read-back"
                ) from exc
            records.extend(found)
    if expected is not None and len(records) != expected:
        change = "deleted, or not restored with the rest" if len(records) < expected else "copied in twice?"
        raise OutputCorruptError(
            f"{storage.url_of(folder)}: the job committed {expected} failure record(s), but its files hold "
            f"{len(records)} (files {change}). Restore the folder from a backup; reading on would list, and "
            "retry_failed=True would retry, the wrong examples (and a keyed job would serve failed keys' stale rows)"
        )
    return sorted(records, key=lambda r: (r.get("index", 0), r.get("attempt", 0)))


def _committed_failures(storage: Storage, root: str) -> int | None:
    """The failure records that the finished job in folder ``root`` committed; ``None`` when that cannot be
    checked now: a job still running or paused (its files may trail or pass its last record), a damaged record
    (the files can still be read), or committed failures still staged (a kill while publishing them: warned)."""
    try:
        record = latest_record_at(storage, root)
    except CheckpointCorruptError:
        return None
    if record is None or still_staged(storage, root, record, "failure records") or not record.finished:
        return None
    count = record.stats.get("failed_examples")
    return count if isinstance(count, int) else None
