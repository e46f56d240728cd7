"""Generation (DESIGN §19) as a commit participant.

**Counts.** Each vote carries the prompts and tokens of the batches its rank delivered since its previous vote (the
batches in that vote: a batch still in flight counts only once it is committed); rank 0 adds them up over every
attempt into the record's ``stats`` (``generated_prompts``, failed prompts included; ``prompt_tokens``;
``completion_tokens``; ``resumed_prompts`` and ``reused_tokens``: answers that continued a partial answer, and that
answer's tokens, generated once instead of twice), so the job's totals count each prompt once, whatever was
generated again after a kill or a stop. Rank 0 also keeps this attempt's counts per rank (``stats.generation_ranks``:
``[rank, prompts, prompt tokens, answer tokens]``, what ``tbp status`` and ``tbp report`` turn into tokens per
second per rank) and adds each vote's counts to the progress display's
(:class:`~torch_batch_process.observe.token_rates.TokenRates`).

**Partial answers** (:mod:`~torch_batch_process.generation.partial_answers`). At a stop the loop keeps the answers of
the batches it leaves in flight (:meth:`~torch_batch_process.engine.feed.in_flight.InFlight.keep_partial_answers`);
this participant's seal of the closing commit writes them to ``_tbp/partials/<attempt>-rank_<r>.json`` (durable
before the vote) and its vote names the file; rank 0's records name every such file of the job's stops
(``partial_answers``) until its final record, after which the record's garbage collection deletes them (a file no
record names, left by a stop whose closing commit failed, is deleted by the next start's repair). At the start of an
attempt every rank reads every file the latest record names (keyed by dataset index: any world size) and hands them
to its batches in flight, which continue each one once.

**The engine's budget** (``on_oom="split"``, DESIGN §15 and §19). A vote carries the engine's
:class:`~torch_batch_process.generation.engine.CacheBudget` when it changed (a restart after an out-of-memory error,
:class:`~torch_batch_process.engine.feed.in_flight.InFlight`) and the engine's out-of-memory errors; rank 0 keeps the
smallest ``cache_tokens`` and ``batch_tokens`` any rank came to, per kind of device, in the record
(``generation_budget``: ``device``, ``cache_tokens``, ``batch_tokens``, ``max_sequences``, ``page_size``,
``ooms``), and every rank of a later attempt on the same kind of device starts its engine within it (on any world
size: the budget is the job's, not a rank's). Ranks do not share it while they run: each learns from its own
engine's errors (restarting an engine that did not fail would drop its work in progress).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch_batch_process.engine.commit.participants import Participant, Payload, RecordDraft
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.feed.in_flight import InFlight
from torch_batch_process.engine.work import Part
from torch_batch_process.generation import partial_answers
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.layout import partial_answers_file
from torch_batch_process.observe.token_rates import GENERATION_STATS, TokenRates
from torch_batch_process.storage.base import Storage

__all__ = ["STATS", "GeneratedTokens", "GenerationParticipant"]

STATS = GENERATION_STATS
"""The record's ``stats`` this participant keeps (totals over every attempt)."""


@dataclass(frozen=True)
class GeneratedTokens(Payload):
    """Prompts and tokens of the batches a rank delivered since its previous vote, and the file of the partial
    answers it left at a stop."""

    key = "generation"
    prompts: int
    prompt_tokens: int
    completion_tokens: int
    resumed_prompts: int = 0
    reused_tokens: int = 0
    partial_answers: str | None = None
    """The rank's partial-answers file (relative to the storage), written by this closing commit's seal."""
    engine_ooms: int = 0
    """Out-of-memory errors of the rank's engine since its previous vote (each taught it a smaller budget)."""
    budget: dict[str, int] | None = None
    """The engine's budget when it changed since the rank's previous vote (``cache_tokens``, ``batch_tokens``,
    ``max_sequences``, ``page_size``)."""


