"""The interface every generation engine implements: submit prompts named by their dataset index, poll the finished
ones in any order, read the answers in progress, stop.

An engine batches continuously: it keeps its KV cache full by starting a prompt as soon as another finishes, so a
long answer never holds up short ones. The job's runner (or a processor) submits prompts as batches arrive and polls
completions as they come; a batch is done when its last prompt is.

:class:`GenerationEngine` holds what every backend shares: admission (a prompt that cannot run comes back as a failed
:class:`~torch_batch_process.generation.requests.Completion` naming its index and lengths, never as a failed batch;
an answer is capped at the model's context), the bookkeeping of prompts in flight, and the checks of the calls.
A backend gives the model's context length, vocabulary size and end-of-sequence ids to ``__init__`` and implements
four hooks: ``_enqueue``, ``_collect``, ``_partial`` and ``_shutdown``.

:class:`CacheBudget` sizes the engine from the job (never from an engine's default share of free memory: on a CPU,
``transformers`` takes 60% of the free RAM for its cache and attention masks, 8.8 GiB and 15 s to start for a
2-layer model on a 23 GiB machine).
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from types import TracebackType

from torch_batch_process.errors import BatchProcessError, InvalidArgumentError
from torch_batch_process.generation.requests import Completion, Prompt

__all__ = [
    "BATCH_TOKENS",
    "MASKED_BATCH_TOKENS",
    "CacheBudget",
    "EngineClosedError",
    "EngineFailedError",
    "GenerationEngine",
    "admit",
]

BATCH_TOKENS = 512
"""``CacheBudget.batch_tokens`` left ``None``: tokens a step processes at most, where attention reads only each
sequence's own cache (flash and paged kernels, vLLM)."""

MASKED_BATCH_TOKENS = 128
"""The same where the attention needs a mask over the whole step (``transformers``' SDPA and eager attention: its
continuous batching on a CPU). Such a step scores each of its tokens against every token it reads, so its attention
costs ``batch_tokens`` times the tokens in flight; smaller steps cut that product (a 4-layer Llama of width 256 on a
CPU core: 128 tokens a step answered 800 prompts 1.25x faster than 512, BENCHMARKS.md section 9)."""


class EngineFailedError(BatchProcessError, RuntimeError):
    """The engine itself failed (its generation loop died: out of memory, a kernel error): every prompt in flight is
    lost, none is answered; the job fails (resumable). A prompt that cannot run is a failed completion instead."""


class EngineClosedError(BatchProcessError, RuntimeError):
    """The engine was stopped: it takes no more prompts."""


