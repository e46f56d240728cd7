"""Batches in flight: a processor hands a batch's prompts to a generation engine and returns; the batch is done
(its rows written, committable) when its last prompt has finished (DESIGN §19).

A processor registers its engine once (``context.use_generation_engine(engine)`` in ``__init__``) and, in
``process_batch``, submits one :class:`~torch_batch_process.generation.requests.Prompt` per example of the batch
(``context.generate(prompts, on_done)``). :class:`InFlight` owns those batches:

- a submission is held until ``process_batch`` returns, then goes to the engine (a ``process_batch`` that raises
  submits nothing: its transaction is undone as any other);
- the runner does not add a batch in flight to the rank's part (:meth:`InFlight.owns`); :meth:`InFlight.pump` does,
  when the batch's last completion came back: ``on_done(completions)`` runs on the main thread with
  ``context.batch_indices`` set to the batch's answered indices, its ``context.write`` rows join the rank's shard,
  and the batch joins the same :class:`~torch_batch_process.engine.work.Part` as its rows. So a commit covers
  completed batches only, in any order, each with its rows: exactly once as for any batch;
- the loop waits for room (:meth:`has_room`: at most ``max_in_flight`` prompts submitted) before it loads the next
  batch, pumps before each commit, drains when the rank's batches are done (committing as batches complete:
  :mod:`~torch_batch_process.engine.final_drain`), and at a stop drains for at most ``drain_s`` seconds: a batch
  still in flight then is not committed, and the resume generates it again;
- a stop keeps the answers of its unfinished batches (:meth:`InFlight.keep_partial_answers`: the tokens so far of
  each prompt that started, the whole answer of one that finished in a batch that did not), which the generation
  participant stores with the closing commit; a resumed rank continues them (:meth:`InFlight.restore`:
  ``prompt + partial answer`` submitted with the rest of its ``max_new_tokens``), see
  :mod:`~torch_batch_process.generation.partial_answers`.

**The engine's budget, learned** (``on_oom="split"``, the default; as DESIGN §15 for batches). When the engine's
loop dies of an out-of-memory error (its :class:`~torch_batch_process.generation.engine.EngineFailedError`'s cause),
a resizable engine is restarted with a smaller :class:`~torch_batch_process.generation.engine.CacheBudget`
(:meth:`CacheBudget.smaller`: ``batch_tokens`` halved down to a page, then ``cache_tokens`` down to one context;
again while a restart itself runs out of memory), and every prompt in flight without its completion is submitted
again, as it was submitted first (a batch is still delivered once, when its last prompt is answered: nothing it
holds was written yet). The budget it came to travels in the rank's next vote (:meth:`take_budget`) and is kept with
the job, and a new attempt's engine starts from the job's (:meth:`start_from`, applied when the processor registers
it), on any world size. At the floor, or with ``on_oom="raise"``, the rank fails as before (resumable).

A prompt that cannot run (longer than the model's context, a token outside the vocabulary) comes back as a failed
completion: with ``on_error="skip"`` it is a failing example (its row is absent, the batch completes without it),
otherwise the rank fails naming its index and lengths (:class:`PromptFailedError`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.context import CurrentBatch
from torch_batch_process.engine.feed.device_memory import is_out_of_memory
from torch_batch_process.engine.rank_failure import RankFailure
from torch_batch_process.engine.work import RankWork
from torch_batch_process.errors import BatchProcessError, BatchTimeoutError, InvalidArgumentError
from torch_batch_process.generation.engine import CacheBudget, EngineFailedError, GenerationEngine
from torch_batch_process.generation.limits import check_drain_s, check_max_in_flight
from torch_batch_process.generation.partial_answers import PartialAnswer, PartialAnswers, prompt_digest
from torch_batch_process.generation.requests import Completion, Prompt

__all__ = ["DEFAULT_DRAIN_S", "BatchInFlight", "GenerationCounts", "InFlight", "PromptFailedError"]

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_S = 30.0
"""How long a stop (preemption) waits for the batches in flight to finish before the closing commit."""


class PromptFailedError(BatchProcessError, RuntimeError):
    """A prompt could not be answered (too long for the model's context, a token outside its vocabulary)."""


@dataclass
class BatchInFlight:
    """One batch submitted to the engine, waiting for its last completion."""

    batch_idx: int
    indices: Sequence[int]
    """The batch's dataset indices, in batch order."""
    on_done: Callable[[list[Completion]], None]
    submitted: float
    """``time.monotonic()`` at submission."""
    completions: dict[int, Completion] = field(default_factory=dict)
    prompts: dict[int, Prompt] = field(default_factory=dict)
    """The prompts as submitted (a resumed one with its ``answer_prefix``)."""


@dataclass
class GenerationCounts:
    """What a rank's delivered batches hold (its vote's counts, then zeroed)."""

    prompts: int = 0
    """Prompts answered, failed ones included."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """Answer tokens, partial answers continued included."""
    resumed_prompts: int = 0
    """Prompts whose answer continued a partial answer of an earlier attempt."""
    reused_tokens: int = 0
    """The tokens of those partial answers (generated once, not again)."""

    def values(self) -> tuple[int, int, int, int, int]:
        """The counts in field order (``dataclasses.astuple`` deep-copies: ~15 µs at every commit of every job)."""
        return self.prompts, self.prompt_tokens, self.completion_tokens, self.resumed_prompts, self.reused_tokens


class InFlight:
    """The rank's batches in flight in its generation engine (see the module docstring).

    Args:
        current: the context's current batch (set around ``on_done``; tells the record writer the batch ended).
        work: the rank's work (a completed batch joins its current part).
        rank_failure: the rank's failure (an exception in ``on_done``, a failed prompt, a dead engine).
        inference: context manager factory ``on_done`` runs under (``torch.inference_mode`` or a null one).
        record_failure: ``on_error="skip"``: records a failed prompt as a failing example
            ``(batch_idx, index, phase, error)``; ``None``: a failed prompt fails the rank.
        batch_timeout: ``batch_timeout``: seconds a batch may stay in flight, from its submission (it waits behind
            the batches before it, at most ``max_in_flight`` prompts); longer fails the rank with
            :class:`~torch_batch_process.errors.BatchTimeoutError` naming the batch (a stuck engine never hangs the
            job). ``None``: no limit.
        learn_budget: ``on_oom="split"``: an engine that runs out of memory is restarted with a smaller budget (see
            the module docstring); ``False``: the rank fails.
        claims: the rank claims its batches (``schedule="dynamic"``): by default it holds only what its engine runs
            at once (``budget.max_sequences`` prompts, plus the batch that crosses it) instead of 4 times that, so
            the batches it has not claimed yet stay with the job for whichever rank frees a sequence first (holding
            more only queues prompts on this rank while another runs out of work at the end).
    """

    def __init__(
        self,
        current: CurrentBatch,
        work: RankWork,
        rank_failure: RankFailure,
        inference: Callable[[], contextlib.AbstractContextManager[Any]],
        record_failure: Callable[[int, int, str, BaseException], None] | None = None,
        batch_timeout: float | None = None,
        learn_budget: bool = False,
        claims: bool = False,
    ) -> None:
        self._claims = claims
        self._batch_timeout = batch_timeout
        self._learn_budget = learn_budget
        self._stored_budget: dict[str, int] | None = None  # what earlier attempts learned (start_from)
        self._budget_news = False  # the engine's budget changed since the last take_budget()
        self._engine_ooms = 0  # out-of-memory errors of the engine since the last take_budget()
        self._current = current
        self._work = work
        self._rank_failure = rank_failure
        self._inference = inference
        self._record_failure = record_failure
        self.engine: GenerationEngine | None = None
        self.limit = 0
        """Prompts in flight at most (``max_in_flight``)."""
        self.drain_s = DEFAULT_DRAIN_S
        self._batches: dict[int, BatchInFlight] = {}
        self._batch_of: dict[int, int] = {}  # dataset index -> batch_idx, for the prompts in flight
        self._complete: list[BatchInFlight] = []  # answered, not delivered yet (pump(most=...)), in completion order
        self._pending: tuple[BatchInFlight, list[Prompt]] | None = None  # submitted by process_batch, not yet sent
        self._delivering = False
        self._counts = GenerationCounts()  # delivered since the last take_counts()
        self._resumable = PartialAnswers()  # partial answers of earlier attempts, continued once each
        self.abandoned: dict[int, PartialAnswer] = {}
        """The answers in progress a stop left (:meth:`keep_partial_answers`), for the closing commit."""
        current.listeners.append(self._batch_finished)

    # ------------------------------------------------------------------ the context's side

    def use(self, engine: GenerationEngine, max_in_flight: int | None = None, drain_s: float | None = None) -> None:
        """``context.use_generation_engine``: the engine this rank's batches go to (once, in ``__init__``). Called
        again with the same engine, it takes the new ``max_in_flight`` and ``drain_s`` only: the engine starts within
        the learned budget (:meth:`start_from`) once, when it is registered."""
        if not isinstance(engine, GenerationEngine):
            raise InvalidArgumentError(
                f"use_generation_engine(engine=...) takes a torch_batch_process.generation.GenerationEngine (e.g. "
                f"TransformersEngine(model)), got {type(engine).__name__}"
            )
        if self.engine is not None and self.engine is not engine:
            raise InvalidArgumentError("use_generation_engine() was already called: a processor uses one engine")
        max_in_flight = check_max_in_flight(max_in_flight, "use_generation_engine")
        drain_s = check_drain_s(drain_s, "use_generation_engine")
        if self.engine is None:  # the budget earlier attempts learned applies once, to the engine registered
            self.engine = engine
            self._start_from_stored(engine)
        budget = engine.budget
        sequences = budget.max_sequences if budget is not None else 64
        default = sequences if self._claims else 4 * sequences  # see ``claims`` in the class docstring
        self.limit = max_in_flight if max_in_flight is not None else default
        if drain_s is not None:
            self.drain_s = drain_s

    def generate(self, prompts: Sequence[Prompt], on_done: Callable[[list[Completion]], None]) -> None:
        """``context.generate``: hands the current batch's prompts to the engine once ``process_batch`` returns."""
        if self.engine is None:
            raise InvalidArgumentError(
                "context.generate() needs an engine: call context.use_generation_engine(engine) in the processor's "
                "__init__ first"
            )
        indices = self._current.indices
        if indices is None or self._delivering:
            raise RuntimeError("context.generate() is only available inside process_batch()")
        if not callable(on_done):
            raise InvalidArgumentError(f"context.generate(on_done=...) must be callable, got {type(on_done).__name__}")
        if self._pending is not None:
            raise RuntimeError(f"context.generate() was already called for batch {self._current.batch_idx}")
        prompts = list(prompts)
        for prompt in prompts:
            if not isinstance(prompt, Prompt):
                raise InvalidArgumentError(
                    f"context.generate(prompts=...) takes generation.Prompt objects, got {type(prompt).__name__}"
                )
        given = [prompt.index for prompt in prompts]
        if sorted(given) != sorted(indices) or len(set(given)) != len(given):
            missing = sorted(set(indices) - set(given))[:5]
            foreign = sorted(set(given) - set(indices))[:5]
            raise InvalidArgumentError(
                f"context.generate(prompts=...) needs exactly one Prompt per example of context.batch_indices (batch "
                f"{self._current.batch_idx}): missing indices {missing}, foreign or repeated indices "
                f"{foreign or sorted(i for i in set(given) if given.count(i) > 1)[:5]}"
            )
        batch_idx = self._current.batch_idx
        assert batch_idx is not None
        self._pending = (BatchInFlight(batch_idx, list(indices), on_done, time.monotonic()), prompts)

    def _batch_finished(self, ok: bool) -> None:
        """``process_batch`` returned (its prompts go to the engine) or raised (they are dropped)."""
        pending, self._pending = self._pending, None
        if pending is None or not ok:
            return
        batch, prompts = pending
        assert self.engine is not None
        if self._resumable:
            prompts = self._resumable.resume(prompts, self.engine.vocab_size, self.engine.eos_token_ids)
        previous = self._batches.get(batch.batch_idx)
        if previous is not None:  # a batch run in parts (on_oom="split"): one batch, several submissions
            previous.indices = list(previous.indices) + list(batch.indices)
            batch = previous
        self._batches[batch.batch_idx] = batch
        for prompt in prompts:
            self._batch_of[prompt.index] = batch.batch_idx
            batch.prompts[prompt.index] = prompt
        try:
            self.engine.submit(prompts)
        except EngineFailedError as exc:  # the loop died since the last pump
            if not self._recovered(exc):
                raise

    # ------------------------------------------------------------------ the loop's side

    @property
    def active(self) -> bool:
        """Whether the processor registered an engine."""
        return self.engine is not None

    def owns(self, batch_idx: int) -> bool:
        """Whether batch ``batch_idx`` is in flight (the runner leaves it out of the part: :meth:`pump` adds it)."""
        return batch_idx in self._batches

    @property
    def prompts_in_flight(self) -> int:
        return len(self._batch_of)

    @property
    def batches_in_flight(self) -> int:
        return len(self._batches)

    def has_room(self) -> bool:
        """Whether another batch may be submitted (fewer than ``max_in_flight`` prompts in flight)."""
        return self.engine is None or len(self._batch_of) < self.limit

    def oldest(self) -> float | None:
        """When the oldest batch in flight was submitted (``time.monotonic()``), or ``None``."""
        return min((b.submitted for b in self._batches.values()), default=None)

    def pump(self, timeout: float = 0.0, most: int | None = None) -> int:
        """Takes the completions the engine finished (waiting up to ``timeout`` seconds for one when no batch is
        complete yet) and delivers the batches whose last prompt came back, in the order they completed, at most
        ``most`` of them (``None``: all; the others wait for the next call); returns how many it delivered. A dead
        engine fails the rank."""
        if self.engine is None or not self._batches or self._rank_failure.failed:
            return 0
        try:
            completions = self.engine.poll(timeout=0.0 if self._complete else timeout)
        except Exception as exc:  # noqa: BLE001 - EngineFailedError: every rank stops with it
            if not self._recovered(exc):
                self._rank_failure.record(exc, "the generation engine")
            return 0
        for completion in completions:
            batch = self._batches[self._batch_of.pop(completion.index)]
            batch.completions[completion.index] = completion
            if len(batch.completions) == len(batch.indices):
                self._complete.append(batch)
        delivered = 0
        while self._complete and (most is None or delivered < most):
            batch = self._complete.pop(0)
            del self._batches[batch.batch_idx]
            self._deliver(batch)
            delivered += 1
        if self._batch_timeout is not None and self._batches:
            self._check_timeout(self._batch_timeout)
        return delivered

    def _check_timeout(self, limit: float) -> None:
        batch = min(self._batches.values(), key=lambda b: b.submitted)
        waited = time.monotonic() - batch.submitted
        if waited > limit:
            self._rank_failure.record(
                BatchTimeoutError(
                    f"batch {batch.batch_idx} has been in the generation engine for {waited:.1f} s, more than "
                    f"batch_timeout={limit:g} s ({len(batch.indices) - len(batch.completions)} of its "
                    f"{len(batch.indices)} prompts unanswered): the engine is stuck, or batch_timeout is shorter than "
                    "max_in_flight prompts take"
                ),
                "the generation engine",
            )

    def wait_for_room(self, stopping: Callable[[], bool] | None = None) -> None:
        """Delivers the batches finished so far, then pumps until another batch may be submitted, the rank failed,
        or ``stopping()`` (a preemption: the loop stops admitting at its next agreement)."""
        self.pump(timeout=0.0)
        while not self.has_room() and not self._rank_failure.failed and not (stopping is not None and stopping()):
            self.pump(timeout=1.0)

    def drain(self, deadline_s: float) -> bool:
        """At a stop: pumps until no batch is in flight, for at most ``deadline_s`` seconds; returns whether none is
        left. (When the rank's steps are done, the loop drains with commits instead:
        :mod:`~torch_batch_process.engine.final_drain`.)"""
        end = time.monotonic() + deadline_s
        while self._batches and not self._rank_failure.failed:
            wait = min(1.0, end - time.monotonic())
            if wait <= 0:
                break
            self.pump(timeout=wait)
        return not self._batches

    # ------------------------------------------------------------------ the engine's budget (on_oom="split")

    def start_from(self, learned: dict[str, int]) -> None:
        """What earlier attempts learned (``cache_tokens``, ``batch_tokens``): the engine the processor registers
        starts within it, before any prompt."""
        self._stored_budget = learned

    def take_budget(self) -> tuple[CacheBudget | None, int]:
        """The engine's budget when it changed since the previous call (else ``None``), and the out-of-memory
        errors it met meanwhile: what the rank's next vote carries."""
        changed, self._budget_news = self._budget_news, False
        ooms, self._engine_ooms = self._engine_ooms, 0
        return (self.engine.budget if changed and self.engine is not None else None), ooms

    def _start_from_stored(self, engine: GenerationEngine) -> None:
        learned, budget = self._stored_budget, engine.budget
        if not learned or budget is None or not engine.resizable or not self._learn_budget:
            return
        fitted = budget.at_most(learned["cache_tokens"], learned["batch_tokens"], engine.context_length)
        if fitted != budget:
            logger.info("the generation engine starts within the budget earlier attempts learned: %s",
                        fitted.describe())
            engine.restart(fitted)
            self._budget_news = True

    def _recovered(self, error: BaseException) -> bool:
        """The engine died (``error``): when it ran out of memory and may learn, restarts it with a smaller budget
        and submits again every prompt in flight without its completion; returns whether it did. At the floor, the
        rank's failure says so."""
        engine = self.engine
        if not self._learn_budget or engine is None or not engine.resizable or not _memory_ran_out(error):
            return False
        budget = engine.budget
        assert budget is not None
        while True:
            self._engine_ooms += 1
            smaller = budget.smaller(engine.context_length)
            if smaller is None:
                failure = EngineFailedError(
                    f"the generation engine ran out of memory at its smallest budget ({budget.describe()}): lower "
                    "CacheBudget.max_sequences, use a smaller model or a device with more memory"
                )
                failure.__cause__ = error
                self._rank_failure.record(failure, "the generation engine")
                return True
            try:
                engine.restart(smaller)
                break
            except Exception as again:  # noqa: BLE001 - a restart whose cache does not fit either: smaller again
                if not _memory_ran_out(again):
                    self._rank_failure.record(again, "restarting the generation engine")
                    return True
                budget = smaller
        self._budget_news = True
        pending = [
            prompt for batch in self._batches.values() for index, prompt in batch.prompts.items()
            if index not in batch.completions
        ]
        logger.warning(
            "the generation engine ran out of memory (%s): restarted with %s; its %d prompts in flight submitted "
            "again", error.__cause__ or error, engine.budget.describe() if engine.budget else "?", len(pending),
        )
        try:
            engine.submit(pending)
        except Exception as exc:  # noqa: BLE001 - every rank stops with it
            self._rank_failure.record(exc, "the generation engine")
        return True

    def take_counts(self) -> GenerationCounts:
        """The counts of the batches delivered since the previous call: those of the batches in the rank's part, for
        its vote."""
        counts, self._counts = self._counts, GenerationCounts()
        return counts

    def restore(self, answers: PartialAnswers) -> None:
        """The partial answers of earlier attempts' stops: a prompt submitted here with one continues it."""
        self._resumable = answers

    def keep_partial_answers(self) -> int:
        """At a stop, once drained: keeps the answers of the batches still in flight (:attr:`abandoned`) before
        :meth:`close` drops them; returns how many. An engine that cannot tell them (it failed) keeps none: they are
        only a hint. The batches the engine finished meanwhile are delivered first (the closing commit takes them)."""
        self.pump(timeout=0.0)
        answers: dict[int, tuple[int, ...]] = {}
        for batch in self._batches.values():
            answers.update((c.index, c.token_ids) for c in batch.completions.values() if not c.failed)
        if self.engine is not None and self._batch_of and not self._rank_failure.failed:
            try:
                answers.update(self.engine.partial())
            except Exception as exc:  # noqa: BLE001 - a hint: the resume then starts these prompts again
                logger.warning("the answers in progress could not be read from the engine (%s): not kept", exc)
        kept = {}
        for batch in self._batches.values():
            for index, prompt in batch.prompts.items():
                tokens = answers.get(index)
                if tokens:
                    kept[index] = PartialAnswer(prompt_digest(prompt.token_ids), tuple(tokens))
        self.abandoned = kept
        return len(kept)

    def close(self) -> None:
        """Stops the engine: what is still in flight is dropped (never committed: the resume generates it again)."""
        engine, self.engine = self.engine, None
        self._batches.clear()
        self._batch_of.clear()
        self._complete.clear()
        if self._batch_finished in self._current.listeners:
            self._current.listeners.remove(self._batch_finished)
        if engine is not None:
            engine.stop()

    # ------------------------------------------------------------------ delivering a batch

    def _deliver(self, batch: BatchInFlight) -> None:
        """``on_done`` for a complete batch (its failed prompts left out); the batch joins the rank's part."""
        answered: list[Completion] = []
        for index in batch.indices:
            completion = batch.completions[index]
            if not completion.failed:
                answered.append(completion)
                continue
            error = PromptFailedError(completion.error or f"the prompt of index {index} failed")
            if self._record_failure is None:
                self._rank_failure.record(error, f"generating batch {batch.batch_idx}")
                return
            try:
                self._record_failure(batch.batch_idx, index, "generate", error)
            except Exception as exc:  # noqa: BLE001 - TooManyFailuresError
                self._rank_failure.record(exc, f"generating batch {batch.batch_idx}")
                return
        part = self._work.part
        t0 = time.perf_counter()
        self._current.enter(batch.batch_idx, [c.index for c in answered])
        self._delivering = True
        ok = False
        try:
            with self._inference():
                batch.on_done(answered)
            ok = True
        except Exception as exc:  # noqa: BLE001 - every rank stops with it
            self._rank_failure.record(exc, f"on_done of batch {batch.batch_idx}")
        finally:
            self._delivering = False
            self._current.finish(ok)
            self._current.leave()
            part.timings["process"] += time.perf_counter() - t0
        if ok:
            part.add_batch(batch.batch_idx, len(answered))
            counts = self._counts
            counts.prompts += len(batch.indices)
            counts.prompt_tokens += sum(c.prompt_tokens for c in batch.completions.values())
            counts.completion_tokens += sum(c.completion_tokens for c in answered)
            for completion in answered:
                prefix = len(batch.prompts[completion.index].answer_prefix)
                if prefix:
                    counts.resumed_prompts += 1
                    counts.reused_tokens += prefix


def _memory_ran_out(error: BaseException) -> bool:
    """Whether ``error`` or one of its causes says the device's memory ran out (an out-of-memory error in the
    engine's loop, or ``transformers``' check that a cache does not fit: a ``MemoryError``)."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, MemoryError) or is_out_of_memory(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