class GenerationParticipant(Participant):
    """The generation counts and partial answers' part in the commits (see the module docstring).

    Args:
        in_flight: this rank's batches in flight (it counts what it delivered, keeps what a stop abandons).
        latest: the latest record of earlier attempts (rank 0 continues from its totals and partial answers).
        storage: the job's storage (partial-answer files).
        rank: this rank.
        attempt: this attempt's number (names this rank's partial-answer file).
        rates: rank 0's progress counts (the observer's), or ``None``.
        device: the kind of device the engine runs on (a budget learned on another kind is not used, and is
            replaced by what this attempt learns).
    """

    def __init__(
        self,
        in_flight: InFlight,
        latest: CommitRecord | None,
        storage: Storage,
        rank: int,
        attempt: int,
        rates: TokenRates | None = None,
        device: str = "",
    ) -> None:
        self._in_flight = in_flight
        self._storage = storage
        self._file = partial_answers_file(attempt, rank)
        self._written: str | None = None
        stats = latest.stats if latest is not None else {}
        self._totals = [int(stats.get(name, 0)) for name in STATS]  # rank 0
        self._partials = list(latest.partial_answers) if latest is not None else []  # rank 0
        self._ranks: dict[int, list[int]] = {}  # rank 0: this attempt's prompts, tokens in and out per rank
        self._rates = rates
        if self._partials:
            in_flight.restore(partial_answers.from_storage(storage.read_bytes, self._partials, storage.url_of))
        self._device = device
        stored = latest.generation_budget if latest is not None else None
        self._budget: dict[str, Any] | None = dict(stored) if stored and stored.get("device") == device else None
        if self._budget is not None:
            in_flight.start_from(self._budget)
        self._ooms_before = int(stored.get("ooms", 0)) if stored else 0  # rank 0
        self._ooms = 0  # rank 0: this call's

    # ------------------------------------------------------------------ every rank

    def seal(self, closing: bool) -> None:
        answers = self._in_flight.abandoned
        if closing and answers and self._written is None:
            self._storage.write_bytes(self._file, partial_answers.encode(answers), fsync=True)
            self._written = self._file

    def contribute(self, part: Part, closing: bool) -> GeneratedTokens | None:
        counts = self._in_flight.take_counts().values()
        written, self._written = self._written, None
        budget, ooms = self._in_flight.take_budget()
        if not any(counts) and written is None and budget is None and not ooms:
            return None
        learned = asdict(budget) if budget is not None else None
        return GeneratedTokens(*counts, partial_answers=written, engine_ooms=ooms, budget=learned)

    # ------------------------------------------------------------------ rank 0

    def merge(self, vote: Vote) -> None:
        payload = vote.payloads.get(GeneratedTokens)
        if payload is None:
            return
        values = (payload.prompts, payload.prompt_tokens, payload.completion_tokens, payload.resumed_prompts,
                  payload.reused_tokens)
        for i, value in enumerate(values):
            self._totals[i] += value
        counts = (payload.prompts, payload.prompt_tokens, payload.completion_tokens)
        mine = self._ranks.setdefault(vote.rank, [0, 0, 0])
        for i, value in enumerate(counts):
            mine[i] += value
        if self._rates is not None:
            self._rates.add(*counts)
        if payload.partial_answers is not None and payload.partial_answers not in self._partials:
            self._partials.append(payload.partial_answers)
        self._ooms += payload.engine_ooms
        if payload.budget is not None:
            kept = self._budget if self._budget is not None else {**payload.budget, "device": self._device}
            for name in ("cache_tokens", "batch_tokens"):
                kept[name] = min(int(kept[name]), int(payload.budget[name]))
            self._budget = kept

    def draft(self, draft: RecordDraft) -> None:
        if any(self._totals):
            draft.record.stats.update(zip(STATS, self._totals, strict=True))
        if self._ranks:
            draft.record.stats["generation_ranks"] = [[rank, *counts] for rank, counts in sorted(self._ranks.items())]
        # kept until the job is finished (a prompt may be continued by any later attempt); then deleted with the
        # record they were last named by
        draft.record.partial_answers = [] if draft.record.finished else list(self._partials)
        if self._budget is not None:
            self._budget["ooms"] = self._ooms_before + self._ooms
            draft.record.generation_budget = dict(self._budget)
            draft.summary.generation_budget = dict(self._budget)
        draft.summary.engine_ooms = self._ooms