@dataclass(frozen=True)
class CacheBudget:
    """How much an engine may hold at once, in tokens and sequences (sized from the job, learned later, §15).

    - ``max_sequences``: sequences advanced by one forward step at most (``transformers``: ``max_requests_per_batch``;
      vLLM: ``max_num_seqs``).
    - ``cache_tokens``: tokens the KV cache holds (``transformers``: ``num_blocks * page_size``; vLLM:
      ``num_gpu_blocks_override * block_size``). ``None``: ``max_sequences`` sequences of 512 tokens, and at least
      one sequence of the model's whole context (a longer one could never run).
    - ``batch_tokens``: tokens one forward step processes at most (prompt chunks and one token per answer;
      ``transformers``: ``max_batch_tokens``; vLLM: ``max_num_batched_tokens``). ``None``: the engine's default
      (:data:`BATCH_TOKENS`, or :data:`MASKED_BATCH_TOKENS` where the attention needs a mask: ``transformers`` on a
      CPU, whose SDPA and eager attention score every token of a step against every token the step reads, the
      other sequences' too, so a step's attention grows with ``batch_tokens`` times the tokens in flight).
    - ``page_size``: tokens per page of the paged cache (``transformers``: ``page_size``; vLLM: ``block_size``). A
      sequence wastes less than a page.

    The cache holds the keys and values of every layer: ``2 * layers * kv_heads * head_dim * dtype bytes`` per
    token (8 KiB for a 4-layer model of width 256 in float32). When prompts in flight outgrow it the engine pauses
    some (``transformers`` frees their cache and prefills them again later): slower, never wrong.
    """

    max_sequences: int = 64
    cache_tokens: int | None = None
    batch_tokens: int | None = None
    page_size: int = 64

    def __post_init__(self) -> None:
        for name in ("max_sequences", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"CacheBudget.{name} must be an int >= 1, got {value!r}")
        for name in ("cache_tokens", "batch_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(
                    f"CacheBudget.{name} must be None (the engine's default) or an int >= 1, got {value!r}"
                )

    def resolved(self, context_length: int, batch_tokens: int = 512) -> CacheBudget:
        """This budget with ``cache_tokens`` set and rounded up to whole pages, checked against the context, and
        ``batch_tokens`` set (``batch_tokens``: the engine's default, where this budget leaves it ``None``).

        Raises:
            InvalidArgumentError: ``cache_tokens`` cannot hold one sequence of the whole context.
        """
        tokens = self.cache_tokens
        if tokens is None:
            tokens = max(self.max_sequences * min(context_length, 512), context_length)
        elif tokens < context_length:
            raise InvalidArgumentError(
                f"CacheBudget.cache_tokens={tokens} cannot hold one sequence of the model's context "
                f"({context_length} tokens): raise cache_tokens, or pass a smaller context_length to the engine "
                "(answers then stop at that length)"
            )
        steps = self.batch_tokens if self.batch_tokens is not None else batch_tokens
        return replace(self, cache_tokens=self.pages(tokens) * self.page_size, batch_tokens=steps)

    def _steps(self) -> int:
        if self.batch_tokens is None:
            raise ValueError("CacheBudget.batch_tokens is None: resolve the budget first (CacheBudget.resolved)")
        return self.batch_tokens

    def pages(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return math.ceil(tokens / self.page_size)

    def smaller(self, context_length: int) -> CacheBudget | None:
        """The next budget to try after this one (resolved) ran out of device memory, or ``None`` at the floor.

        First ``batch_tokens`` halves (it sets the activation peak of a step: the attention mask of non-flash
        attention alone holds ``batch_tokens x (cache_tokens + batch_tokens)`` values) down to one page, then
        ``cache_tokens`` halves (memory given back for the steps) down to one whole context (a sequence of the
        whole context must still fit, else it would stall the engine). ``max_sequences`` stays: a step never holds
        more sequences than tokens anyway."""
        steps = self._steps()
        if steps > self.page_size:
            return replace(self, batch_tokens=max(self.page_size, steps // 2))
        floor = self.pages(context_length) * self.page_size
        tokens = self.cache_tokens if self.cache_tokens is not None else floor
        if tokens > floor:
            return replace(self, cache_tokens=max(floor, self.pages(tokens // 2) * self.page_size))
        return None

    def at_most(self, cache_tokens: int, batch_tokens: int, context_length: int) -> CacheBudget:
        """This budget (resolved) within ``cache_tokens`` and ``batch_tokens`` (what an earlier attempt learned),
        never below one page per step nor one whole context in the cache."""
        floor = self.pages(context_length) * self.page_size
        cache = max(floor, min(self.cache_tokens or floor, self.pages(cache_tokens) * self.page_size))
        return replace(self, cache_tokens=cache, batch_tokens=max(1, min(self._steps(), batch_tokens)))

    def describe(self) -> str:
        """One line, as logged and shown by ``tbp status``."""
        cache = f"{self.cache_tokens:,}" if self.cache_tokens is not None else "auto"
        steps = f"{self.batch_tokens:,}" if self.batch_tokens is not None else "the engine's default"
        return (
            f"KV cache {cache} tokens (pages of {self.page_size}), {steps} tokens per step, "
            f"{self.max_sequences} sequences per step"
        )


def admit(
    prompt: Prompt, context_length: int, vocab_size: int, eos_token_ids: tuple[int, ...] = ()
) -> Completion | int:
    """How many tokens ``prompt``'s answer may still grow by; or its completion when it needs no engine: failed
    (empty, a token id outside the vocabulary, or a prompt that fills the model's context so no answer token fits),
    or already complete (its answer prefix ends with an end-of-sequence token: ``"stop"``; or holds
    ``max_new_tokens`` tokens, or reaches the context: ``"length"``). An answer that would outgrow the context is
    capped there (``finish_reason="length"``, as in vLLM).
    """
    tokens, prefix = prompt.token_ids, prompt.answer_prefix
    error = None
    if not tokens:
        error = f"the prompt of index {prompt.index} has no tokens"
    elif min(tokens + prefix) < 0 or max(tokens + prefix) >= vocab_size:
        bad = next(t for t in tokens + prefix if not 0 <= t < vocab_size)
        error = f"the prompt of index {prompt.index} holds token id {bad}, outside the vocabulary (0-{vocab_size - 1})"
    elif len(tokens) >= context_length:
        error = (
            f"the prompt of index {prompt.index} has {len(tokens)} tokens, the model's context holds "
            f"{context_length}: no room for an answer token"
        )
    if error is not None:
        return Completion(prompt.index, (), "failed", len(tokens), error)
    if prefix and prefix[-1] in eos_token_ids:
        return Completion(prompt.index, prefix, "stop", len(tokens))
    remaining = min(prompt.remaining_tokens, context_length - len(tokens) - len(prefix))
    if remaining <= 0:
        return Completion(prompt.index, prefix[: context_length - len(tokens)], "length", len(tokens))
    return remaining


class GenerationEngine(abc.ABC):
    """A continuous-batching engine: ``submit`` prompts, ``poll`` completions (any order), ``stop``.

    Not thread-safe: one thread submits and polls (the engine may run its own threads or processes inside).
    Usable as a context manager (``stop`` on exit).
    """

    def __init__(self, *, context_length: int, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._context_length = context_length
        self._vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        """The tokens that end an answer (empty: answers run to their ``max_new_tokens``)."""
        self._in_flight: dict[int, Prompt] = {}
        self._ready: list[Completion] = []
        self._closed = False
        self._lock = threading.Lock()
        self.budget: CacheBudget | None = None
        """The cache's size as the engine runs (resolved; ``None``: the backend sizes itself)."""

    # ------------------------------------------------------------------ the interface

    @property
    def context_length(self) -> int:
        """The most tokens a sequence (prompt, answer prefix and answer) may hold."""
        return self._context_length

    @property
    def vocab_size(self) -> int:
        """The number of token ids the model knows."""
        return self._vocab_size

    @property
    def in_flight(self) -> int:
        """Prompts submitted and not yet returned by :meth:`poll`."""
        return len(self._in_flight) + len(self._ready)

    def submit(self, prompts: Iterable[Prompt]) -> None:
        """Starts answering ``prompts``; returns at once. A prompt that cannot run comes back from :meth:`poll` as
        a failed completion (see :func:`admit`).

        Raises:
            InvalidArgumentError: an element is no :class:`Prompt`, or its index is already in flight.
            EngineClosedError: the engine was stopped.
        """
        if self._closed:
            raise EngineClosedError("this generation engine was stopped: it takes no more prompts")
        prompts = list(prompts)
        taken = set(self._in_flight) | {completion.index for completion in self._ready}
        for prompt in prompts:  # every check before anything is submitted
            if not isinstance(prompt, Prompt):
                raise InvalidArgumentError(f"submit() takes Prompt objects, got {type(prompt).__name__}")
            if prompt.index in taken:
                raise InvalidArgumentError(
                    f"the prompt of index {prompt.index} is already in flight: poll its completion before submitting "
                    "it again"
                )
            taken.add(prompt.index)
        admitted: list[tuple[Prompt, int]] = []
        for prompt in prompts:
            verdict = admit(prompt, self.context_length, self.vocab_size, self.eos_token_ids)
            if isinstance(verdict, Completion):
                self._ready.append(verdict)
            else:
                admitted.append((prompt, verdict))
                self._in_flight[prompt.index] = prompt
        if admitted:
            self._enqueue(admitted)

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """The completions finished since the last call (any order), waiting up to ``timeout`` seconds for the first
        one when there is none yet (``None``: until one comes; returns ``[]`` at once when nothing is in flight).

        Raises:
            EngineFailedError: the engine's generation loop died (no prompt in flight will finish).
        """
        done, self._ready = self._ready, []
        if self._in_flight:
            wait = 0.0 if done else timeout
            for completion in self._collect(wait):
                prompt = self._in_flight.pop(completion.index)
                if prompt.answer_prefix and not completion.failed:
                    completion = replace(completion, token_ids=prompt.answer_prefix + completion.token_ids)
                done.append(completion)
        return done

    def partial(self) -> dict[int, tuple[int, ...]]:
        """The answers in progress: dataset index -> tokens generated so far (the answer prefix included), for the
        prompts in flight that have started. What a commit stores so that a preempted long answer resumes from
        there (pass it back as ``Prompt.answer_prefix``)."""
        if not self._in_flight:
            return {}
        progress = self._partial()
        answers = {}
        for index, tokens in progress.items():
            prompt = self._in_flight.get(index)
            if prompt is not None and tokens:
                answers[index] = prompt.answer_prefix + tuple(tokens)
        return answers

    resizable = False
    """Whether :meth:`restart` can give this engine another :class:`CacheBudget` (the job then learns one when the
    engine runs out of device memory, ``on_oom="split"``)."""

    def restart(self, budget: CacheBudget) -> None:
        """Drops every prompt in flight (never returned: submit them again) and starts the engine again with
        ``budget``, the model kept; only where :attr:`resizable`.

        Raises:
            EngineClosedError: the engine was stopped.
            NotImplementedError: this backend cannot change its budget.
        """
        if self._closed:
            raise EngineClosedError("this generation engine was stopped: it cannot restart")
        if not self.resizable:
            raise NotImplementedError(f"{type(self).__name__} cannot change its cache budget while it runs")
        self._in_flight.clear()
        self._ready.clear()
        self._restart(budget)

    def _restart(self, budget: CacheBudget) -> None:
        """A resizable backend: stops generating (what is in flight is dropped) and starts again with ``budget``."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stops the engine at once: prompts in flight are dropped (never returned), its memory released.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._in_flight.clear()
        self._ready.clear()
        self._shutdown()

    def __enter__(self) -> GenerationEngine:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ what a backend implements

    @abc.abstractmethod
    def _enqueue(self, prompts: list[tuple[Prompt, int]]) -> None:
        """Starts each ``(prompt, new tokens at most)``: the prompt's tokens followed by its answer prefix, answered
        by at most that many new tokens, sampled as the engine's sampling says (token positions counted from the
        start of the answer, prefix included)."""

    @abc.abstractmethod
    def _collect(self, timeout: float | None) -> list[Completion]:
        """Completions finished since the last call, waiting up to ``timeout`` for the first; the tokens generated
        in this run only (the base class prepends the prefix)."""

    @abc.abstractmethod
    def _partial(self) -> dict[int, list[int]]:
        """Index -> the tokens generated in this run so far, for the prompts that started."""

    @abc.abstractmethod
    def _shutdown(self) -> None:
        """Stops generating and releases the engine's memory."""
