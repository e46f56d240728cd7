"""The generation engine's KV-cache budget, learned (issue 44 item 5, DESIGN §15 and §19): a model on a simulated
device whose memory holds ``LIMIT`` tokens per forward step (a step of more raises a real ``torch.OutOfMemoryError``
inside ``transformers``' generation loop, which then dies as on a GPU) runs a job whose budget is too large. With
``on_oom="split"`` the engine restarts with a smaller budget and answers the prompts it lost again (every prompt once,
the answers of an unconstrained engine); the budget is kept in the commit record and a resumed attempt's engine starts
within it (no step above the limit, no out-of-memory error). Without it the job fails, resumable."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from harness import latest_commit_record

from torch_batch_process import read_outputs, torch_batch_process
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.generation import CacheBudget, EngineFailedError, Generate
from torch_batch_process.observe.status import format_status, read_status

pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("psutil")

from jobs.generation_job import (  # noqa: E402 - after the skips
    BUDGET,
    Prompts,
    answered_at_once,
    collate,
    on_small_device,
    tiny_llama,
)

N, BATCH, MAX_NEW = 40, 4, 16
LIMIT = 20
"""Tokens one forward step may hold on the simulated device (BUDGET's batch_tokens is 64: too large)."""

steps: list[int] = []
"""The tokens of every forward step the simulated device ran (or refused)."""


def limited_llama(device: Any) -> Any:
    """The tests' tiny Llama on a device whose memory holds ``LIMIT`` tokens per forward step."""
    return on_small_device(tiny_llama, LIMIT)(device, steps)


def run(storage: Path, stop_after: int | None, on_oom: str = "split") -> tuple[Any, list[CacheBudget]]:
    """The job (greedy), stopped by SIGTERM once ``stop_after`` batches are delivered (``None``: to the end); also
    the engine's budget at each delivered batch."""
    Gen = Generate(
        model=limited_llama, prompt="ids", max_new_tokens="max_new", eos_token_id=(), budget=BUDGET,
        columns=("token_ids",), max_in_flight=8, drain_s=0.0, model_id="tiny-llama-seed0",
    )
    budgets: list[CacheBudget] = []
    write = Gen._write

    def write_then_stop(self: Any, completions: Any) -> None:
        write(self, completions)
        budgets.append(self.engine.budget)
        if len(budgets) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)

    Gen._write = write_then_stop
    result = torch_batch_process(
        Gen, Prompts(N, MAX_NEW), batch_size=BATCH, storage_path=str(storage), checkpoint_interval=1,
        dataloader_kwargs={"collate_fn": collate}, on_oom=on_oom,
    )
    return result, budgets


def test_the_engine_budget_is_learned_kept_and_resumed_from(tmp_path: Path) -> None:
    with pytest.raises(EngineFailedError, match="simulated device"):  # on_oom="raise": the job fails
        run(tmp_path / "raise", None, on_oom="raise")
    assert not list((tmp_path / "raise" / "outputs").glob("**/*.parquet"))

    storage = tmp_path / "storage"
    first, budgets = run(storage, stop_after=2)
    assert first.preempted
    learned = budgets[-1]
    assert learned.batch_tokens <= LIMIT < BUDGET.batch_tokens, learned
    halvings = (BUDGET.batch_tokens // learned.batch_tokens).bit_length() - 1
    assert first.ooms == halvings >= 1, (first.ooms, learned)
    kept = {"device": "cpu", "cache_tokens": learned.cache_tokens, "batch_tokens": learned.batch_tokens,
            "max_sequences": BUDGET.max_sequences, "page_size": BUDGET.page_size, "ooms": halvings}
    assert first.generation_budget == kept
    assert latest_commit_record(storage)["generation_budget"] == kept

    steps.clear()
    second, budgets = run(storage, stop_after=None)
    assert not second.preempted and second.finished
    assert budgets[0] == learned, "the resumed engine did not start from the learned budget"
    assert steps and max(steps) <= LIMIT, "the resumed engine ran a step above what was learned"
    assert second.ooms == 0 and second.generation_budget == kept
    status = read_status(str(storage))  # tbp status (and the report, which shows the same line)
    assert status["generation"]["budget"] == kept
    line = f"KV cache {learned.cache_tokens:,} tokens, {learned.batch_tokens} tokens per step ({halvings} out-of-memory"
    assert f"engine budget learned: {line} errors)" in format_status(status)
    table = read_outputs(str(storage)).to_pydict()
    assert Counter(table["index"]) == Counter(range(N))
    expected = answered_at_once(N, MAX_NEW)
    answers = dict(zip(table["index"], table["token_ids"], strict=True))
    assert [i for i in expected if answers[i] != expected[i]] == []


def test_budget_steps_down_to_its_floor() -> None:
    budget = CacheBudget(max_sequences=4, cache_tokens=256, batch_tokens=64, page_size=16).resolved(40)
    seen = []
    while budget is not None:
        seen.append((budget.cache_tokens, budget.batch_tokens))
        budget = budget.smaller(40)
    assert seen == [(256, 64), (256, 32), (256, 16), (128, 16), (64, 16), (48, 16)]
    resolved = CacheBudget(cache_tokens=1024, batch_tokens=512, page_size=64).resolved(96)
    assert resolved.at_most(100, 48, 96) == CacheBudget(cache_tokens=128, batch_tokens=48, page_size=64)
    assert resolved.at_most(4096, 4096, 96) == resolved


def test_a_budget_leaves_the_step_size_to_the_engine_which_keeps_it_small_on_a_cpu() -> None:
    """``batch_tokens=None`` (the default): the engine's own step size; on a CPU, where ``transformers``' continuous
    batching scores each token of a step against every token the step reads (a mask over the whole step), the small
    one (BENCHMARKS.md section 9: 128 tokens a step ran 1.25x faster than 512); a budget's own value is kept."""
    from torch_batch_process.generation import TransformersEngine
    from torch_batch_process.generation.engine import BATCH_TOKENS, MASKED_BATCH_TOKENS
    from torch_batch_process.generation.transformers_engine import step_tokens

    model = tiny_llama("cpu")
    assert CacheBudget().batch_tokens is None and "the engine's default" in CacheBudget().describe()
    assert step_tokens(model) == MASKED_BATCH_TOKENS < BATCH_TOKENS
    with TransformersEngine(model, eos_token_id=()) as engine:
        assert engine.budget.batch_tokens == MASKED_BATCH_TOKENS, engine.budget
        assert engine.budget == CacheBudget().resolved(engine.context_length, MASKED_BATCH_TOKENS)
    with TransformersEngine(model, budget=CacheBudget(batch_tokens=256), eos_token_id=()) as engine:
        assert engine.budget.batch_tokens == 256
    assert CacheBudget(batch_tokens=300).resolved(96, 128).batch_tokens == 300
    with pytest.raises(ValueError, match="resolve the budget first"):
        CacheBudget().smaller(96)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(InvalidArgumentError, match="CacheBudget.batch_tokens must be None"):
            CacheBudget(batch_tokens=bad)
