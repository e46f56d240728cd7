"""Generation jobs: continuous batching inside a worker (DESIGN §19).

An engine answers prompts named by their dataset index, several at once, starting one as soon as another finishes
(:class:`GenerationEngine`: ``submit``, ``poll``, ``partial``, ``stop``). Backends:

- :class:`TransformersEngine`: ``transformers``' continuous batching (``init_continuous_batching``), CPU and GPU,
  the embedded default;
- :class:`VLLMEngine`: vLLM's ``LLMEngine`` when vLLM is installed (GPU), imported only when used.

Answers are greedy or sampled with a seed per dataset index (:class:`Sampling`), so they do not depend on the other
prompts of a step, on submission order or on a resume (up to the engine's batch invariance: see
:mod:`~torch_batch_process.generation.sampling`). A prompt that cannot run (longer than the model's context) comes
back as a failed :class:`Completion` naming its index and lengths; the other prompts are unaffected.

In a job, :func:`Generate` makes the ready processor (one row per prompt, no loop to write); a custom processor calls
``context.use_generation_engine(engine)`` in ``__init__`` and ``context.generate(prompts, on_done)`` in
``process_batch``: the batch stays in flight while the engine answers it beside the next ones, and is committed with
its rows, once, when its last prompt is answered (``docs/generation.md``).
"""

from torch_batch_process.generation.engine import (
    CacheBudget,
    EngineClosedError,
    EngineFailedError,
    GenerationEngine,
    admit,
)
from torch_batch_process.generation.processor import COLUMNS, DEFAULT_COLUMNS, Generate
from torch_batch_process.generation.requests import FINISH_REASONS, Completion, FinishReason, Prompt
from torch_batch_process.generation.sampling import Sampling, index_key, sample_tokens, token_uniform
from torch_batch_process.generation.transformers_engine import TransformersEngine
from torch_batch_process.generation.vllm_engine import VLLMEngine

__all__ = [
    "COLUMNS",
    "DEFAULT_COLUMNS",
    "FINISH_REASONS",
    "CacheBudget",
    "Completion",
    "EngineClosedError",
    "EngineFailedError",
    "FinishReason",
    "Generate",
    "GenerationEngine",
    "Prompt",
    "Sampling",
    "TransformersEngine",
    "VLLMEngine",
    "admit",
    "index_key",
    "sample_tokens",
    "token_uniform",
]
