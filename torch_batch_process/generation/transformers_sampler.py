"""Sampling seeded per dataset index inside ``transformers``' continuous batching loop.

``transformers`` (5.x) samples with one ``torch.multinomial`` over the whole step, from the generator its config's
``seed`` sets: a prompt's tokens then depend on which prompts shared its steps, and a request takes no seed of its
own. Its loop does let a logits processor receive one 32-bit value per row (``ContinuousBatchingLogitsProcessor``:
``prepare_tensor_args`` reads each request's ``logit_processor_kwargs`` on the host, ``__call__`` gets them on the
device beside the step's scores, in row order). :class:`SeededSampler` uses that row to carry the uniform number of
the token being drawn (:func:`~torch_batch_process.generation.sampling.token_uniform`: from the prompt's key and the
token's position in the answer, float32 bits), draws the token by inverse transform
(:func:`~torch_batch_process.generation.sampling.sample_tokens`), and returns scores whose argmax is that token,
so the loop runs greedy (``do_sample=False``) and picks it.

A token's position is counted from the start of the answer: the request's ``position_offset`` (the tokens in its
cache once this step's query is in: the index of the token being drawn) minus the prompt's length (sent as
``tbp_prompt_tokens``). That count does not change when ``transformers`` evicts a request and restarts it from its
prompt and the tokens it had (a "soft reset" folds them into ``initial_tokens``), nor when the job resubmits a
preempted answer's prefix after its prompt.

The engine runs the loop synchronously when it samples (``use_async_batching=False``): ``position_offset`` is
advanced when a step is scheduled, before its arguments are prepared, so the count should hold in the asynchronous
mode too (where ``generated_tokens`` lags a step), but that mode runs only on CUDA/XPU and has not been checked.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_batch_process.generation.sampling import Sampling, sample_tokens, token_uniform

__all__ = ["KEY_ARG", "PROMPT_TOKENS_ARG", "seeded_processor_list"]

KEY_ARG = "tbp_index_key"
"""The request's ``logit_processor_kwargs`` entry holding its 64-bit sampling key (:func:`index_key`)."""
PROMPT_TOKENS_ARG = "tbp_prompt_tokens"
"""The request's ``logit_processor_kwargs`` entry holding its prompt's length (without the answer prefix)."""


def seeded_processor_list(sampling: Sampling) -> Any:
    """The ``ContinuousBatchingLogitsProcessorList`` that samples as ``sampling`` says, seeded per request (to put
    in place of the manager's ``logit_processor`` before its loop starts)."""
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )
    from transformers.generation.logits_process import LogitsProcessorList

    class SeededSampler(ContinuousBatchingLogitsProcessor):
        """Draws each row's token from its own uniform; returns scores whose argmax is that token."""

        supported_kwargs: dict[str, type] = {KEY_ARG: int, PROMPT_TOKENS_ARG: int}  # noqa: RUF012 - the base's API
        ignored_kwargs: tuple[str, ...] = ()

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.zero_()

        def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
            uniforms = []
            for future in requests_with_new_token:
                state = future.state
                kwargs = state.logit_processor_kwargs
                position = state.position_offset - kwargs.get(PROMPT_TOKENS_ARG, 0)
                uniforms.append(token_uniform(kwargs.get(KEY_ARG, 0), position))
            return torch.tensor(uniforms, dtype=torch.float32).view(torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            uniforms = tensor_arg[: scores.size(0)].view(torch.float32)
            chosen = sample_tokens(scores, uniforms, sampling)
            # the loop's scores are a float32 copy of this step's logits, read no more: overwritten in place
            return scores.fill_(float("-inf")).scatter_(-1, chosen.unsqueeze(-1), 0.0)

    processors = ContinuousBatchingLogitsProcessorList(
        LogitsProcessorList([SeededSampler()]), per_request_processors=False, drop_unsupported_processors=True
    )
    # the list counts the argument rows of the processors it converted itself; ours is given converted
    processors.tensors_required = 1
    return processors
