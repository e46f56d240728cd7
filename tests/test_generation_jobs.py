"""Generation jobs (DESIGN §19, issue 44 phase 2): ``generation.Generate`` in real jobs over a tiny random-weight Llama
built from a config with a fixed seed (``tests/jobs/generation_job.py``): batches in flight in one continuous-batching
engine per rank, committed once when their last prompt is answered; SIGTERM (drain within ``drain_s``, the rest left
uncommitted, their partial answers kept and continued by the resume) and kill -9 mid-job, resumed on other world
sizes: every prompt answered once, the answers those of the same prompts answered uninterrupted (seeded sampling per
dataset index). Bad inputs refused before any work."""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import JOBS, committed_batches, latest_commit_record, spawn_ranks, wait_all

from torch_batch_process import (
    BatchTimeoutError,
    InvalidArgumentError,
    TorchBatchProcessor,
    read_failures,
    read_outputs,
    torch_batch_process,
)
from torch_batch_process.generation import (
    CacheBudget,
    Generate,
    GenerationEngine,
    Prompt,
    Sampling,
    TransformersEngine,
)

pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("psutil")

from jobs.generation_job import BUDGET, SAMPLED, Prompts, answered_at_once, tiny_llama  # noqa: E402 - after the skips

GENERATION_JOB = JOBS / "generation_job.py"
N, BATCH, MAX_NEW = 200, 8, 24
TOO_LONG = (5, 77, 190)  # prompts that fill the model's context: failing examples (on_error="skip")


def committed(storage: str) -> tuple[Counter[int], dict[int, list[int]]]:
    """How often each index is committed, and its answer."""
    table = read_outputs(storage).to_pydict()
    return Counter(table["index"]), dict(zip(table["index"], table["token_ids"], strict=True))


def start(tmp_path: Path, world_size: int, attempt: int, **extra: Any) -> tuple[list[Any], dict[str, Any]]:
    spec = {
        "storage": str(tmp_path / "storage"), "report_dir": str(tmp_path / "reports"), "n": N, "batch_size": BATCH,
        "max_new": MAX_NEW, "sampled": True, "max_in_flight": 32, "attempt": attempt,
        "progress": str(tmp_path / f"progress{attempt}"), "too_long": TOO_LONG, "on_error": "skip", **extra,
    }
    return spawn_ranks(world_size, GENERATION_JOB, json.dumps(spec)), spec


