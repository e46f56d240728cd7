"""Generation engines (DESIGN §19, issue 44 phase 1): ``TransformersEngine`` over a real Llama built from a config
(2 layers, width 64, random weights, seeded) on the CPU, the sampling seeded per dataset index, and the vLLM backend's
checks (its round trip needs vLLM and a GPU: skipped here, saying so)."""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

import pytest
import torch

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.generation import (
    CacheBudget,
    Completion,
    EngineClosedError,
    EngineFailedError,
    Prompt,
    Sampling,
    TransformersEngine,
    VLLMEngine,
    index_key,
    sample_tokens,
    token_uniform,
)
from torch_batch_process.generation.vllm_engine import vllm_available

transformers = pytest.importorskip("transformers", minversion="5.24")  # the API this engine was checked on
pytest.importorskip("psutil")

CONTEXT = 96
VOCAB = 512
BUDGET = CacheBudget(max_sequences=8, batch_tokens=64, page_size=16)
SAMPLED = Sampling(temperature=0.9, top_k=200, top_p=0.95, seed=7)


def tiny_llama(seed: int = 0, model_cls: Any = None) -> Any:
    """A 2-layer Llama of width 64 with random weights, no end-of-sequence token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return (model_cls or LlamaForCausalLM)(config).eval()


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


def make_prompts(n: int, seed: int = 1) -> list[Prompt]:
    """``n`` prompts of 2-40 tokens with answers of 1-60 tokens (some capped by the context)."""
    rng = random.Random(seed)
    return [
        Prompt(i, [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 41))], rng.randrange(1, 61))
        for i in range(n)
    ]


def run(engine: TransformersEngine, prompts: list[Prompt], chunks: int = 1) -> dict[int, Completion]:
    """Submits ``prompts`` in ``chunks`` parts (polling in between) and returns every completion by index, checking
    that each index comes back exactly once."""
    done: dict[int, Completion] = {}

    def take(completions: list[Completion]) -> None:
        for completion in completions:
            assert completion.index not in done, f"index {completion.index} came back twice"
            done[completion.index] = completion

    size = -(-len(prompts) // chunks)
    for start in range(0, len(prompts), size):
        engine.submit(prompts[start : start + size])
        take(engine.poll(timeout=0.05))
    while engine.in_flight:
        take(engine.poll(timeout=30))
    assert sorted(done) == sorted(p.index for p in prompts)
    return done


def answers(done: dict[int, Completion]) -> dict[int, tuple[int, ...]]:
    return {index: c.token_ids for index, c in done.items()}


class EvictionLog(logging.Handler):
    """Counts the requests ``transformers``' loop evicts and restarts from their tokens ("soft reset"), from its
    log (its logger does not propagate, so pytest's ``caplog`` does not see it)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.soft_resets = 0
        self.logger = logging.getLogger("ContinuousBatchingLogger")

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"(\d+) soft reset", record.getMessage())
        self.soft_resets += int(found.group(1)) if found else 0

    def __enter__(self) -> EvictionLog:
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def reference_answer(model: Any, prompt: Prompt, sampling: Sampling) -> tuple[int, ...]:
    """The answer drawn by a plain loop (a full forward per token, no cache, no engine) with the same per-index
    uniforms: what the engine must give, whatever it batched the prompt with."""
    key = index_key(sampling.seed, prompt.index)
    sequence = list(prompt.token_ids)
    new = min(prompt.max_new_tokens, CONTEXT - len(sequence))
    with torch.inference_mode():
        for position in range(new):
            logits = model(torch.tensor([sequence])).logits[0, -1:].float()
            uniform = torch.tensor([token_uniform(key, position)])
            sequence.append(int(sample_tokens(logits, uniform, sampling)[0]))
    return tuple(sequence[len(prompt.token_ids) :])


