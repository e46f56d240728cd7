"""Memory limits (``on_oom="split"``, DESIGN §15) as a commit participant: each vote carries what its rank's
:class:`~torch_batch_process.engine.feed.fitting.BatchFitter` learned since its previous vote and its out-of-memory
counts; rank 0 merges them into the job's limits, stored with every record (``memory_limits``; ``stats.ooms``,
``stats.split_batches`` over all attempts), and shares its merge back with every rank, so that every rank cuts its
batches by what any rank learned. A resumed job's ranks start from the latest record's limits (learned on a device
of the same kind; another kind learns anew)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch_batch_process.engine.commit.participants import Participant, Payload, Payloads, RecordDraft
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.work import Part
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.memory_limits import MemoryLimits

__all__ = ["JobLimits", "MemoryLimitsParticipant", "MemoryNews"]


@dataclass(frozen=True)
class MemoryNews(Payload):
    """What a rank learned about the device's memory since its previous vote."""

    key = "limits"
    limits: dict[str, Any] | None
    """The length ranges whose limits changed (the JSON form of
    :class:`~torch_batch_process.jobstore.memory_limits.MemoryLimits`), or ``None``."""
    ooms: int
    """Out-of-memory errors the rank met."""
    split: int
    """Batches the rank ran in parts."""


@dataclass(frozen=True)
class JobLimits(Payload):
    """The job's limits as rank 0 merged them (the JSON form), shared with every rank when they changed."""

    key = "memory_limits"
    limits: dict[str, Any]


class MemoryLimitsParticipant(Participant):
    """The memory limits' part in the commits (see the module docstring).

    Args:
        fitter: this rank's fitter (it learns nothing with ``on_oom="raise"``: its votes then carry nothing).
        latest: the latest record of earlier attempts (rank 0 continues from its limits and counts).
    """

    def __init__(self, fitter: BatchFitter, latest: CommitRecord | None) -> None:
        self._fitter = fitter
        # rank 0: the job's limits over all attempts, and this call's counts
        stored = latest.memory_limits if latest is not None else None
        self._limits = MemoryLimits.from_json(stored) if stored else None
        self._summary = self._limits.summary() if self._limits is not None else None
        self._changed = False
        self._voted = False  # merged from this attempt's votes (a rank on another kind of device: ignored)
        self._ooms_before = int(latest.stats.get("ooms", 0)) if latest is not None else 0
        self._split_before = int(latest.stats.get("split_batches", 0)) if latest is not None else 0
        self._ooms = self._split = 0

    # ------------------------------------------------------------------ every rank

    def contribute(self, part: Part, closing: bool) -> MemoryNews | None:
        news = self._fitter.take_news()
        ooms, split = self._fitter.take_counts()
        if news is None and not ooms and not split:
            return None
        return MemoryNews(news, ooms, split)

    def learn(self, shared: Payloads) -> None:
        limits = shared.get(JobLimits)
        if limits is not None:
            self._fitter.merge(limits.limits)

    # ------------------------------------------------------------------ rank 0

    def merge(self, vote: Vote) -> None:
        payload = vote.payloads.get(MemoryNews)
        if payload is None:
            return
        self._ooms += payload.ooms
        self._split += payload.split
        news = payload.limits
        if news is None:
            return
        if self._limits is None or not (self._voted or self._limits.same_kind(news)):
            # earlier attempts' limits were learned on another kind of device: this attempt's replace them
            self._limits = MemoryLimits(news["unit"], device=news.get("device", ""))
        self._voted = True
        if self._limits.same_kind(news) and self._limits.merge(news):
            self._changed = True
            self._summary = self._limits.summary()

    def draft(self, draft: RecordDraft) -> None:
        draft.record.memory_limits = self._limits.to_json() if self._limits is not None else None
        draft.record.stats["ooms"] = self._ooms_before + self._ooms
        draft.record.stats["split_batches"] = self._split_before + self._split
        draft.summary.ooms, draft.summary.split_batches = self._ooms, self._split
        draft.summary.memory_limits = self._summary

    def share(self) -> JobLimits | None:
        if not self._changed or self._limits is None:
            return None
        self._changed = False
        return JobLimits(self._limits.to_json())