def wait_for_batches(spec: dict[str, Any], procs: list[Any], batches: int, timeout: float = 120) -> None:
    progress = Path(spec["progress"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if progress.exists() and len(progress.read_text().split()) >= batches:
            return
        time.sleep(0.05)
    outputs = wait_all(procs, 5)
    raise AssertionError(f"no {batches} batches delivered: {[err[-2000:] for _, _, err in outputs]}")


def report(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    return json.loads(Path(spec["report_dir"], f"attempt{spec['attempt']}_rank{rank}.json").read_text())


def check_whole_batches(counts: Counter[int]) -> None:
    """Each index at most once, and only whole batches (a batch in flight at a stop is not committed at all)."""
    assert max(counts.values(), default=1) == 1, [i for i, c in counts.items() if c > 1]
    for batch in range(-(-N // BATCH)):
        present = [i in counts for i in range(batch * BATCH, min((batch + 1) * BATCH, N)) if i not in TOO_LONG]
        assert all(present) or not any(present), f"batch {batch} committed in part: {present}"


@pytest.mark.slow
def test_generation_jobs_answer_every_prompt_once_across_sigterm_and_kill(tmp_path: Path) -> None:
    """2 ranks stopped by SIGTERM mid-job (drain of 0.2 s: batches still in flight are left uncommitted, their answers
    so far kept as partial answers), resumed on 1 rank (continuing them) killed with -9 mid-job, resumed on 2 ranks
    (dynamic schedule) to the end: every prompt once, in whole batches at each stop, every answer that of the same
    prompt answered uninterrupted, tokens reused from the partial answers; the prompts that fill the model's context
    are failing examples (on_error="skip"), recorded once."""
    # the uninterrupted answers (~9 s of CPU), computed in this process while the jobs of stages 1 and 2 start and
    # wait on their slow batches (the CPU is mostly idle then); only the answers' check after stage 3 waits for them
    uninterrupted = ThreadPoolExecutor(1, thread_name_prefix="answered-at-once")
    expected_answers = uninterrupted.submit(answered_at_once, N, MAX_NEW, SAMPLED, skip=TOO_LONG)
    try:
        _sigterm_kill_and_resume(tmp_path, expected_answers)
    finally:
        uninterrupted.shutdown(wait=True, cancel_futures=True)


def _sigterm_kill_and_resume(tmp_path: Path, expected_answers: Future[dict[int, list[int]]]) -> None:
    procs, spec = start(tmp_path, 2, 1, drain_s=0.2, slow_s=0.3)  # 1. SIGTERM both ranks mid-job
    wait_for_batches(spec, procs, 3)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    results = wait_all(procs, 90)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    assert all(report(spec, rank)["result"]["preempted"] for rank in (0, 1))
    counts, _ = committed(spec["storage"])
    check_whole_batches(counts)
    assert 0 < len(counts) < N, len(counts)
    # the answers left in flight, if the engine had not finished them all when the stop came: kept (item 8)
    kept = latest_commit_record(spec["storage"]).get("partial_answers", [])
    assert len(kept) <= 2, kept

    procs, spec = start(tmp_path, 1, 2, slow_s=0.3)  # 2. another world size, killed with -9 mid-job
    wait_for_batches(spec, procs, 2)
    procs[0].kill()
    wait_all(procs, 30)
    counts, _ = committed(spec["storage"])
    check_whole_batches(counts)
    assert len(counts) < N - len(TOO_LONG), "stage 3 has batches left to generate"

    procs, spec = start(tmp_path, 2, 3, schedule="dynamic")  # 3. to the end
    results = wait_all(procs, 150)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    counts, answers = committed(spec["storage"])
    assert counts == Counter(i for i in range(N) if i not in TOO_LONG)
    expected = expected_answers.result()
    differing = [i for i in expected if answers[i] != expected[i]]
    assert not differing, f"{len(differing)} answers differ from the uninterrupted ones, e.g. index {differing[:5]}"
    stats = latest_commit_record(spec["storage"])["stats"]
    assert stats["generated_prompts"] == N, stats  # each prompt counted once over the 3 attempts, failed ones too
    assert stats["completion_tokens"] == sum(len(answer) for answer in expected.values()), stats
    if kept:  # continued by the resumes (tests/test_generation_partial_answers.py makes sure of a stop mid-answer)
        assert stats["reused_tokens"] > 0 and stats["resumed_prompts"] > 0, stats
    assert "partial_answers" not in latest_commit_record(spec["storage"])  # deleted with the job finished
    failures = read_failures(spec["storage"])  # the prompts too long: failing examples, once, naming index and lengths
    assert [f["index"] for f in failures] == list(TOO_LONG), failures
    assert all(f["error_type"] == "PromptFailedError" and f"index {f['index']} has 96 tokens" in f["message"]
               for f in failures), failures


def kill_once_committed(spec: dict[str, Any], procs: list[Any], batches: int) -> int:
    """Kills every rank with -9 once the job's record holds ``batches`` batches; returns how many it holds then."""
    deadline = time.monotonic() + 120
    while committed_batches(spec["storage"]) < batches and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [err[-3000:] for _, _, err in wait_all(procs, 5)]
        time.sleep(0.05)
    for proc in procs:
        proc.kill()
    wait_all(procs, 30)
    return committed_batches(spec["storage"])


@pytest.mark.slow
def test_a_kill_during_the_final_drain_loses_only_what_the_drain_had_not_committed(tmp_path: Path) -> None:
    """2 ranks submit all their batches at once (max_in_flight holds them), so their answers are delivered in the
    final drain, slowly (0.3 s per batch); the drain commits as batches complete (checkpoint_interval=1). Static
    schedule: both ranks killed with -9 once 2 batches are committed. Resumed on 2 ranks, dynamic schedule: its drain
    commits before its end too, and its ranks generate only the prompts of the batches not committed (the attempt's
    own counts); every prompt answered once. On a simulated device too small for the given budget
    (``on_oom="split"``): the first attempt's ranks learn a budget, kept in the record, and the resumed ranks start
    within it (no out-of-memory error)."""
    n, batches = 64, 64 // BATCH
    common = {"n": n, "too_long": (), "on_error": "raise", "max_in_flight": n, "max_new": 32, "checkpoint_interval": 1,
              "slow_s": 0.3, "oom_above": 20, "on_oom": "split"}  # and a device of 20 tokens per step (budget: 64)
    procs, spec = start(tmp_path, 2, 1, **common)
    deadline = time.monotonic() + 120
    while committed_batches(spec["storage"]) < 2 and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), [err[-3000:] for _, _, err in wait_all(procs, 5)]
        time.sleep(0.05)
    for proc in procs:
        proc.kill()
    wait_all(procs, 30)
    kept = committed_batches(spec["storage"])
    assert 2 <= kept < batches - 2, f"the static drain committed {kept} of {batches} batches before the kill"
    learned = latest_commit_record(spec["storage"])["generation_budget"]  # both ranks' engines ran out of memory
    assert learned["batch_tokens"] <= 20 and learned["ooms"] >= 2, learned

    procs, spec = start(tmp_path, 2, 2, schedule="dynamic", **common)
    seen = set()
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline + 120:
        seen.add(committed_batches(spec["storage"]))
        time.sleep(0.05)
    results = wait_all(procs, 30)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]
    assert any(kept < value < batches for value in seen), f"no commit in the dynamic drain: {sorted(seen)}"
    counts, _ = committed(spec["storage"])
    assert counts == Counter(range(n))
    stats = latest_commit_record(spec["storage"])["stats"]
    assert sum(prompts for _, prompts, _, _ in stats["generation_ranks"]) == n - kept * BATCH, stats  # none twice
    assert stats["generated_prompts"] == n
    result = report(spec, 0)["result"]  # the resumed ranks' engines started within the learned budget
    assert result["ooms"] == 0 and result["generation_budget"] == learned, result


def test_generate_refuses_bad_arguments_naming_them() -> None:
    """Every bad argument of Generate is refused when the class is made, before any work, naming the argument."""
    good: dict[str, Any] = {"model": tiny_llama, "prompt": "ids", "max_new_tokens": 8}
    cases = [
        ({"model": None}, "Generate(model=...)"),
        ({"model": object()}, "Generate(model=...)"),
        ({"prompt": 3}, "Generate(prompt=...)"),
        ({"max_new_tokens": 0}, "Generate(max_new_tokens=...)"),
        ({"sampling": {"temperature": 0.7}}, "Generate(sampling=...)"),
        ({"budget": 64}, "Generate(budget=...)"),
        ({"engine": "sglang"}, "Generate(engine='sglang')"),
        ({"columns": ("text", "logits")}, "Generate(columns=...)"),
        ({"columns": ("text",)}, "no tokenizer"),
        ({"tokenizer": 5}, "Generate(tokenizer=...)"),
        # checked here too, not only when each rank builds its engine (after the job file is written)
        ({"max_in_flight": 0}, "Generate(max_in_flight=...)"),
        ({"max_in_flight": 2.5}, "Generate(max_in_flight=...)"),
        ({"drain_s": -1}, "Generate(drain_s=...)"),
        ({"drain_s": float("nan")}, "Generate(drain_s=...)"),
        ({"drain_s": "30"}, "Generate(drain_s=...)"),
        ({"context_length": 1}, "Generate(context_length=...)"),
        ({"context_length": "96"}, "Generate(context_length=...)"),
        ({"context_length": 96, "budget": CacheBudget(cache_tokens=64)}, "CacheBudget.cache_tokens=64 cannot hold"),
        ({"eos_token_id": "</s>"}, "Generate(eos_token_id=...)"),
        ({"eos_token_id": -1}, "Generate(eos_token_id=...)"),
        ({"eos_token_id": (2, 2.5)}, "Generate(eos_token_id=...)"),
        ({"model_id": 5}, "Generate(model_id=...)"),
        ({"revision": object()}, "Generate(revision=...)"),
        ({"engine": "vllm", "model": "org/model", "eos_token_id": 2}, "Generate(engine='vllm', eos_token_id=2)"),
        ({"columns": "text"}, "Generate(columns=...) takes a sequence of column names"),
    ]
    for change, message in cases:
        with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Generate(**{**good, **change})
    # token ids as a tensor or numpy ints: stored in the fingerprint as plain ints (JSON)
    assert Generate(**good, eos_token_id=torch.tensor([2, 3])).generation_fingerprint["eos"] == [2, 3]
    assert Generate(**good, eos_token_id=np.int64(2), drain_s=math.inf).generation_fingerprint["eos"] == 2
    assert Generate(**{**good, "max_new_tokens": np.int64(8)}).generation_fingerprint["max_new_tokens"] == 8
    assert type(Generate(**{**good, "max_new_tokens": np.int64(8)}).spec.max_new_tokens) is int
    with pytest.raises(InvalidArgumentError, match=r"Sampling.temperature|temperature"):
        Sampling(temperature=-1.0)
    with pytest.raises(InvalidArgumentError, match="CacheBudget.max_sequences"):
        CacheBudget(max_sequences=0)
    assert Generate(**good).generation_fingerprint["model"].endswith("tiny_llama")


class _NoEngine(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        self.context.generate([Prompt(i, [1, 2], 4) for i in self.context.batch_indices], print)


class _WrongPrompts(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context
        context.use_generation_engine(TransformersEngine(tiny_llama(context.device), budget=BUDGET))

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        self.context.generate([[1, 2, 3]] * len(self.context.batch_indices), print)


_ROWS_OF_IDS = [{"ids": [1 + i, 2, 3, 4, 5, 6]} for i in range(8)]  # the default collate_fn transposes them


@pytest.mark.parametrize(
    ("processor", "dataset", "message"),
    [
        (_NoEngine, list(range(8)), r"needs an engine: call context.use_generation_engine\(engine\)"),
        (_WrongPrompts, list(range(8)), r"context.generate\(prompts=...\) takes generation.Prompt objects, got list"),
        (
            Generate(model=tiny_llama, prompt=lambda row: float(row), max_new_tokens=4, budget=BUDGET),
            list(range(8)),
            r"Generate\(prompt=...\): the prompt of index 0 is a float; a prompt is a str, chat messages",
        ),
        (
            Generate(
                model=tiny_llama, prompt=lambda row: [1, 2, 3], max_new_tokens=lambda row: float(row) / 2, budget=BUDGET
            ),
            list(range(8)),
            r"Generate\(max_new_tokens=...\): the example of index 0 asks for 0.0 new tokens; it must be an int >= 1",
        ),
        (
            Generate(model=tiny_llama, prompt="ids", max_new_tokens=4, budget=BUDGET),
            _ROWS_OF_IDS,
            r"column 'ids' holds 6 values: the default collate_fn transposes .* pass dataloader_kwargs=",
        ),
        (  # a model builder that returns no model (forgot its return): named, not an AttributeError on None
            Generate(model=lambda device: None, prompt="ids", max_new_tokens=4, budget=BUDGET),
            list(range(8)),
            r"Generate\(model=...\): the function .*<lambda> returned NoneType, not a transformers causal language",
        ),
    ],
    ids=["no engine", "not Prompt objects", "a float prompt", "a float max_new_tokens", "transposed token ids",
         "a builder returning no model"],
)
def test_a_custom_processor_without_engine_or_with_wrong_prompts_fails_its_first_batch(
    tmp_path: Path, processor: type[TorchBatchProcessor], dataset: Any, message: str
) -> None:
    """context.generate without an engine, or with what is not a Prompt, or Generate given a prompt of no known type,
    a row asking for a non-integer number of new tokens, or token-id lists transposed by the default collate_fn (the
    prompt of example i would be the batch's i-th tokens): the job fails at the first batch, naming what to fix, and
    commits nothing."""
    with pytest.raises(InvalidArgumentError, match=message):
        torch_batch_process(processor, dataset, batch_size=4, storage_path=str(tmp_path / "s"))
    assert not list((tmp_path / "s").glob("outputs/commit_*/rank_*/records/*"))


class _StuckEngine(GenerationEngine):
    """A backend whose generation never finishes (a hung kernel, a dead worker that does not say so)."""

    def __init__(self) -> None:
        super().__init__(context_length=64, vocab_size=100, eos_token_ids=())

    def _enqueue(self, prompts: list[tuple[Prompt, int]]) -> None:
        pass

    def _collect(self, timeout: float | None) -> list[Any]:
        time.sleep(min(timeout or 0.0, 0.2))
        return []

    def _partial(self) -> dict[int, list[int]]:
        return {}

    def _shutdown(self) -> None:
        pass


class _Stuck(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context
        context.use_generation_engine(_StuckEngine())

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        self.context.generate([Prompt(i, [1, 2], 4) for i in self.context.batch_indices], self.context.write)


def byte_tokenizer() -> Any:
    """A byte-level tokenizer (256 ids, no special token: an empty string has no tokens) with a chat template, built
    here (no download): any text that is valid Unicode has tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


UNTRUSTED = [
    "hello world",
    "",  # no tokens: fails in the engine
    "nul\x00byte\x00",
    "lone \ud800 surrogate",  # no UTF-8 tokenizer encodes it: fails when tokenized
    [{"role": "user", "content": "h\u00e9llo \U0001f642 \u4e2d\u6587 \x00"}],  # chat messages
    "\U0001f642" * 30,  # 120 bytes: longer than the model's context (96)
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ok"}],
    "\u202e right-to-left <script>alert(1)</script>",
    [{"role": "user", "content": "chat \ud800 surrogate"}],  # chat messages no UTF-8 tokenizer encodes
]


def test_text_chat_and_untrusted_prompts_are_answered_or_failing_examples(tmp_path: Path) -> None:
    """Prompts as text and as chat messages through a real tokenizer, and untrusted text (NUL bytes, a lone
    surrogate, emoji and CJK, control characters, an empty string, one longer than the context), with
    on_error="skip": every prompt that can run is answered once, with the token count of its chat template; the others
    are failing examples naming their index; the batch they were in still writes the rest of its rows."""
    tokenizer = byte_tokenizer()
    Gen = Generate(
        model=tiny_llama, tokenizer=tokenizer, prompt="p", max_new_tokens=4, eos_token_id=(), budget=BUDGET,
        columns=("text", "finish_reason", "prompt_tokens", "completion_tokens"),
    )
    storage = str(tmp_path / "s")
    torch_batch_process(
        Gen, [{"p": p} for p in UNTRUSTED], batch_size=4, storage_path=storage, on_error="skip", tensorboard=False,
        dataloader_kwargs={"collate_fn": list},
    )
    rows = read_outputs(storage).to_pylist()
    assert [row["index"] for row in rows] == [0, 2, 4, 6, 7], rows
    assert all(isinstance(row["text"], str) and row["completion_tokens"] == 4 for row in rows), rows
    chat = tokenizer.apply_chat_template(UNTRUSTED[4], add_generation_prompt=True, return_dict=False)
    expected = len("<user>h\u00e9llo \U0001f642 \u4e2d\u6587 \x00\n<assistant>".encode())
    assert rows[2]["prompt_tokens"] == len(chat) == expected, (rows[2], chat)
    failures = {f["index"]: f["message"] for f in read_failures(storage)}
    assert sorted(failures) == [1, 3, 5, 8], failures
    assert "index 1 has no tokens" in failures[1] and "cannot encode the prompt of index 3" in failures[3]
    assert "cannot encode the prompt of index 8" in failures[8], failures  # was a raw TypeError naming no index
    assert "index 5 has 120 tokens" in failures[5], failures


def test_a_stuck_engine_fails_the_job_after_batch_timeout(tmp_path: Path) -> None:
    """A batch in flight longer than batch_timeout fails the job naming the batch, never a hang (its process_batch
    returned long ago: the batch's time counts from its submission)."""
    started = time.monotonic()
    with pytest.raises(BatchTimeoutError, match=r"batch 0 has been in the generation engine for .* batch_timeout=1 s"):
        torch_batch_process(_Stuck, list(range(8)), batch_size=4, storage_path=str(tmp_path / "s"), batch_timeout=1)
    assert time.monotonic() - started < 60


def test_progress_status_and_report_show_prompts_and_tokens(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A generation job's `tbp status` and `tbp report` (the dashboard renders the same page) say prompts and
    input/output tokens per second, per rank, from the generation participant's counts; the progress line adds the
    committed prompts and tokens per second."""
    from torch_batch_process.observe.progress import LogDisplay
    from torch_batch_process.observe.report.data import read_job_data
    from torch_batch_process.observe.report.page import build_model, render_page
    from torch_batch_process.observe.status import format_status, read_status
    from torch_batch_process.observe.token_rates import TokenRates

    Gen = Generate(
        model=tiny_llama, prompt="ids", max_new_tokens="max_new", eos_token_id=(), budget=BUDGET,
        columns=("completion_tokens",), model_id="tiny-llama-seed0",
    )
    storage = str(tmp_path / "s")
    torch_batch_process(
        Gen, Prompts(24, 8), batch_size=4, storage_path=storage, checkpoint_interval=1, tensorboard=False,
        dataloader_kwargs={"collate_fn": lambda rows: rows},
    )
    status = read_status(storage)
    generation = status["generation"]
    assert generation["generated_prompts"] == 24 and generation["ranks"][0]["rank"] == 0, generation
    assert generation["ranks"][0]["tokens_out_per_s"] > 0, generation
    assert generation["completion_tokens"] == sum(Prompts(24, 8)[i]["max_new"] for i in range(24))
    text = format_status(status)
    assert re.search(r"generation +24 prompts answered, .*\n +latest attempt: in \S+ tok/s, out \S+ tok/s", text), text
    page = render_page(build_model(read_job_data(storage)))
    assert "24 prompts answered" in page and "tok/s" in page

    now = [0.0]
    rates = TokenRates(clock=lambda: now[0])
    display = LogDisplay(interval=1, total_examples=24, total_batches=6, initial_examples=0, initial_batches=0,
                         clock=lambda: now[0])
    display.extra = rates.text
    rates.add(12, 2400, 620)
    now[0] = 2.0
    with caplog.at_level(logging.INFO, logger="torch_batch_process"):
        display.show(12, 3)
    assert "| 12 prompts, in 1.2k tok/s, out 310 tok/s |" in caplog.text, caplog.text