def test_round_trip_lengths_failures_and_greedy_order_independence(model: Any) -> None:
    """Every index comes back once with its own answer length (capped by the context), an over-long prompt and an
    out-of-vocabulary one come back as failures naming the index and lengths while the others run, greedy answers
    are ``model.generate``'s and do not depend on the submission order or chunking."""
    prompts = make_prompts(30)
    long_prompt = Prompt(30, [3] * (CONTEXT + 4), 5)
    full_prompt = Prompt(31, [3] * CONTEXT, 5)
    bad_token = Prompt(32, [1, VOCAB + 3, 2], 5)
    near_full = Prompt(33, [5] * (CONTEXT - 3), 40)  # room for 3 tokens: capped, "length"
    every = [*prompts, long_prompt, full_prompt, bad_token, near_full]
    with TransformersEngine(model, budget=BUDGET, eos_token_id=()) as engine:
        assert engine.context_length == CONTEXT and engine.budget.cache_tokens == 8 * 96
        first = run(engine, every)
        second = run(engine, list(reversed(every)), chunks=4)
    for prompt in [*prompts, near_full]:
        completion = first[prompt.index]
        assert completion.finish_reason == "length" and completion.error is None
        assert completion.completion_tokens == min(prompt.max_new_tokens, CONTEXT - len(prompt.token_ids))
        assert completion.prompt_tokens == len(prompt.token_ids)
    assert first[33].completion_tokens == 3
    assert first[30].failed and first[30].token_ids == ()
    assert first[30].error == (
        f"the prompt of index 30 has {CONTEXT + 4} tokens, the model's context holds {CONTEXT}: no room for an "
        "answer token"
    )
    assert first[31].failed and f"has {CONTEXT} tokens" in first[31].error
    assert first[32].failed and f"token id {VOCAB + 3}, outside the vocabulary (0-{VOCAB - 1})" in first[32].error
    assert answers(first) == answers(second)
    with torch.inference_mode():
        for prompt in prompts[:4]:
            ids = torch.tensor([prompt.token_ids])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=first[prompt.index].completion_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )
            assert tuple(out[0, ids.shape[1] :].tolist()) == first[prompt.index].token_ids


