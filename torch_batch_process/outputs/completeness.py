"""Completeness of the record outputs read back: the rows found in the shards against the rows committed.

Every commit record counts the record rows (``context.write()``) committed so far, over all attempts
(``stats["record_rows"]``). Once a job, or one of its ``retry_failed=True`` runs, is finished and every stage
its records commit is published, the shards below its folder hold exactly that many rows. Fewer means shards
were deleted or not restored with the rest; more means shards were copied in. Either way a read-back would
return a table that silently lacks or repeats rows, so :func:`check_rows` raises
:class:`~torch_batch_process.errors.OutputCorruptError` instead.

Not checked: a job still running or killed while publishing (its outputs trail its records until the next
start publishes them), and records written before rows were counted.

Order matters while a job may be running: :func:`committed_rows` reads the records, then lists the staged
stages, and only then does the caller list the shards. A stage moves from ``_tbp/staging/`` to ``outputs/``,
so it is seen in one place or the other, and a retry that starts later is not among the checked folders.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch_batch_process.errors import CheckpointCorruptError, OutputCorruptError
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.layout import OUTPUTS_DIR, RETRIES_DIR
from torch_batch_process.jobstore.retries import retry_numbers
from torch_batch_process.jobstore.store import latest_record_at, unpublished_stages_at
from torch_batch_process.storage.base import Storage

__all__ = ["check_rows", "committed_rows", "root_of", "still_staged"]

logger = logging.getLogger(__name__)


def committed_rows(storage: Storage) -> dict[str, int]:
    """Folder (``""`` for the job, ``"retries/<k>"`` for a retry) -> the record rows its final record commits,
    for each folder whose shards can be checked now (see the module docstring)."""
    expected: dict[str, int] = {}
    for root in ["", *(f"{RETRIES_DIR}/{k}" for k in retry_numbers(storage))]:
        try:
            record = latest_record_at(storage, root)
        except CheckpointCorruptError:  # reading the outputs does not need the records: no check
            continue
        rows = record.stats.get("record_rows") if record is not None and record.finished else None
        if not isinstance(rows, int):
            continue
        if not still_staged(storage, root, record, "outputs"):
            expected[root] = rows
    return expected


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


def root_of(shard: str) -> str:
    """The folder (as :func:`committed_rows` names it) whose outputs hold ``shard``."""
    if shard.startswith(f"{RETRIES_DIR}/"):
        return shard[: shard.index("/", len(RETRIES_DIR) + 1)]
    return ""


def check_rows(storage: Storage, expected: dict[str, int], shard_rows: Iterable[tuple[str, int]]) -> None:
    """Raises :class:`OutputCorruptError` when a checked folder's shards (``(shard, rows)`` pairs, some shards
    may come in several pairs) hold another number of rows than its records committed."""
    found: dict[str, int] = {}
    for shard, count in shard_rows:
        root = root_of(shard)
        found[root] = found.get(root, 0) + count
    for root, rows in expected.items():
        have = found.get(root, 0)
        if have == rows:
            continue
        what = (
            "shards are missing (deleted, or not restored with the rest); restore them from a backup"
            if have < rows
            else "shards were added (copied in twice?); remove the files that the job did not write"
        )
        outputs = storage.url_of(f"{root}/{OUTPUTS_DIR}" if root else OUTPUTS_DIR)
        raise OutputCorruptError(
            f"{outputs}: the job committed {rows} record rows, but the shards hold "
            f"{have}: {what}. Reading on would give a table with rows {'missing' if have < rows else 'repeated'}."
        )
