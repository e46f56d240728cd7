"""A table target (``table=``, DESIGN §16) as a commit participant: each vote carries the descriptors of the data
files its stage wrote; rank 0 lists them in the next record as a pending group (``table.pending``) and, once the
record is durable, makes the table transaction (:mod:`torch_batch_process.outputs.tables.commits`). Its restore at
start is the opener's reconciliation of the table with the latest record, under the job lock, before any rank
writes (:meth:`~torch_batch_process.outputs.tables.commits.TableCommits.reconcile`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch_batch_process.engine.commit.participants import Durable, Participant, Payload, RecordDraft
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.work import Part
from torch_batch_process.outputs.records import RecordWriter
from torch_batch_process.outputs.tables.commits import TableCommits

__all__ = ["TableFiles", "TableOutputs"]


@dataclass(frozen=True)
class TableFiles(Payload):
    """A table target's data files of one stage (path, size, rows, ``index`` bounds; Lance: fragment metadata)."""

    key = "table_files"
    files: list[dict[str, Any]]


class TableOutputs(Participant):
    """The table target's part in the commits (see the module docstring).

    Args:
        writer: this rank's record writer (its data files go into the table).
        commits: the table's transactions (rank 0 makes them).
    """

    def __init__(self, writer: RecordWriter, commits: TableCommits) -> None:
        self._writer = writer
        self._commits = commits

    def contribute(self, part: Part, closing: bool) -> TableFiles | None:
        files = self._writer.take_table_files()
        return TableFiles(files) if files else None

    def merge(self, vote: Vote) -> None:
        payload = vote.payloads.get(TableFiles)
        if payload is not None:
            self._commits.add(payload.files)

    def draft(self, draft: RecordDraft) -> None:
        draft.record.table = self._commits.prepare(draft.record.commit)

    def after_record(self, durable: Durable) -> None:
        self._commits.after_record(durable.record, closing=durable.closing)
