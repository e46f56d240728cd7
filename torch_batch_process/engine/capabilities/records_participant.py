"""Record outputs (``context.write()``, DESIGN §10) as a commit participant: each vote carries the rows its stage
committed, the rows its rank holds in segments only, and its record schema when it changed; rank 0 refuses votes whose
rows do not unify with the job's, adds the rows up (``stats.record_rows``: read-back checks the shards against the
sum) and keeps each rank's segment rows (``stats.segment_rows``: the next start checks the leftover segments against
them) and the committed schema (``record_schema``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch_batch_process.engine.commit.participants import Participant, Payload, RecordDraft
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.work import Part
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.schema import RecordSchema, unify
from torch_batch_process.outputs.records import RecordWriter

__all__ = ["RecordOutputs", "RecordRows"]


@dataclass(frozen=True)
class RecordRows(Payload):
    """A rank's record outputs in one vote."""

    key = "rows"
    rows: int
    """Rows that joined shards in the stage committed (0: none)."""
    segment_rows: list[int] | None
    """``[rows in segments only, newest stage with rows]`` (``None``: the rank never wrote rows to segments)."""
    schema: RecordSchema | None
    """The rank's record schema when it changed since its previous vote (``None``: unchanged, or no rows yet)."""


class RecordOutputs(Participant):
    """The record outputs' part in the commits (see the module docstring).

    Args:
        writer: this rank's record writer.
        latest: the latest record of earlier attempts (rank 0 continues its counts and schema).
    """

    def __init__(self, writer: RecordWriter, latest: CommitRecord | None) -> None:
        self._writer = writer
        self._sent_schema: RecordSchema | None = None  # the record schema this rank's votes carried last
        # rank 0: the committed rows' columns (every vote's must unify with them); record rows committed over all
        # attempts (None: an earlier attempt's records did not count them); rank -> [rows in its segments only,
        # newest stage with rows] (this attempt's: the start rolled earlier ones)
        self.schema: RecordSchema | None = latest.record_schema if latest is not None else None
        rows = latest.stats.get("record_rows") if latest is not None else 0
        self.record_rows: int | None = rows if isinstance(rows, int) else None
        self.segment_rows: dict[int, list[int]] = {}
        self._unified: RecordSchema | None = None  # checked, for the votes being merged

    # ------------------------------------------------------------------ every rank

    def contribute(self, part: Part, closing: bool) -> RecordRows | None:
        rows = self._writer.take_rows()
        segment_rows = self._writer.segment_rows()
        schema = self._writer.schema
        if schema is self._sent_schema:  # an Arrow schema pickles in ~45 us: not sent at every commit
            schema = None
        else:
            self._sent_schema = schema
        if not rows and segment_rows is None and schema is None:
            return None
        return RecordRows(rows, segment_rows, schema)

    # ------------------------------------------------------------------ rank 0

    def before_record(self, record: CommitRecord) -> None:
        """One process: the rows of the stages sealed so far are in the segment log before the record commits them
        (the seal queued their append; the record writer makes what is still queued,
        :class:`~torch_batch_process.outputs.records.RecordWriter` ``sole``)."""
        self._writer.appended()

    def check(self, votes: Sequence[Vote]) -> None:
        """Raises :class:`~torch_batch_process.errors.SchemaConflictError` when a vote's rows do not unify with the
        job's."""
        schema = self.schema
        for vote in votes:
            payload = vote.payloads.get(RecordRows)
            if payload is not None and payload.schema is not None:
                schema = unify(schema, payload.schema)
        self._unified = schema

    def merge(self, vote: Vote) -> None:
        self.schema = self._unified
        payload = vote.payloads.get(RecordRows)
        if payload is None:
            return
        if self.record_rows is not None:
            self.record_rows += payload.rows
        if payload.segment_rows is not None:
            self.segment_rows[vote.rank] = list(payload.segment_rows)

    def draft(self, draft: RecordDraft) -> None:
        draft.record.record_schema = self.schema
        if self.record_rows is not None:
            draft.record.stats["record_rows"] = self.record_rows
        segment_rows = {str(rank): value for rank, value in sorted(self.segment_rows.items()) if value[0] > 0}
        if segment_rows:  # the rows a kill or a failure would leave in segments (see outputs/segments.py)
            draft.record.stats["segment_rows"] = segment_rows
