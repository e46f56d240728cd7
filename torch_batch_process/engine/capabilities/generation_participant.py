"""Generation (DESIGN §19) as a commit participant: each vote carries the prompts and tokens of the batches its rank
delivered since its previous vote (the batches in that vote: a batch still in flight counts only once it is
committed); rank 0 adds them up over every attempt into the record's ``stats`` (``generated_prompts``, failed
prompts included; ``prompt_tokens``; ``completion_tokens``), so the job's totals count each prompt once, whatever was
generated again after a kill or a stop."""

from __future__ import annotations

from dataclasses import dataclass

from torch_batch_process.engine.commit.participants import Participant, Payload, RecordDraft
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.feed.in_flight import InFlight
from torch_batch_process.engine.work import Part
from torch_batch_process.jobstore.formats import CommitRecord

__all__ = ["STATS", "GeneratedTokens", "GenerationParticipant"]

STATS = ("generated_prompts", "prompt_tokens", "completion_tokens")
"""The record's ``stats`` this participant keeps (totals over every attempt)."""


@dataclass(frozen=True)
class GeneratedTokens(Payload):
    """Prompts and tokens of the batches a rank delivered since its previous vote."""

    key = "generation"
    prompts: int
    prompt_tokens: int
    completion_tokens: int


class GenerationParticipant(Participant):
    """The generation counts' part in the commits (see the module docstring).

    Args:
        in_flight: this rank's batches in flight (it counts what it delivered).
        latest: the latest record of earlier attempts (rank 0 continues from its totals).
    """

    def __init__(self, in_flight: InFlight, latest: CommitRecord | None) -> None:
        self._in_flight = in_flight
        stats = latest.stats if latest is not None else {}
        self._totals = [int(stats.get(name, 0)) for name in STATS]  # rank 0

    def contribute(self, part: Part, closing: bool) -> GeneratedTokens | None:
        counts = self._in_flight.take_counts()
        return GeneratedTokens(*counts) if any(counts) else None

    def merge(self, vote: Vote) -> None:
        payload = vote.payloads.get(GeneratedTokens)
        if payload is not None:
            for i, value in enumerate((payload.prompts, payload.prompt_tokens, payload.completion_tokens)):
                self._totals[i] += value

    def draft(self, draft: RecordDraft) -> None:
        if any(self._totals):
            draft.record.stats.update(zip(STATS, self._totals, strict=True))