def test_sampled_answers_depend_on_the_index_only(model: Any) -> None:
    """Sampled answers seeded per index: the same across submission orders, with a cache so small that the engine
    evicts and restarts requests, resumed from a prefix of their answer, and equal to a plain loop's draws; another
    seed gives other answers. ``partial()`` reads the answers in progress."""
    prompts = make_prompts(24, seed=2)
    with TransformersEngine(model, sampling=SAMPLED, budget=BUDGET, eos_token_id=()) as engine:
        first = answers(run(engine, prompts))
        second = answers(run(engine, list(reversed(prompts)), chunks=3))
        engine.submit(prompts)
        progress: dict[int, tuple[int, ...]] = {}
        deadline = time.monotonic() + 30
        while not progress and time.monotonic() < deadline:  # the answers in progress, once some have started
            progress = engine.partial()
        while engine.in_flight:
            engine.poll(timeout=30)
    assert first == second
    assert progress and all(first[index][: len(tokens)] == tokens for index, tokens in progress.items())
    for prompt in prompts[:3]:
        assert first[prompt.index] == reference_answer(model, prompt, SAMPLED)
    small = CacheBudget(max_sequences=8, cache_tokens=CONTEXT, batch_tokens=32, page_size=16)
    resumed = [
        Prompt(p.index, p.token_ids, p.max_new_tokens, first[p.index][: len(first[p.index]) // 2]) for p in prompts
    ]
    evictions = EvictionLog()
    with evictions, TransformersEngine(model, sampling=SAMPLED, budget=small, eos_token_id=()) as engine:
        assert answers(run(engine, prompts)) == first
        assert answers(run(engine, resumed)) == first
    assert evictions.soft_resets > 0, "the small cache was meant to make transformers evict requests"
    other = Sampling(temperature=0.9, top_k=200, top_p=0.95, seed=8)
    with TransformersEngine(model, sampling=other, budget=BUDGET, eos_token_id=()) as engine:
        assert sum(a != b for a, b in zip(answers(run(engine, prompts)).values(), first.values(), strict=True)) > 20


def test_end_of_sequence_stops_an_answer(model: Any) -> None:
    """With an end-of-sequence token, an answer that draws it ends there with ``finish_reason="stop"``; a resubmitted
    answer whose prefix already ended comes back as it is."""
    prompts = make_prompts(12, seed=3)
    with TransformersEngine(model, budget=BUDGET, eos_token_id=()) as engine:
        free = answers(run(engine, prompts))
    prompt = next(p for p in prompts if len(free[p.index]) >= 4)
    eos = free[prompt.index][2]
    with TransformersEngine(model, budget=BUDGET, eos_token_id=eos) as engine:
        done = run(engine, [prompt])[prompt.index]
    stop = free[prompt.index].index(eos) + 1
    assert done.finish_reason == "stop" and done.token_ids == free[prompt.index][:stop]
    # a resumed answer whose prefix already ended (an EOS, max_new_tokens, the context) needs no engine
    ended = Prompt(50, prompt.token_ids, 30, answer_prefix=(7, eos))
    full = Prompt(51, [4] * (CONTEXT - 2), 30, answer_prefix=(7, 8))
    with TransformersEngine(model, budget=BUDGET, eos_token_id=eos) as engine:
        engine.submit([ended, full])
        assert engine.poll() == [
            Completion(50, (7, eos), "stop", len(prompt.token_ids)),
            Completion(51, (7, 8), "length", CONTEXT - 2),
        ]


def test_a_dying_engine_raises_and_bad_calls_are_refused(model: Any) -> None:
    """A generation loop that dies (the model raises) is an ``EngineFailedError``, not a failure per prompt; wrong
    arguments and calls are refused with errors naming them."""
    from transformers import LlamaForCausalLM

    class Breaks(LlamaForCausalLM):
        calls = 0

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            type(self).calls += 1
            if type(self).calls > 3:
                raise RuntimeError("simulated kernel failure")
            return super().forward(*args, **kwargs)

    with TransformersEngine(tiny_llama(model_cls=Breaks), budget=BUDGET, eos_token_id=()) as engine:
        engine.submit(make_prompts(10))
        with pytest.raises(EngineFailedError, match="simulated kernel failure"):
            while True:
                engine.poll(timeout=10)
    with pytest.raises(InvalidArgumentError, match="init_continuous_batching"):
        TransformersEngine(torch.nn.Linear(2, 2))
    with pytest.raises(InvalidArgumentError, match="cache_tokens=50 cannot hold one sequence"):
        TransformersEngine(model, budget=CacheBudget(cache_tokens=50))
    with pytest.raises(InvalidArgumentError, match="exceeds the model's max_position_embeddings"):
        TransformersEngine(model, context_length=CONTEXT + 1)
    engine = TransformersEngine(model, budget=BUDGET, eos_token_id=())
    with pytest.raises(InvalidArgumentError, match="index 4 is already in flight"):
        engine.submit([Prompt(3, [1, 2], 3), Prompt(4, [1, 2], 3), Prompt(4, [1, 2], 3)])
    assert engine.in_flight == 0  # nothing of a refused call was submitted
    engine.submit([Prompt(4, [1, 2], 3)])
    with pytest.raises(InvalidArgumentError, match="index 4 is already in flight"):
        engine.submit([Prompt(4, [1, 2], 3)])
    engine.stop()
    engine.stop()
    with pytest.raises(EngineClosedError):
        engine.submit([Prompt(5, [1, 2], 3)])


def test_prompts_sampling_and_budget_check_their_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="max_new_tokens must be an int >= 1"):
        Prompt(0, [1], 0)
    with pytest.raises(InvalidArgumentError, match="index must be an int >= 0"):
        Prompt(-1, [1], 3)
    with pytest.raises(InvalidArgumentError, match="must hold ints"):
        Prompt(0, [1.5], 3)
    with pytest.raises(InvalidArgumentError, match="more than its max_new_tokens=2"):
        Prompt(0, [1], 2, answer_prefix=[1, 2, 3])
    assert Prompt(0, torch.tensor([4, 5]), 3).token_ids == (4, 5)
    with pytest.raises(InvalidArgumentError, match="top_k and Sampling.top_p do nothing with temperature=0"):
        Sampling(top_k=5)
    with pytest.raises(InvalidArgumentError, match="temperature must be a float >= 0"):
        Sampling(temperature=-1.0)
    with pytest.raises(InvalidArgumentError, match="top_p must be None or a float in"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(InvalidArgumentError, match="max_sequences must be an int >= 1"):
        CacheBudget(max_sequences=0)
    assert CacheBudget(max_sequences=4, page_size=16).resolved(90).cache_tokens == 368  # 360, in whole pages
    assert CacheBudget(max_sequences=2, page_size=16).resolved(4096).cache_tokens == 4096
    assert Sampling().fingerprint() == {"kind": "greedy"}


def test_one_sampling_has_one_fingerprint_however_its_numbers_are_spelled() -> None:
    """``top_p=1`` and ``1.0``, numpy scalars: the same sampling, the same stored fingerprint (a resume compares it)."""
    import json

    import numpy as np

    spelled = [
        Sampling(temperature=1, top_k=5, top_p=1, seed=7),
        Sampling(temperature=1.0, top_k=np.int64(5), top_p=np.float32(1.0), seed=np.uint64(7)),
    ]
    assert len({json.dumps(sampling.fingerprint(), sort_keys=True) for sampling in spelled}) == 1
    assert spelled[0].fingerprint() == {"kind": "sampled", "temperature": 1.0, "top_k": 5, "top_p": 1.0, "seed": 7}
    with pytest.raises(InvalidArgumentError, match="top_k must be None or an int"):
        Sampling(temperature=1.0, top_k=2.5)


def test_inverse_transform_sampling_draws_from_the_processed_distribution() -> None:
    """``sample_tokens``: each token drawn with its probability after temperature, top-k and top-p; top-k of 1 is
    the argmax; the uniforms are deterministic, in [0, 1) and distinct per index and position."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    draws = 20000
    uniforms = torch.tensor([token_uniform(index_key(3, i), 0) for i in range(draws)])
    chosen = sample_tokens(logits.expand(draws, -1), uniforms, Sampling(temperature=1.0))
    frequencies = torch.bincount(chosen, minlength=5).float() / draws
    assert torch.allclose(frequencies, logits.softmax(-1)[0], atol=0.015)
    kept = sample_tokens(logits.expand(draws, -1), uniforms, Sampling(temperature=1.0, top_k=2))
    assert set(kept.tolist()) == {0, 1}
    nucleus = sample_tokens(logits.expand(draws, -1), uniforms, Sampling(temperature=1.0, top_p=0.6))
    assert set(nucleus.tolist()) == {0}  # token 0 alone holds 0.64 >= 0.6
    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    top1 = sample_tokens(scores, uniforms[:6], Sampling(temperature=2.0, top_k=1))
    assert top1.tolist() == scores.argmax(-1).tolist() == sample_tokens(scores, uniforms[:6], Sampling()).tolist()
    assert token_uniform(index_key(3, 5), 2) == token_uniform(index_key(3, 5), 2)
    distinct = {token_uniform(index_key(3, i), p) for i in range(50) for p in range(50)}
    assert len(distinct) >= 2490  # 24-bit numbers: a collision or two among 2,500 is expected
    assert 0.0 <= float(uniforms.min()) and float(uniforms.max()) < 1.0


@pytest.mark.skipif(vllm_available(), reason="checks the message shown where vLLM is missing")
def test_vllm_engine_without_vllm_says_how_to_get_it() -> None:
    with pytest.raises(InvalidArgumentError, match="VLLMEngine needs vLLM: pip install vllm"):
        VLLMEngine("any/model")


@pytest.mark.skipif(
    not (vllm_available() and torch.cuda.is_available()), reason="the vLLM backend needs vLLM and a GPU"
)
def test_vllm_engine_round_trip(tmp_path: Any) -> None:  # pragma: no cover - runs only where vLLM and a GPU are
    """The same round trip through vLLM: a tiny Llama saved to a folder, greedy answers of their own lengths, an
    over-long prompt failed with its index, the same answers in another order."""
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    prompts = [*make_prompts(20), Prompt(20, [3] * (CONTEXT + 4), 5)]
    with VLLMEngine(str(tmp_path), budget=BUDGET, eos_token_id=(), engine_args={"dtype": "float32"}) as engine:
        first = run(engine, prompts)
        second = run(engine, list(reversed(prompts)), chunks=3)
    assert first[20].failed and "index 20" in first[20].error
    for prompt in prompts[:20]:
        assert first[prompt.index].completion_tokens == min(prompt.max_new_tokens, CONTEXT - len(prompt.token_ids))
    assert answers(first) == answers(second)


def test_a_rank_that_claims_its_batches_holds_only_what_its_engine_runs(model: Any) -> None:
    """``max_in_flight``'s default: 4 x ``max_sequences`` when batches are dealt; ``max_sequences`` when the rank claims
    them (``schedule="dynamic"``): holding more would queue prompts on one rank that another could run at the end."""
    from torch_batch_process.context import CurrentBatch
    from torch_batch_process.engine.feed.in_flight import InFlight
    from torch_batch_process.engine.rank_failure import RankFailure
    from torch_batch_process.engine.work import RankWork

    with TransformersEngine(model, budget=BUDGET, eos_token_id=()) as engine:
        sequences = engine.budget.max_sequences
        limits = {}
        for claims in (False, True):
            feed = InFlight(CurrentBatch(), RankWork(), RankFailure(0), torch.inference_mode, claims=claims)
            feed.use(engine)
            limits[claims] = feed.limit
            feed.use(engine, max_in_flight=3)  # the user's limit wins either way
            assert feed.limit == 3
    assert limits == {False: 4 * sequences, True: sequences}


def test_registering_the_same_engine_again_leaves_its_budget_as_it_is(
    model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The budget earlier attempts learned is applied once, when the processor registers its engine. Registering the
    same engine again re-read it and applied it again: an engine the processor had restarted with a budget of its own
    since was restarted once more (dropping its prompts in flight). Again it only takes the new arguments."""
    from torch_batch_process.context import CurrentBatch
    from torch_batch_process.engine.feed.in_flight import InFlight
    from torch_batch_process.engine.rank_failure import RankFailure
    from torch_batch_process.engine.work import RankWork

    caplog.set_level(logging.INFO, logger="torch_batch_process.engine.feed.in_flight")
    with TransformersEngine(model, budget=BUDGET, eos_token_id=()) as engine:
        full = engine.budget
        feed = InFlight(CurrentBatch(), RankWork(), RankFailure(0), torch.inference_mode, learn_budget=True)
        feed.start_from({"cache_tokens": full.cache_tokens, "batch_tokens": full.batch_tokens // 4})
        feed.use(engine)
        assert engine.budget.batch_tokens == full.batch_tokens // 4, "the learned budget applied"
        assert feed.take_budget()[0] == engine.budget  # the news of the first start travels once
        engine.restart(full)  # the processor's own choice, after registering its engine
        feed.use(engine, max_in_flight=3)
        feed.use(engine, max_in_flight=3)
        assert engine.budget == full and feed.limit == 3 and feed.take_budget() == (None, 0)
    starts = [r for r in caplog.records if "starts within the budget" in r.getMessage()]
    assert len(starts) == 1, [r.getMessage() for r in starts]
