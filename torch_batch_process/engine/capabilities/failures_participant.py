"""Failing examples (``on_error="skip"``, DESIGN §11) as a commit participant: each vote carries how many examples
its rank recorded as failing in the stage it commits (the failure records themselves are files of that stage, published
to ``failures/``); rank 0 adds them up over all attempts (``stats.failed_examples``, the result's
``failed_examples``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch_batch_process.engine.commit.participants import Participant, Payload, RecordDraft
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.feed.failing_examples import FailureLog
from torch_batch_process.engine.work import Part
from torch_batch_process.jobstore.formats import CommitRecord

__all__ = ["FailedExamples", "FailingExamplesParticipant", "failed_before"]


def failed_before(latest: CommitRecord | None) -> int:
    """Failed examples committed by earlier attempts."""
    return int(latest.stats.get("failed_examples", 0)) if latest is not None else 0


@dataclass(frozen=True)
class FailedExamples(Payload):
    """The examples a rank recorded as failing in the stage its vote commits."""

    key = "failed"
    count: int


class FailingExamplesParticipant(Participant):
    """The failing examples' part in the commits (see the module docstring).

    Args:
        log: this rank's failing examples (it records none without ``on_error="skip"``).
        latest: the latest record of earlier attempts (rank 0 continues its count).
    """

    def __init__(self, log: FailureLog, latest: CommitRecord | None) -> None:
        self._log = log
        self.failed = failed_before(latest)
        """Rank 0: the failed examples committed over all attempts, as merged so far."""

    def contribute(self, part: Part, closing: bool) -> FailedExamples | None:
        count = self._log.take()
        return FailedExamples(count) if count else None

    def merge(self, vote: Vote) -> None:
        payload = vote.payloads.get(FailedExamples)
        if payload is not None:
            self.failed += payload.count

    def draft(self, draft: RecordDraft) -> None:
        draft.record.stats["failed_examples"] = self.failed
        draft.summary.failed_examples = self.failed
