"""Partial answers (issue 44, item 8): a generation job stopped by SIGTERM while long answers are half written
stores them with its closing commit, and the resume continues each from its committed tokens (prompt + partial
answer) instead of from its prompt: every prompt once, the answers those of an uninterrupted job, the tokens reused
counted in the record; a damaged partial-answers file is only a hint: its prompts start again from the prompt."""

from __future__ import annotations

import logging
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from harness import latest_commit_record

from torch_batch_process import read_outputs, torch_batch_process
from torch_batch_process.generation import Generate, Prompt
from torch_batch_process.generation.partial_answers import (
    PartialAnswer,
    PartialAnswers,
    decode,
    encode,
    prompt_digest,
)

pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("psutil")

from jobs.generation_job import BUDGET, Prompts, answered_at_once, collate, tiny_llama  # noqa: E402

N, BATCH, MAX_NEW = 40, 4, 64  # answers of up to 64 tokens: a stop catches some half written


def run(storage: Path, stop_after: int | None) -> Any:
    """The job (greedy), stopped by SIGTERM once ``stop_after`` batches are delivered (``None``: to the end)."""
    Gen = Generate(
        model=tiny_llama, prompt="ids", max_new_tokens="max_new", eos_token_id=(), budget=BUDGET,
        columns=("token_ids", "completion_tokens"), max_in_flight=16, drain_s=0.0, model_id="tiny-llama-seed0",
    )
    delivered = []
    write = Gen._write

    def write_then_stop(self: Any, completions: Any) -> None:
        write(self, completions)
        delivered.append(len(completions))
        if len(delivered) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption while the next batches' answers are being written

    Gen._write = write_then_stop
    return torch_batch_process(
        Gen, Prompts(N, MAX_NEW), batch_size=BATCH, storage_path=str(storage), checkpoint_interval=100,
        dataloader_kwargs={"collate_fn": collate},
    )


@pytest.mark.slow
def test_a_stopped_job_continues_its_partial_answers_and_survives_a_damaged_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped twice mid-answer (drain_s=0), the first stop's file damaged before the second attempt: the second
    answers those prompts from their prompts (a warning), the third continues the second stop's partial answers.
    Every prompt once, every answer the uninterrupted one (greedy), tokens reused > 0, the files gone at the end."""
    expected = answered_at_once(N, MAX_NEW)
    storage = tmp_path / "storage"

    assert run(storage, stop_after=1).preempted
    record = latest_commit_record(storage)
    assert record is not None and len(record["partial_answers"]) == 1, record
    first = storage / record["partial_answers"][0]
    kept = decode(first.read_bytes(), str(first))
    assert kept, "the stop kept no partial answer"
    for index, answer in kept.items():  # each a start of the uninterrupted answer (or all of it)
        assert list(answer.tokens) == expected[index][: len(answer.tokens)], index
    first.write_bytes(first.read_bytes()[:-7])  # damaged: the resume must not trust it

    with caplog.at_level(logging.WARNING, logger="torch_batch_process.generation.partial_answers"):
        assert run(storage, stop_after=1).preempted
    assert any("unreadable" in r.getMessage() for r in caplog.records), caplog.text
    record = latest_commit_record(storage)
    assert len(record["partial_answers"]) == 2, record
    assert record["stats"].get("reused_tokens", 0) == 0, record["stats"]  # the damaged file was not continued

    (storage / "_tbp" / "partials" / "00000099-rank_0.json").write_bytes(b"{}")  # a stop whose record never came
    result = run(storage, stop_after=None)
    assert not result.preempted
    table = read_outputs(str(storage)).to_pydict()
    assert Counter(table["index"]) == Counter(range(N))
    answers = dict(zip(table["index"], table["token_ids"], strict=True))
    differing = [i for i in expected if answers[i] != expected[i]]
    assert not differing, f"answers differ from the uninterrupted ones at indices {differing[:5]}"
    stats = latest_commit_record(storage)["stats"]
    assert stats["reused_tokens"] > 0 and stats["resumed_prompts"] > 0, stats
    assert stats["completion_tokens"] == sum(len(a) for a in expected.values()), stats
    assert stats["generated_prompts"] == N, stats
    assert not list((storage / "_tbp").glob("partials/*")), "partial answers outlived the finished job (or a repair)"


def test_partial_answers_are_checked_before_they_are_continued() -> None:
    """A file's SHA-256 and format guard it; an answer is continued only after the same prompt, within its
    max_new_tokens, inside the vocabulary, without an end-of-sequence token before its last; longer wins."""
    prompt = Prompt(3, (5, 6, 7), 6)
    good = PartialAnswer(prompt_digest(prompt.token_ids), (9, 9))
    raw = encode({3: good})
    assert decode(raw, "f") == {3: good}
    assert decode(raw.replace(b"[9,9]", b"[9,8]"), "f") == {}  # its SHA-256 no longer matches
    assert decode(b"not json", "f") == {}
    cases = {
        "good": (good, (9, 9)),
        "another prompt": (PartialAnswer(prompt_digest((5, 6)), (9,)), ()),
        "too long": (PartialAnswer(good.digest, (9,) * 7), ()),
        "outside the vocabulary": (PartialAnswer(good.digest, (9, 100)), ()),
        "eos inside": (PartialAnswer(good.digest, (2, 9)), ()),
    }
    for name, (answer, prefix) in cases.items():
        answers = PartialAnswers()
        answers.add({3: answer})
        assert answers.resume([prompt], vocab_size=100, eos_token_ids=(2,))[0].answer_prefix == prefix, name
        assert not answers, f"{name}: continued once only"
    answers = PartialAnswers()
    answers.add({3: good})
    answers.add({3: PartialAnswer(good.digest, (9,))})  # a shorter, older one does not replace it
    assert answers.answers[3].tokens == (9, 9)
