"""The embedded engine: ``transformers``' continuous batching (``model.init_continuous_batching()``), CPU and GPU.

What it relies on (``transformers`` 5.24, read in its source and checked by the tests):

- ``init_continuous_batching(generation_config, continuous_batching_config)`` returns a
  ``ContinuousBatchingManager``; ``start()`` runs its loop in a background thread; ``add_request(input_ids,
  request_id, max_new_tokens, eos_token_id, **logit_processor_kwargs)`` queues one request under the caller's id
  (here the dataset index), ``get_result(timeout)`` returns one finished request at a time (a ``GenerationOutput``:
  ``request_id``, ``prompt_ids``, ``generated_tokens``, ``status``, ``error``), in the order they finish.
- The paged KV cache is sized by ``page_size``, ``num_blocks`` (pages of every layer) and ``max_batch_tokens``; set
  from :class:`~torch_batch_process.generation.engine.CacheBudget`, never left to its default (60% of the free memory
  on a CPU, 90% on a GPU). ``max_requests_per_batch`` caps the sequences of a step. On a CPU it reads the machine's
  memory with ``psutil`` (without it, it logs an error and falls back on the NUMA node's memory where Linux shows
  it, else 0 bytes, and refuses any cache): this engine asks for ``psutil`` on a CPU.
- A request the cache cannot hold in full (its prompt and answer) stalls the loop, which then fails every request
  at once: :meth:`CacheBudget.resolved` keeps the cache at least one whole context, and
  :func:`~torch_batch_process.generation.engine.admit` caps each answer there.
- When the loop dies (an out-of-memory error, a kernel error) it fails every request with the same error and stops;
  this engine raises :class:`EngineFailedError` then, rather than reporting every prompt as failed.
- When the device's memory runs out inside a step (``torch.OutOfMemoryError``, or a ``MemoryError``), the loop dies
  like that too: the error is the cause of the :class:`EngineFailedError` (``status.fatal_error`` is the exception
  itself), the only signal the engine gives. :meth:`restart` then builds a new manager with a smaller
  :class:`CacheBudget` on the same model (``resizable``), so the job learns a budget that fits (``on_oom="split"``).
  A full cache is no error: the loop evicts requests and prefills them again later (slower, never wrong).
- ``manager.pause()`` parks the loop between steps, so the requests in progress can be read (:meth:`partial`).
- Greedy answers are those of ``model.generate`` for the same prompt (checked); sampling uses
  :mod:`torch_batch_process.generation.transformers_sampler` (seeded per dataset index), since the manager's own
  sampling has one generator for the whole loop.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.generation.engine import (
    BATCH_TOKENS,
    MASKED_BATCH_TOKENS,
    CacheBudget,
    EngineFailedError,
    GenerationEngine,
)
from torch_batch_process.generation.requests import Completion, Prompt
from torch_batch_process.generation.sampling import Sampling, index_key
from torch_batch_process.generation.transformers_sampler import KEY_ARG, PROMPT_TOKENS_ARG, seeded_processor_list

__all__ = ["TransformersEngine", "step_tokens"]

_FAILED = 4  # transformers' RequestStatus.FAILED
_HARD_STOP = 2  # its BackgroundThreadStatus.HARD_STOP: the loop is dying or dead
_DYING_S = 10.0  # seconds a dying loop gets to record its error


def step_tokens(model: Any) -> int:
    """Tokens a step processes at most where the budget leaves ``batch_tokens`` to the engine:
    :data:`~torch_batch_process.generation.engine.MASKED_BATCH_TOKENS` for a model on a CPU (continuous batching runs
    its attention as SDPA or eager over the whole step with a mask: flash kernels need a GPU), else
    :data:`~torch_batch_process.generation.engine.BATCH_TOKENS`."""
    implementation = str(getattr(model.config, "_attn_implementation", None) or "sdpa")
    return MASKED_BATCH_TOKENS if model.device.type == "cpu" and "flash" not in implementation else BATCH_TOKENS


class TransformersEngine(GenerationEngine):
    """Continuous batching with ``transformers``: a decoder-only ``PreTrainedModel`` (already on its device, in its
    dtype), answers greedy or sampled per dataset index.

    Args:
        model: a ``transformers`` causal language model (``model.init_continuous_batching`` exists).
        sampling: how tokens are drawn (default greedy).
        budget: the cache's size; see :class:`CacheBudget`.
        eos_token_id: the token(s) that end an answer; ``None``: the model's generation config's; ``()``: none
            (answers run to ``max_new_tokens``).
        context_length: the most tokens a sequence may hold; ``None``: the model's ``max_position_embeddings``.
    """

    def __init__(
        self,
        model: Any,
        *,
        sampling: Sampling | None = None,
        budget: CacheBudget | None = None,
        eos_token_id: int | tuple[int, ...] | None = None,
        context_length: int | None = None,
    ) -> None:
        if not callable(getattr(model, "init_continuous_batching", None)):
            raise InvalidArgumentError(
                f"model must be a transformers causal language model with init_continuous_batching() (transformers "
                f">= 5), got {type(model).__name__}"
            )
        self.sampling = sampling if sampling is not None else Sampling()
        if not isinstance(self.sampling, Sampling):
            raise InvalidArgumentError(f"sampling must be a Sampling, got {type(sampling).__name__}")
        text_config = model.config.get_text_config()
        context = _context_length(context_length, text_config)
        eos = _eos_ids(eos_token_id, model)
        super().__init__(context_length=context, vocab_size=int(text_config.vocab_size), eos_token_ids=eos)
        self.budget = (budget if budget is not None else CacheBudget()).resolved(context, step_tokens(model))
        if model.device.type == "cpu" and importlib.util.find_spec("psutil") is None:
            raise InvalidArgumentError(
                "transformers' continuous batching on a CPU reads the machine's memory with psutil: pip install "
                "psutil (or torch-batch-process[generation])"
            )
        self._model = model
        with torch.inference_mode():  # the manager's loop runs in the mode it was started in: no autograd state
            self._manager = self._start(model)

    resizable = True

    def _restart(self, budget: CacheBudget) -> None:
        self._shutdown()  # the old manager's cache and masks go first
        self.budget = budget.resolved(self.context_length)
        with torch.inference_mode():
            self._manager = self._start(self._model)

    def _start(self, model: Any) -> Any:
        """Builds the manager and its cache in this thread (so a cache too large raises here), then starts its loop."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        budget = self.budget
        assert budget is not None and budget.cache_tokens is not None  # resolved in __init__
        generation = GenerationConfig(
            do_sample=False,  # sampled answers: SeededSampler leaves one finite score per row
            max_new_tokens=budget.cache_tokens,
            eos_token_id=list(self.eos_token_ids) if self.eos_token_ids else -1,
            pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0,
        )
        cb_config = ContinuousBatchingConfig(
            page_size=budget.page_size,
            num_blocks=budget.pages(budget.cache_tokens),
            max_batch_tokens=budget.batch_tokens,
            max_requests_per_batch=budget.max_sequences,
            max_memory_percent=1.0,  # the sizes above are explicit; this only bounds transformers' own check
            use_async_batching=False if not self.sampling.greedy else None,
            seed=self.sampling.seed,
        )
        manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb_config)
        if not self.sampling.greedy:
            manager.logit_processor = seeded_processor_list(self.sampling)
        try:
            manager.warmup()  # creates the cache here; on a GPU also captures its graphs
        except MemoryError as error:
            raise InvalidArgumentError(
                f"the generation engine's cache does not fit: {error}; lower CacheBudget.cache_tokens "
                f"({budget.cache_tokens}) or batch_tokens ({budget.batch_tokens})"
            ) from error
        manager.start()
        return manager

    # ------------------------------------------------------------------ GenerationEngine's hooks

    def _enqueue(self, prompts: list[tuple[Prompt, int]]) -> None:
        for prompt, new_tokens in prompts:
            kwargs = {}
            if not self.sampling.greedy:
                key = index_key(self.sampling.seed, prompt.index)
                kwargs = {KEY_ARG: key, PROMPT_TOKENS_ARG: len(prompt.token_ids)}
            accepted = self._manager.add_request(
                list(prompt.token_ids + prompt.answer_prefix),
                request_id=str(prompt.index),
                max_new_tokens=new_tokens,
                eos_token_id=list(self.eos_token_ids) if self.eos_token_ids else -1,
                **kwargs,
            )
            if accepted is None:
                self._raise_if_failed()
                raise EngineFailedError(f"transformers' generation loop refused the prompt of index {prompt.index}")

    def _collect(self, timeout: float | None) -> list[Completion]:
        done: list[Completion] = []
        output = self._next(timeout)
        while output is not None:
            done.append(self._completion(output))
            output = self._next(0.0)
        if not done:
            self._raise_if_failed()
        return done

    def _partial(self) -> dict[int, list[int]]:
        progress: dict[int, list[int]] = {}
        if not self._manager.is_running():
            self._raise_if_failed(force=True)
        with self._manager.pause():
            scheduler = self._manager.batch_processor.scheduler
            states = list(scheduler.active_requests.values()) + list(scheduler.waiting_requests.values())
            for state in states:
                index = int(state.request_id)
                prompt = self._in_flight.get(index)
                if prompt is None:
                    continue
                sequence = list(state.initial_tokens) + list(state.generated_tokens)
                progress[index] = sequence[len(prompt.token_ids) + len(prompt.answer_prefix) :]
        return progress

    def _shutdown(self) -> None:
        manager, self._manager = self._manager, None
        if manager is None:  # a restart whose new cache did not fit
            return
        try:
            manager.stop(block=True, timeout=60, hard_stop=True)
        finally:
            manager.destroy()

    # ------------------------------------------------------------------ helpers

    def _next(self, timeout: float | None) -> Any:
        """The next finished ``GenerationOutput``, or ``None`` after ``timeout`` seconds (``None``: wait while the
        loop runs) or at once when the loop is gone."""
        manager = self._manager
        if timeout is not None:
            return manager.get_result(timeout=timeout)
        while True:  # wait in slices, so a loop that dies is noticed
            output = manager.get_result(timeout=0.5)
            if output is not None or not manager.is_running():
                return output

    def _completion(self, output: Any) -> Completion:
        index = int(output.request_id)
        prompt = self._in_flight[index]
        if int(output.status) == _FAILED or output.error is not None:
            if self._loop_dying():
                self._raise_if_failed(force=True, cause=output.error)
            error = f"the prompt of index {index} failed in transformers' generation loop: {output.error}"
            return Completion(index, (), "failed", len(prompt.token_ids), error)
        tokens = tuple(int(t) for t in output.generated_tokens)
        reason = "stop" if tokens and tokens[-1] in self.eos_token_ids else "length"
        return Completion(index, tokens, reason, len(prompt.token_ids))

    def _loop_dying(self) -> bool:
        status = self._manager.background_thread_status
        return status.fatal_error is not None or status.local_status >= _HARD_STOP or not self._manager.is_running()

    def _raise_if_failed(self, force: bool = False, cause: str | None = None) -> None:
        manager = self._manager
        status = manager.background_thread_status
        if force or status.fatal_error is not None or not manager.is_running():
            # the dying loop fails its requests before it records its error (the exception itself: what says out of
            # memory), then its thread ends: wait for that, briefly, so the error is the cause of ours
            thread = getattr(manager, "_generation_thread", None)
            if status.fatal_error is None and thread is not None:
                thread.join(timeout=_DYING_S)
            reason = status.fatal_error or cause or "it stopped"
            raise EngineFailedError(
                f"transformers' generation loop died ({reason}); the {len(self._in_flight)} prompts in flight are "
                "lost: the job fails and resumes from its last commit"
            ) from status.fatal_error


def _context_length(context_length: int | None, text_config: Any) -> int:
    model_context = getattr(text_config, "max_position_embeddings", None)
    if context_length is None:
        if not isinstance(model_context, int) or model_context < 2:
            raise InvalidArgumentError(
                "the model's config has no max_position_embeddings: pass context_length (the most tokens a prompt "
                "and its answer may hold)"
            )
        return model_context
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 2:
        raise InvalidArgumentError(f"context_length must be an int >= 2, got {context_length!r}")
    if isinstance(model_context, int) and context_length > model_context:
        raise InvalidArgumentError(
            f"context_length={context_length} exceeds the model's max_position_embeddings ({model_context})"
        )
    return context_length


def _eos_ids(eos_token_id: int | tuple[int, ...] | None, model: Any) -> tuple[int, ...]:
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config.get_text_config(), "eos_token_id", None)
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        eos_token_id = (eos_token_id,)
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = tuple(eos_token_id.tolist())
    ids = tuple(eos_token_id)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidArgumentError(f"eos_token_id must be an int, a tuple of ints or (), got {eos_token_id!r}")
    return tuple(t for t in ids if t >= 0)
