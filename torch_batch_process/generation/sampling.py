"""Sampling parameters and sampling seeded per dataset index, so a prompt's answer does not depend on which other
prompts shared its batches, nor on the order they were submitted in, nor on a resume.

Every sampled token draws one uniform number from a counter-based hash of ``(seed, dataset index, position in the
answer)`` (SplitMix64 finalizers: no generator state to carry, the same number on any device and in any process) and
picks the token by inverse transform over the processed distribution: the smallest token whose cumulative
probability exceeds the uniform. So a token depends only on the model's logits for that sequence and on
``(seed, index, position)``; an answer resumed from its first ``k`` tokens draws the same uniforms for its later
tokens as the uninterrupted one. The cost is a softmax and a cumulative sum over the vocabulary per sampled token,
what ``torch.multinomial`` does too.

The logits themselves are batch-invariant only where the engine's kernels are: a continuous-batching engine changes a
sequence's batch every step, and a matrix product over another batch may round the last bit of a logit differently,
which can flip a near-tie (greedy or sampled). See ``docs`` of the generation processor.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any

import torch

from torch_batch_process.errors import InvalidArgumentError

__all__ = ["Sampling", "index_key", "sample_tokens", "token_uniform"]

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Sampling:
    """How answers are drawn: greedy (``temperature=0``, the default) or sampled, seeded per dataset index.

    ``top_k`` keeps the ``k`` most likely tokens, ``top_p`` the smallest set whose probability reaches ``p`` (both
    after the temperature, as in ``transformers`` and vLLM); ``seed`` with the dataset index seeds each prompt's
    draws (:func:`index_key`).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise InvalidArgumentError(f"Sampling.temperature must be a float >= 0 (0: greedy), got {t!r}")
        object.__setattr__(self, "temperature", float(t))
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
            raise InvalidArgumentError(f"Sampling.top_k must be None or an int >= 1, got {self.top_k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1):
            raise InvalidArgumentError(f"Sampling.top_p must be None or a float in (0, 1], got {p!r}")
        # one value, one spelling (top_p=1 and 1.0, numpy scalars): the fingerprint compares stored and new sampling
        object.__setattr__(self, "top_k", None if k is None else int(k))
        object.__setattr__(self, "top_p", None if p is None else float(p))
        if self.greedy and (self.top_k is not None or self.top_p is not None):
            raise InvalidArgumentError(
                "Sampling.top_k and Sampling.top_p do nothing with temperature=0 (greedy decoding): drop them, or "
                "set a temperature > 0 to sample"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or not 0 <= self.seed <= _MASK:
            raise InvalidArgumentError(f"Sampling.seed must be an int in [0, 2**64), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        """Whether each token is the most likely one (``temperature == 0``)."""
        return self.temperature == 0.0

    def fingerprint(self) -> dict[str, Any]:
        """What the stored job records (a changed sampling changes every answer)."""
        return {"kind": "greedy"} if self.greedy else {"kind": "sampled", **asdict(self)}


def _splitmix64(x: int) -> int:
    """One SplitMix64 step of ``x`` (a bijection of 64-bit ints with good avalanche)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def index_key(seed: int, index: int) -> int:
    """The 64-bit key of dataset index ``index``'s draws in a job seeded with ``seed``."""
    return _splitmix64(_splitmix64(seed) ^ (index & _MASK))


def token_uniform(key: int, position: int) -> float:
    """The uniform number in ``[0, 1)`` that draws the token at ``position`` (0-based, in the answer) of the
    prompt whose key is ``key``; 24 bits, so it is exact in float32."""
    return (_splitmix64(key ^ _splitmix64(position)) >> 40) / float(1 << 24)


def sample_tokens(scores: torch.Tensor, uniforms: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The token drawn for each row of ``scores`` (``[rows, vocab]`` logits) by its uniform (``[rows]``).

    Applies the temperature, ``top_k`` and ``top_p`` to the logits, then inverse transform sampling: the smallest
    token whose cumulative probability exceeds ``uniform * total``. Greedy ``sampling`` returns the argmax.
    Graph-capturable (no host synchronisation).
    """
    if sampling.greedy:
        return scores.argmax(dim=-1)
    logits = scores.float()
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    vocab = logits.size(-1)
    if sampling.top_k is not None and sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        mass = ordered.softmax(dim=-1).cumsum(dim=-1)
        # a token stays if the tokens more likely than it hold less than top_p (so the most likely always stays)
        drop = (mass - ordered.softmax(dim=-1)) >= sampling.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    # unnormalised weights suffice: the uniform is scaled by their total
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    cdf = weights.cumsum_(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return chosen.clamp_(max=vocab - 1)
