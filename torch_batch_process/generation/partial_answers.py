"""Partial answers: the tokens a preempted job had generated for the prompts it left unanswered, stored with the
stop's commit so that the resume continues those answers instead of starting them again (issue 44, item 8).

A stop (SIGTERM, a preemption) drains the engine for at most ``drain_s`` seconds; a batch still in flight then is
not committed (its rows would be incomplete), so its prompts run again on resume. Without partial answers a long
answer interrupted at 90% is generated again from its prompt. With them, each rank writes, with its closing commit,
the tokens of every prompt of its unfinished batches (the whole answer of a prompt that finished in a batch that did
not; the tokens so far of one still running), keyed by dataset index; the resume submits ``prompt + partial
answer`` with the rest of the answer's ``max_new_tokens`` (:attr:`Prompt.answer_prefix`), on whichever rank gets
the batch, at any world size.

Exactly once is untouched: a partial answer never becomes a row by itself; the row still comes only from the
completion of a batch that a durable record commits. Partial answers are only a hint: a file that is missing,
damaged (it carries a SHA-256 of its content) or of an unknown format, or an answer whose prompt changed (each
carries a digest of its prompt's tokens), too long for its ``max_new_tokens``, holding a token outside the
vocabulary or an end-of-sequence token before its last, is ignored with a warning, and that prompt starts from its
prompt as without partial answers.

Same answers: a token is drawn from ``(seed, dataset index, position in the answer)`` (see
:mod:`~torch_batch_process.generation.sampling`), so the continued answer draws the same numbers as the
uninterrupted one, greedy or sampled. The continuation's first step recomputes the partial answer's keys and values
in one prefill where the uninterrupted answer computed them a token at a time: the logits are the same up to the
rounding of the engine's kernels (what ``transformers`` itself does when it evicts a request from a full cache and
prefills it again later), so a near-tie can flip in the last bits, as continuous batching can flip one anyway.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from torch_batch_process.generation.requests import Prompt

__all__ = ["FORMAT", "PartialAnswer", "PartialAnswers", "decode", "encode", "from_storage", "prompt_digest"]

FORMAT = "tbp-partial-answers/1"
"""The format tag of a partial-answers file."""

logger = logging.getLogger(__name__)


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids (so a partial answer is never continued after another prompt)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class PartialAnswer:
    """The start of one prompt's answer, as a stop left it."""

    digest: str
    """:func:`prompt_digest` of the prompt's token ids."""
    tokens: tuple[int, ...]
    """The answer's tokens generated so far (all of them for a prompt that finished in a batch that did not)."""


def encode(answers: Mapping[int, PartialAnswer]) -> bytes:
    """The bytes of a partial-answers file (JSON: the format, a SHA-256 of the answers, the answers)."""
    rows = [[index, answer.digest, list(answer.tokens)] for index, answer in sorted(answers.items())]
    body = json.dumps(rows, separators=(",", ":"))
    head = {"format": FORMAT, "sha256": hashlib.sha256(body.encode()).hexdigest(), "count": len(rows)}
    return (json.dumps(head, separators=(",", ":")) + "\n" + body).encode()


def decode(raw: bytes, where: str) -> dict[int, PartialAnswer]:
    """The answers of a partial-answers file; ``{}`` with a warning when it is damaged or of another format."""
    try:
        head_line, _, body = raw.decode().partition("\n")
        head = json.loads(head_line)
        if head.get("format") != FORMAT:
            raise ValueError(f"unknown format {head.get('format')!r}")
        if hashlib.sha256(body.encode()).hexdigest() != head.get("sha256"):
            raise ValueError("its content does not match its SHA-256")
        answers = {}
        for index, digest, tokens in json.loads(body):
            if not isinstance(index, int) or not isinstance(digest, str):
                raise ValueError(f"a malformed entry for index {index!r}")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise ValueError(f"index {index} holds tokens that are not ints")
            answers[index] = PartialAnswer(digest, tuple(tokens))
    except (UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        logger.warning("partial answers %s are unreadable (%s): their prompts start again", where, exc)
        return {}
    return answers


@dataclass
class PartialAnswers:
    """The partial answers a resumed rank may continue, from every file of the latest record (any world size)."""

    answers: dict[int, PartialAnswer] = field(default_factory=dict)

    def add(self, answers: Mapping[int, PartialAnswer]) -> None:
        """Adds a file's answers; of two for the same index, the longer one stays (both start the same answer)."""
        for index, answer in answers.items():
            kept = self.answers.get(index)
            if kept is None or len(answer.tokens) > len(kept.tokens):
                self.answers[index] = answer

    def __len__(self) -> int:
        return len(self.answers)

    def resume(self, prompts: Iterable[Prompt], vocab_size: int, eos_token_ids: tuple[int, ...]) -> list[Prompt]:
        """``prompts`` with their partial answer as ``answer_prefix`` where one fits (each used once: taken out);
        a prompt that has a prefix of its own, or none stored, is left as it is. An answer that does not fit its
        prompt is dropped with a warning (the prompt starts from its beginning)."""
        out = []
        for prompt in prompts:
            answer = self.answers.pop(prompt.index, None)
            if answer is None or prompt.answer_prefix or not answer.tokens:
                out.append(prompt)
                continue
            problem = _mismatch(prompt, answer, vocab_size, eos_token_ids)
            if problem is not None:
                logger.warning(
                    "the partial answer of index %d is not continued (%s): its prompt starts again",
                    prompt.index, problem,
                )
                out.append(prompt)
                continue
            out.append(Prompt(prompt.index, prompt.token_ids, prompt.max_new_tokens, answer.tokens))
        return out


def _mismatch(prompt: Prompt, answer: PartialAnswer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> str | None:
    """Why ``answer`` cannot continue ``prompt``, or ``None``."""
    tokens = answer.tokens
    if answer.digest != prompt_digest(prompt.token_ids):
        return "its prompt's tokens changed"
    if len(tokens) > prompt.max_new_tokens:
        return f"{len(tokens)} tokens, more than its max_new_tokens={prompt.max_new_tokens}"
    if not all(0 <= t < vocab_size for t in tokens):
        return "a token outside the vocabulary"
    if any(t in eos_token_ids for t in tokens[:-1]):
        return "an end-of-sequence token before its last token"
    return None


def from_storage(read: Callable[[str], bytes], files: Iterable[str], url_of: Callable[[str], str]) -> PartialAnswers:
    """The partial answers of ``files`` (read with ``read(rel) -> bytes``); a missing or unreadable file is skipped
    with a warning."""
    restored = PartialAnswers()
    for rel in files:
        where = url_of(rel)
        try:
            raw = read(rel)
        except Exception as exc:  # noqa: BLE001 - a hint: missing or unreachable, its prompts start again
            logger.warning("partial answers %s are unreadable (%s): their prompts start again", where, exc)
            continue
        restored.add(decode(raw, where))
    return restored
