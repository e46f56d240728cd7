"""vLLM's engine behind :class:`~torch_batch_process.generation.engine.GenerationEngine` (GPU; vLLM imported only
when this engine is built).

Written against vLLM's documented offline engine API, stable from 0.6 to the V1 engine: ``EngineArgs(model=...,
...)``, ``LLMEngine.from_engine_args(args)``, ``engine.add_request(request_id, {"prompt_token_ids": [...]},
SamplingParams(...))``, ``engine.step()`` returning ``RequestOutput`` objects (``request_id``, ``finished``,
``outputs[0].token_ids``, ``outputs[0].finish_reason``), ``engine.abort_request(ids)``,
``engine.has_unfinished_requests()`` and ``engine.model_config.max_model_len``. It has not run in this repository's
CI (no GPU, no vLLM); its tests skip there, saying so.

Differences from :class:`~torch_batch_process.generation.transformers_engine.TransformersEngine`:

- the model is a name or a local folder (``model=``, ``revision=``, ``tokenizer=``), loaded by vLLM itself;
- sampled answers use vLLM's per-request ``seed`` (:func:`index_key` of the job's seed and the index, folded into
  63 bits): reproducible per index, but an answer resumed from a prefix restarts vLLM's generator, so its later
  tokens differ from the uninterrupted answer's (greedy answers continue exactly);
- under ``torchrun`` (``WORLD_SIZE > 1``) vLLM runs in its ``external_launcher`` mode (one engine per rank, each
  rank its own data), unless ``engine_args`` says otherwise;
- the cache budget becomes ``num_gpu_blocks_override``, ``block_size``, ``max_num_seqs`` and
  ``max_num_batched_tokens`` (vLLM still profiles its memory at start).
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.generation.engine import BATCH_TOKENS, CacheBudget, EngineFailedError, GenerationEngine
from torch_batch_process.generation.requests import Completion, Prompt
from torch_batch_process.generation.sampling import Sampling, index_key

__all__ = ["VLLMEngine", "vllm_available"]


def vllm_available() -> bool:
    """Whether vLLM is installed (the engine also needs a GPU)."""
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(GenerationEngine):
    """vLLM's ``LLMEngine``, stepped by :meth:`poll` (vLLM runs no loop of its own here).

    Args:
        model: a model name or local folder vLLM loads.
        sampling: how tokens are drawn (default greedy).
        budget: the cache's size; see :class:`CacheBudget`.
        context_length: ``max_model_len``; ``None``: the model config's ``max_position_embeddings``.
        tokenizer, revision: as vLLM's ``EngineArgs`` (the tokenizer is not used to encode: prompts are token ids).
        eos_token_id: ``()`` ignores end-of-sequence tokens (answers run to ``max_new_tokens``); ``None``: the model's.
        engine_args: more ``EngineArgs`` fields (``dtype``, ``tensor_parallel_size``, ``gpu_memory_utilization``...).
    """

    def __init__(
        self,
        model: str,
        *,
        sampling: Sampling | None = None,
        budget: CacheBudget | None = None,
        context_length: int | None = None,
        tokenizer: str | None = None,
        revision: str | None = None,
        eos_token_id: tuple[int, ...] | None = None,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        if not vllm_available():
            raise InvalidArgumentError(
                "VLLMEngine needs vLLM: pip install vllm (on a machine with a GPU), or use TransformersEngine"
            )
        if not isinstance(model, str) or not model:
            raise InvalidArgumentError(f"model must be a model name or folder for vLLM, got {model!r}")
        if eos_token_id not in (None, ()):
            raise InvalidArgumentError("VLLMEngine takes eos_token_id=None (the model's) or () (none), not a list")
        self.sampling = sampling if sampling is not None else Sampling()
        self._ignore_eos = eos_token_id == ()
        from transformers import AutoConfig
        from vllm import EngineArgs, LLMEngine

        # vLLM reads the same config; the cache is sized from its context before vLLM starts
        text_config = AutoConfig.from_pretrained(model, revision=revision).get_text_config()
        if context_length is None:
            context_length = int(text_config.max_position_embeddings)
        eos = () if self._ignore_eos else _config_eos(text_config.eos_token_id)
        super().__init__(context_length=context_length, vocab_size=int(text_config.vocab_size), eos_token_ids=eos)
        budget = budget if budget is not None else CacheBudget(page_size=16)
        self.budget = budget.resolved(context_length, BATCH_TOKENS)  # vLLM's attention reads each sequence's own pages
        arguments: dict[str, Any] = {
            "model": model,
            "tokenizer": tokenizer,
            "revision": revision,
            "seed": self.sampling.seed,
            "max_model_len": context_length,
            "max_num_seqs": self.budget.max_sequences,
            "max_num_batched_tokens": max(self.budget.batch_tokens, self.budget.max_sequences),
            "block_size": self.budget.page_size,
            "num_gpu_blocks_override": self.budget.pages(self.budget.cache_tokens),
        }
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            arguments["distributed_executor_backend"] = "external_launcher"
        arguments.update(engine_args or {})
        self._engine = LLMEngine.from_engine_args(EngineArgs(**arguments))
        self._progress: dict[int, list[int]] = {}

    def _params(self, prompt: Prompt, new_tokens: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        options: dict[str, Any] = {
            "n": 1,
            "max_tokens": new_tokens,
            "ignore_eos": self._ignore_eos,
            "detokenize": False,
            "output_kind": RequestOutputKind.DELTA,  # new tokens only: partial answers cost O(1) per step
        }
        if self.sampling.greedy:
            options["temperature"] = 0.0
        else:
            options["temperature"] = self.sampling.temperature
            options["top_k"] = self.sampling.top_k if self.sampling.top_k is not None else -1
            options["top_p"] = self.sampling.top_p if self.sampling.top_p is not None else 1.0
            options["seed"] = index_key(self.sampling.seed, prompt.index) >> 1
        return SamplingParams(**options)

    # ------------------------------------------------------------------ GenerationEngine's hooks

    def _enqueue(self, prompts: list[tuple[Prompt, int]]) -> None:
        for prompt, new_tokens in prompts:
            ids = list(prompt.token_ids + prompt.answer_prefix)
            self._engine.add_request(str(prompt.index), {"prompt_token_ids": ids}, self._params(prompt, new_tokens))
            self._progress[prompt.index] = []

    def _collect(self, timeout: float | None) -> list[Completion]:
        deadline = None if timeout is None else time.monotonic() + timeout
        done: list[Completion] = []
        while self._engine.has_unfinished_requests():
            try:
                outputs = self._engine.step()
            except Exception as error:  # noqa: BLE001 - any engine error loses every prompt in flight
                raise EngineFailedError(f"vLLM's engine failed: {error!r}; the prompts in flight are lost") from error
            for output in outputs:
                index = _index_of(output.request_id)
                tokens = self._progress.setdefault(index, [])
                tokens.extend(int(t) for t in output.outputs[0].token_ids)
                if output.finished:
                    del self._progress[index]
                    done.append(self._completion(index, tokens, output.outputs[0].finish_reason))
            if done or (deadline is not None and time.monotonic() >= deadline):
                break
        return done

    def _partial(self) -> dict[int, list[int]]:
        return {index: list(tokens) for index, tokens in self._progress.items() if tokens}

    def _shutdown(self) -> None:
        pending = [str(index) for index in self._progress]
        if pending:
            self._engine.abort_request(pending)
        self._progress.clear()
        del self._engine

    def _completion(self, index: int, tokens: list[int], finish_reason: str | None) -> Completion:
        prompt = self._in_flight[index]
        if finish_reason == "stop":
            reason = "stop"
        elif finish_reason == "length":
            reason = "length"
        else:
            error = f"vLLM ended the prompt of index {index} with finish_reason={finish_reason!r}"
            return Completion(index, (), "failed", len(prompt.token_ids), error)
        return Completion(index, tuple(tokens), reason, len(prompt.token_ids))


def _config_eos(eos_token_id: int | list[int] | None) -> tuple[int, ...]:
    """The model config's end-of-sequence ids as a tuple (vLLM stops on them, and on its generation config's)."""
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def _index_of(request_id: str) -> int:
    """The dataset index a request id names: its leading digits (since late 2025 vLLM makes a caller's request id
    unique inside the engine by a random suffix; read this way, either form names the index)."""
    digits = re.match(r"\d+", request_id)
    if digits is None:
        raise EngineFailedError(f"vLLM returned a request id that names no dataset index: {request_id!r}")
    return int(digits.group())
