"""Completeness of the record outputs read back: the rows found in the shards against the rows committed.

Every commit record counts the record rows (``context.write()``) committed so far, over all attempts
(``stats["record_rows"]``). Once a job, or one of its ``retry_failed=True`` runs, is finished and every stage
its records commit is published, the shards it published hold exactly that many rows. Fewer means shards
were deleted or not restored with the rest; more means shards were copied in. Either way a read-back would
return a table that silently lacks or repeats rows, so :func:`check_rows` raises
:class:`~torch_batch_process.errors.OutputCorruptError` instead.

A retry publishes to the job's own ``outputs/``, with stage numbers after every stage the job and its earlier
retries used (:mod:`torch_batch_process.jobstore.retries`): a shard of ``outputs/commit_<s>/`` belongs to the retry
with the largest first stage at or below ``s``, else to the job (:meth:`CommittedRows.owner`). Retries of earlier
versions kept theirs in ``retries/<k>/outputs/``.

A job that is not finished (running, preempted, failed, killed) is checked for rows missing only: its published
shards and the committed rows still in its segments (read back with them) hold at least the rows of the record
read first (a running job commits more meanwhile). Not checked: a job killed while publishing (its outputs trail
its records until the next start publishes them), and records written before rows were counted.

Order matters while a job may be running: :func:`committed_rows` reads the records, then lists the staged
stages, and only then does the caller list the shards. A stage moves from ``_tbp/staging/`` to ``outputs/``,
so it is seen in one place or the other, and the shards of a retry that starts later belong to none of the
checked jobs (their stages come after the first stages known).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch_batch_process.errors import CheckpointCorruptError, OutputCorruptError
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.layout import OUTPUTS_DIR, RETRIES_DIR
from torch_batch_process.jobstore.retries import retry_first_stages, retry_numbers
from torch_batch_process.jobstore.store import latest_record_at, output_stage, unpublished_stages_at
from torch_batch_process.storage.base import Storage

__all__ = ["CommittedRows", "check_rows", "committed_rows", "still_staged"]

logger = logging.getLogger(__name__)


@dataclass
class CommittedRows:
    """What :func:`committed_rows` read: the rows to find per job folder, and where each retry's stages start."""

    rows: dict[str, int] = field(default_factory=dict)
    """Folder (``""`` for the job, ``"retries/<k>"`` for a retry) -> the rows its final record commits, for each
    folder whose shards can be checked now."""
    first_stages: dict[str, int] = field(default_factory=dict)
    """``"retries/<k>"`` -> its first stage, for the retries that publish to the job's ``outputs/``."""
    last_stage: int | None = None
    """The last stage the job itself used (``None``: unknown); later stages are its retries'."""
    at_least: set[str] = field(default_factory=set)
    """Folders of :attr:`rows` whose job is not finished: their shards and segments may hold more rows, not fewer."""

    def owner(self, shard: str) -> str | None:
        """The folder whose outputs hold ``shard`` (``None``: a job that is not known yet, e.g. a retry that
        started after the records were read)."""
        if shard.startswith(f"{RETRIES_DIR}/"):  # a retry of an earlier version: in its own outputs/
            return shard[: shard.index("/", len(RETRIES_DIR) + 1)]
        stage = output_stage(shard.split("/", 2)[1]) if shard.count("/") >= 2 else None
        if stage is None:
            return ""
        owners = [(first, folder) for folder, first in self.first_stages.items() if first <= stage]
        if owners:
            return max(owners)[1]
        if self.last_stage is not None and stage > self.last_stage:
            return None
        return ""


def committed_rows(storage: Storage) -> CommittedRows:
    """The record rows that the job and its retries committed, for each one whose shards can be checked now
    (see the module docstring)."""
    found = CommittedRows(first_stages=retry_first_stages(storage))
    for root in ["", *(f"{RETRIES_DIR}/{k}" for k in retry_numbers(storage))]:
        try:
            record = latest_record_at(storage, root)
        except CheckpointCorruptError:  # reading the outputs does not need the records: no check
            continue
        if root == "" and record is not None:
            found.last_stage = max(record.commit, record.last_stage)
        rows = record.stats.get("record_rows") if record is not None else None
        if not isinstance(rows, int):
            continue
        if record.finished:
            if not still_staged(storage, root, record, "outputs"):
                found.rows[root] = rows
        elif root == "" and not unpublished_stages_at(storage, record, root):  # (a retry's segments are not read)
            found.rows[root] = rows
            found.at_least.add(root)
    return found


def still_staged(storage: Storage, root: str, record: CommitRecord, what: str) -> bool:
    """Whether stages that ``record`` commits are still staged below ``root`` (a kill while publishing them: the
    next start publishes them); logs a warning naming ``what`` is incomplete if so."""
    if not unpublished_stages_at(storage, record, root):
        return False
    logger.warning(
        "%s: committed %s are still staged (the job was killed while publishing them); run the job again to "
        "publish them (it finishes at once). Reading what is published.",
        storage.url_of(root),
        what,
    )
    return True


def check_rows(storage: Storage, expected: CommittedRows, shard_rows: Iterable[tuple[str, int]]) -> None:
    """Raises :class:`OutputCorruptError` when a checked job's shards (``(shard, rows)`` pairs, some shards
    may come in several pairs) hold another number of rows than its records committed."""
    found: dict[str | None, int] = {}
    for shard, count in shard_rows:
        root = expected.owner(shard)
        found[root] = found.get(root, 0) + count
    for root, rows in expected.rows.items():
        have = found.get(root, 0)
        if have == rows or (root in expected.at_least and have > rows):
            continue
        what = (
            "shards are missing (deleted, or not restored with the rest); restore them from a backup"
            if have < rows and root not in expected.at_least
            else "shards or record segments (_tbp/segments/) are missing or cut short (deleted, or not restored "
            "with the rest); restore them from a backup"
            if have < rows
            else "shards were added (copied in twice?); remove the files that the job did not write"
        )
        outputs = storage.url_of(OUTPUTS_DIR if root == "" or root in expected.first_stages else f"{root}/{OUTPUTS_DIR}")
        who = f"the job's retry {root}" if root else "the job"
        raise OutputCorruptError(
            f"{outputs}: {who} committed {rows} record rows, but its shards hold "
            f"{have}: {what}. Reading on would give a table with rows {'missing' if have < rows else 'repeated'}."
        )
