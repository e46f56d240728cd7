"""What goes into a generation engine and what comes out: a :class:`Prompt` per dataset index, a :class:`Completion`
per prompt.

A prompt is named by its dataset index, which is also the engine's request id: an index is unique in a job and
stable across resumes with any world size, so a completion finds its row (and its batch) whatever order the engine
finishes prompts in. A prompt may carry the start of its answer (``answer_prefix``: tokens generated before a
preemption and committed); the engine then continues that answer instead of starting it again, and the completion
holds the whole answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch_batch_process.errors import InvalidArgumentError

__all__ = ["FINISH_REASONS", "Completion", "FinishReason", "Prompt"]

FinishReason = Literal["stop", "length", "failed"]
"""Why an answer ended: ``"stop"`` (an end-of-sequence token, kept as the answer's last token), ``"length"``
(``max_new_tokens`` reached, or the model's context full) or ``"failed"`` (the prompt could not run:
:attr:`Completion.error` says why; the other prompts are unaffected)."""

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "failed")


@dataclass(frozen=True)
class Prompt:
    """One prompt to answer, named by its dataset index."""

    index: int
    """The dataset index of the example (the engine's request id)."""
    token_ids: tuple[int, ...]
    """The prompt's token ids (the chat template already applied)."""
    max_new_tokens: int
    """The most tokens the answer may hold (``answer_prefix`` included)."""
    answer_prefix: tuple[int, ...] = ()
    """Tokens of the answer generated before (a committed partial answer): the engine continues after them."""

    def __post_init__(self) -> None:
        _check_int("Prompt.index", self.index, minimum=0)
        _check_int("Prompt.max_new_tokens", self.max_new_tokens, minimum=1)
        object.__setattr__(self, "token_ids", _token_tuple("Prompt.token_ids", self.token_ids, self.index))
        object.__setattr__(self, "answer_prefix", _token_tuple("Prompt.answer_prefix", self.answer_prefix, self.index))
        if len(self.answer_prefix) > self.max_new_tokens:
            raise InvalidArgumentError(
                f"Prompt.answer_prefix of index {self.index} holds {len(self.answer_prefix)} tokens, more than its "
                f"max_new_tokens={self.max_new_tokens}: pass the prefix the answer had when it was interrupted"
            )

    @property
    def remaining_tokens(self) -> int:
        """How many tokens the answer may still grow by."""
        return self.max_new_tokens - len(self.answer_prefix)


@dataclass(frozen=True)
class Completion:
    """The answer to one prompt (or why it has none)."""

    index: int
    """The dataset index of the prompt."""
    token_ids: tuple[int, ...]
    """The answer's token ids, the prompt's ``answer_prefix`` included; empty for a failed prompt."""
    finish_reason: FinishReason
    """``"stop"``, ``"length"`` or ``"failed"`` (see :data:`FinishReason`)."""
    prompt_tokens: int
    """The prompt's length in tokens (without the answer prefix)."""
    error: str | None = None
    """Why the prompt failed (``finish_reason == "failed"``), naming the index; else ``None``."""

    @property
    def completion_tokens(self) -> int:
        """The answer's length in tokens."""
        return len(self.token_ids)

    @property
    def failed(self) -> bool:
        """Whether the prompt could not run (see :attr:`error`)."""
        return self.finish_reason == "failed"


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


def _token_tuple(name: str, tokens: Sequence[int], index: int) -> tuple[int, ...]:
    """``tokens`` as a tuple of Python ints (from a list, a tuple, a 1-d tensor or numpy array)."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidArgumentError(f"{name} of index {index} must be a sequence of token ids, got {type(tokens)}")
    values = tuple(tokens)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise InvalidArgumentError(f"{name} of index {index} must hold ints (token ids), got {values[:5]!r}...")
    return values
