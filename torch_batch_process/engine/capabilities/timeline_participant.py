"""The batch-time histograms as a commit participant: each vote carries the histogram of its rank's ``process_batch``
seconds since its previous vote; rank 0 gathers them, with the votes' batches, examples and seconds per phase and its
own record writes, into the ranks' activity since the previous timeline point, which goes with a record when the
observer says a point is due (``metrics.jsonl``'s ``timeline`` group: :mod:`torch_batch_process.observe.timeline`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from torch_batch_process.engine.commit.participants import Durable, Participant, Payload, RecordDraft
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.work import Part
from torch_batch_process.observe.timeline import RankActivity

__all__ = ["BatchTimes", "TimelineParticipant"]


@dataclass(frozen=True)
class BatchTimes(Payload):
    """A rank's batch-time histogram since its previous vote (bin -> batches; see
    :mod:`torch_batch_process.observe.histogram`)."""

    key = "batch_times"
    histogram: dict[int, int]


class TimelineParticipant(Participant):
    """The timeline's part in the commits (see the module docstring).

    Args:
        world_size: ranks of this attempt.
        observer: rank 0's observer (``timeline_due``: whether a point goes with a record).

    The activity is updated under the keeper's lock (votes) and by rank 0's record writer (record writes): it has a
    lock of its own.
    """

    def __init__(self, world_size: int, observer: Any) -> None:
        self._world_size = world_size
        self._observer = observer
        self._activity = RankActivity(world_size)
        self._lock = threading.Lock()

    def contribute(self, part: Part, closing: bool) -> BatchTimes | None:
        return BatchTimes(dict(part.batch_times)) if part.batch_times else None

    def merge(self, vote: Vote) -> None:
        payload = vote.payloads.get(BatchTimes)
        batches = sum(b - a for a, b in vote.batches)
        with self._lock:
            self._activity.add_vote(vote.rank, batches, vote.examples, vote.timings,
                                    payload.histogram if payload is not None else None)

    def draft(self, draft: RecordDraft) -> None:
        if self._observer.timeline_due(draft.last):  # a timeline point goes with this record
            with self._lock:
                draft.activity, self._activity = self._activity, RankActivity(self._world_size)

    def after_record(self, durable: Durable) -> None:
        """Counts the record's write (and what the participants before this one did after it, e.g. a table's
        transaction: this participant comes last)."""
        now = time.monotonic()
        with self._lock:  # the oldest commit of a group waited most
            self._activity.add_record_write(now - durable.write_started, now - durable.prepared_at)
