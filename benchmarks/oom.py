"""Memory-adaptive batches (DESIGN §15): ``max_tokens="auto"`` against a ``max_tokens`` chosen by hand and against a
job that splits every batch that runs out of memory from scratch, on a simulated device memory.

    python -m benchmarks.oom                    # 3 rounds, 3,000 passages, batch_size 256
    python -m benchmarks.oom --rounds 5 --examples 6000
    python -m benchmarks.oom --fail-at end      # a batch that does not fit fails after its forward
    python -m benchmarks.oom --model minilm     # the real all-MiniLM-L6-v2 (about 30x slower on a CPU)
    python -m benchmarks.oom --device cuda --model minilm --gpu-memory-mib 1024   # real out-of-memory errors

**Workload** (MiniLM-shaped): passages of 1 to 6 consecutive docstring sentences of Python's standard library
(the MiniLM benchmark's text, no download), tokenized by all-MiniLM-L6-v2's tokenizer in the ``collate_fn``
(truncated at 128 tokens), embedded by a BERT encoder with MiniLM's shape (6 layers, heads of 32 dimensions,
feed-forward 4x wide, eager attention) at a quarter of its width (96; random weights, seeded) so that a CPU runs the
table in minutes (``--model minilm``: the real model), mean pooling, one row per passage written with
``context.write``; ``bucket_by`` the token counts, ``batch_size`` 256 (the most a batch may hold).

**Simulated device memory**: before each layer's attention and feed-forward block the processor adds up the bytes
that block holds alive in inference (its input, Q/K/V, the attention scores and probabilities; or the feed-forward
activation) for the batch's ``(examples, padded length)`` and raises a real ``torch.OutOfMemoryError`` when they
exceed the device, as the CUDA allocator would at that allocation: so a failed attempt costs the work done before
it (here the embeddings and the first layer's Q/K/V: a few % of a forward), and the memory per token grows with
the length (attention scores), as on a GPU. With ``--fail-at end`` the check runs after the forward instead (a
failed attempt costs a whole forward, as for a model whose largest allocation comes last). What an
out-of-memory error costs on a real GPU besides (the allocator synchronizes and frees its cache, the next batches
allocate again) is not simulated. The device holds a batch of 32 x 128 tokens (4,096 padded tokens at
length 128; more tokens at shorter lengths).

**On a GPU** (``--device cuda``): no simulation; the model runs on the GPU with this process's share of the GPU's
memory capped at ``--gpu-memory-mib`` (``torch.cuda.set_per_process_memory_fraction``), so the out-of-memory
errors are the CUDA allocator's own, and cost what they cost there; the best ``max_tokens`` by hand is found by a
binary search over short jobs (the plan's largest batches, ``on_oom="raise"``).

**Contenders** (same process, interleaved, order rotated every round; fresh storage each run):

- ``by hand``: ``max_tokens`` = the largest value whose every batch fits (computed from the memory model, checked:
  zero out-of-memory errors), i.e. the best ``max_tokens`` a user can choose;
- ``auto``: ``max_tokens="auto"`` (``on_oom="split"``, the default);
- ``no learning``: ``on_error="skip"``, ``on_oom="raise"``: every batch that runs out of memory is bisected
  (DESIGN §11) and nothing is learned, so every long batch fails again, and so do its halves;
- ``resume``: ``max_tokens="auto"`` stopped (SIGTERM) once a tenth of the batches are done and it has met an
  out-of-memory error (learned something), then resumed: the resumed call's out-of-memory errors (the limits are
  stored with the job). On a real GPU a size near the limit may fit in one call and not in the next (the
  allocator's fragmentation differs), so a first call can finish without meeting one: the round then says so.

Throughput: examples per second of the process's CPU time (all threads; robust on a shared machine) and of wall
time; the figures are the medians of same-round ratios. Goals: ``auto`` at most a handful of out-of-memory errors,
``auto / by hand >= 0.95``, ``auto / no learning >= 1.5``, the resume zero.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.workloads import MINILM_MAX_LENGTH, configure_process, load_sentences, minilm_dir
from torch_batch_process import TorchBatchProcessor, read_outputs, torch_batch_process

FLOAT = 4  # bytes

_STATE: dict[str, Any] = {}
"""The model, tokenizer and simulated device, built once per process (every contender uses the same)."""


# ------------------------------------------------------------------------------------------ workload


def passages(n: int) -> list[str]:
    """``n`` passages of 1 to 6 consecutive sentences (deterministic)."""
    sentences = load_sentences(n + 8)
    return [" ".join(sentences[i : i + 1 + (i * 7) % 6]) for i in range(n)]


def build_model(kind: str) -> torch.nn.Module:
    from transformers import AutoModel, BertConfig, BertModel

    if kind == "minilm":
        return AutoModel.from_pretrained(str(minilm_dir()), attn_implementation="eager").eval()
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=96, num_hidden_layers=6, num_attention_heads=3, intermediate_size=384,
        max_position_embeddings=512, attn_implementation="eager",
    )
    return BertModel(config).eval()


class SimulatedDevice:
    """The bytes each block of a BERT encoder holds alive in inference, against a fixed device memory.

    Args:
        config: the encoder's configuration.
        budget_bytes: the device's memory (``None``: what a batch of 32 x 128 tokens needs).
    """

    def __init__(self, config: Any, budget_bytes: int | None = None) -> None:
        self.hidden, self.heads, self.inner = config.hidden_size, config.num_attention_heads, config.intermediate_size
        self.budget = self.peak(32, 128) if budget_bytes is None else budget_bytes
        self.shape: tuple[int, int] = (0, 0)

    def attach(self, model: torch.nn.Module, fail_at: str) -> None:
        """Checks the memory before each layer's attention and feed-forward block (forward pre-hooks:
        ``fail_at="allocation"``), or once the forward is done (``"end"``: the batch's peak, as for a model whose
        largest buffer comes last)."""
        if fail_at == "end":
            model.register_forward_hook(lambda _m, _a, _o: self.check(self.peak(*self.shape)))
            return
        for layer in model.encoder.layer:
            layer.attention.register_forward_pre_hook(lambda _m, _a: self.check(self.attention_bytes(*self.shape)))
            layer.intermediate.register_forward_pre_hook(lambda _m, _a: self.check(self.ffn_bytes(*self.shape)))

    def attention_bytes(self, n: int, length: int) -> int:
        """Input, Q, K, V (4 hidden states) and scores and probabilities (2 x heads x length^2), per example."""
        return n * FLOAT * (4 * length * self.hidden + 2 * self.heads * length * length)

    def ffn_bytes(self, n: int, length: int) -> int:
        """Input, attention output and the feed-forward activation."""
        return n * FLOAT * length * (2 * self.hidden + self.inner)

    def peak(self, n: int, length: int) -> int:
        return max(self.attention_bytes(n, length), self.ffn_bytes(n, length))

    def check(self, needed: int) -> None:
        if needed > self.budget:
            raise torch.OutOfMemoryError(
                f"simulated device: tried to allocate {needed / 2**20:.1f} MiB of {self.budget / 2**20:.1f} MiB "
                f"(batch of {self.shape[0]} x {self.shape[1]} tokens)"
            )

    def largest_fitting(self, length: int) -> int:
        """The most examples of ``length`` tokens a batch may hold."""
        return max(0, self.budget // max(1, self.peak(1, length)))

    def best_max_tokens(self, lengths: np.ndarray) -> int:
        """The largest ``max_tokens`` whose every batch fits: a batch of ``max_tokens // L`` examples of length
        ``L`` must fit for every length ``L`` of the data."""
        return min((self.largest_fitting(int(L)) + 1) * int(L) - 1 for L in np.unique(lengths))


class Tokenize:
    """``collate_fn``: the MiniLM tokenizer, padding to the batch's longest passage."""

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encoded = _STATE["tokenizer"](
            list(texts), padding=True, truncation=True, max_length=MINILM_MAX_LENGTH, return_tensors="pt"
        )
        return dict(encoded)


class Embedder(TorchBatchProcessor):
    """Embeds a batch on the simulated device; one row per passage."""

    stop_after: int | None = None
    """Sends itself SIGTERM after this many batches, once the job met an out-of-memory error (the ``resume``
    contender's first call)."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.model = _STATE["model"]
        self.device: SimulatedDevice | None = _STATE["device"]
        self.calls = 0

    def process_batch(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        batch = self.context.to_device(batch)
        if self.device is not None:
            self.device.shape = tuple(batch["input_ids"].shape)  # type: ignore[assignment]
        try:
            hidden = self.model(**batch).last_hidden_state
        except torch.OutOfMemoryError:
            _STATE["ooms"] += 1
            raise
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), p=2, dim=1)
        self.context.write({"embedding": pooled.cpu()})
        self.calls += 1
        stop_after = type(self).stop_after
        if stop_after is not None and self.calls >= stop_after and _STATE["ooms"] > _STATE["job_ooms_from"]:
            type(self).stop_after = None  # once
            os.kill(os.getpid(), signal.SIGTERM)


# ------------------------------------------------------------------------------------------ runs


def run(texts: list[str], lengths: np.ndarray, storage: Path, batch_size: int, **options: Any) -> dict[str, Any]:
    """One job; its throughput and out-of-memory errors."""
    before = _STATE["job_ooms_from"] = _STATE["ooms"]
    t0, c0 = time.perf_counter(), time.process_time()
    result = torch_batch_process(
        Embedder, texts, batch_size=batch_size, bucket_by=lengths, dataloader_kwargs={"collate_fn": Tokenize()},
        storage_path=str(storage), checkpoint_interval=20, progress=False, tensorboard=False, **options,
    )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "result": result, "examples": result.examples_processed, "wall": wall, "cpu": cpu,
        "ooms": _STATE["ooms"] - before,
    }


def contenders(best: int) -> dict[str, Callable[[list[str], np.ndarray, Path, int], dict[str, Any]]]:
    def by_hand(texts: list[str], lengths: np.ndarray, storage: Path, batch_size: int) -> dict[str, Any]:
        return run(texts, lengths, storage, batch_size, max_tokens=best)

    def auto(texts: list[str], lengths: np.ndarray, storage: Path, batch_size: int) -> dict[str, Any]:
        return run(texts, lengths, storage, batch_size, max_tokens="auto")

    def no_learning(texts: list[str], lengths: np.ndarray, storage: Path, batch_size: int) -> dict[str, Any]:
        return run(texts, lengths, storage, batch_size, on_error="skip", on_oom="raise")

    return {"by hand": by_hand, "auto": auto, "no learning": no_learning}


def resume_after_learning(texts: list[str], lengths: np.ndarray, storage: Path, batch_size: int) -> dict[str, Any]:
    """``auto`` stopped after a tenth of its batches, then resumed; the resumed call's figures."""
    from torch_batch_process.engine.plan.bucketing import bucket_layout

    batches = bucket_layout(lengths, batch_size, 100, None).num_batches()
    Embedder.stop_after = max(2, batches // 10)
    try:
        first = run(texts, lengths, storage, batch_size, max_tokens="auto")
    finally:
        Embedder.stop_after = None
    if not first["result"].preempted:  # it met no out-of-memory error: nothing learned, nothing to resume
        return {**first, "ooms": None, "first_ooms": first["ooms"], "left_allocated": None}
    left = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
    second = run(texts, lengths, storage, batch_size, max_tokens="auto")
    second["first_ooms"] = first["ooms"]
    second["left_allocated"] = left
    return second


def best_by_search(texts: list[str], lengths: np.ndarray, scratch: Path, batch_size: int) -> int:
    """The largest ``max_tokens`` whose batches fit: a binary search over short jobs (the plan's largest batches,
    its first ones, with ``on_oom="raise"``), then whole jobs, 2% lower each time one runs out of memory."""

    def fits(max_tokens: int, **options: Any) -> bool:
        try:
            run(texts, lengths, scratch / f"search-{max_tokens}-{len(options)}", batch_size, max_tokens=max_tokens,
                on_oom="raise", **options)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            gc.collect()  # the run's model and batches (an exception's frames hold them) leave the capped memory
            torch.cuda.empty_cache()

    low, high = 128, batch_size * int(lengths.max()) + 1  # fits / does not fit
    while high - low > max(16, low // 64):
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle, max_batches=4) else (low, middle)
    while not fits(low):
        low = int(low * 0.98)
        if low < 16:
            raise SystemExit(
                "no max_tokens >= 16 fits the device memory given: raise --gpu-memory-mib (the model, its "
                "workspace and the CUDA libraries' own buffers count against it)"
            )
    return low


def _ooms(figure: dict[str, Any]) -> str:
    """A run's out-of-memory errors; the resume's when its first call met none (so it was not stopped)."""
    return "first met none" if figure["ooms"] is None else str(figure["ooms"])


def check_outputs(storages: dict[str, Path], n: int) -> None:
    """Every contender wrote one embedding per passage, the same ones (up to float rounding of other batch
    shapes)."""
    tables = {name: read_outputs(str(path)) for name, path in storages.items()}
    reference = None
    for name, table in tables.items():
        assert table.column("index").to_pylist() == list(range(n)), name
        values = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
        if reference is None:
            reference = values
        assert np.allclose(values, reference, atol=1e-4), f"{name}: embeddings differ"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--model", choices=("shaped", "minilm"), default="shaped")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--contenders", type=lambda text: [name.strip() for name in text.split(",")],
        default=["by hand", "auto", "no learning", "resume"], help="comma-separated; auto is required",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--verbose", action="store_true", help="show the library's warnings (one per OOM)")
    parser.add_argument("--gpu-memory-mib", type=int, default=1024, help="with --device cuda: this process's cap")
    parser.add_argument(
        "--fail-at", choices=("allocation", "end"), default="allocation",
        help="where a batch that does not fit fails: at the block whose allocation exceeds the device (default), "
        "or after the whole forward (a model whose largest allocation comes last)",
    )
    args = parser.parse_args(argv)
    configure_process(args.threads)
    # the library logs no INFO or WARNING lines (one per OOM otherwise) unless asked
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR)
    from transformers import AutoTokenizer

    from torch_batch_process.lengths import tokenized_lengths

    _STATE["tokenizer"] = tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    texts = passages(args.examples)
    lengths = tokenized_lengths(texts, tokenizer, max_length=MINILM_MAX_LENGTH)
    _STATE["model"] = model = build_model(args.model)
    _STATE["ooms"] = 0
    scratch_root = tempfile.TemporaryDirectory(prefix="tbp-oom-")
    if args.device == "cuda":
        model.to("cuda")
        model_mib = torch.cuda.memory_allocated() / 2**20
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_mib * 2**20 / total), 0)
        _STATE["device"] = None
        best = best_by_search(texts, lengths, Path(scratch_root.name), args.batch_size)
        where = f"{torch.cuda.get_device_name(0)}, capped at {args.gpu_memory_mib} MiB: real out-of-memory errors"
    else:
        _STATE["device"] = device = SimulatedDevice(model.config)
        device.attach(model, args.fail_at)
        best = device.best_max_tokens(lengths)
        where = (
            f"simulated device of {device.budget / 2**20:.1f} MiB (32 x 128 tokens); a batch that does not fit fails "
            f"at {'the allocation' if args.fail_at == 'allocation' else 'the end of its forward'}"
        )
    print(
        f"{args.examples} passages, {int(lengths.sum()):,} tokens (lengths {lengths.min()}-{lengths.max()}, median "
        f"{int(np.median(lengths))}), batch_size {args.batch_size}, model {args.model}, {args.threads} thread(s); "
        f"{where}; best max_tokens by hand: {best:,}"
    )
    runners = {name: job for name, job in contenders(best).items() if name in args.contenders}
    names = list(runners) + (["resume"] if "resume" in args.contenders else [])
    assert "auto" in runners, "--contenders must include auto"
    others = [name for name in ("by hand", "no learning") if name in runners]
    figures: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    header = f"{'round':>5} " + " ".join(f"{name + ' ex/cpu-s (wall)':>30}" for name in runners)
    header += "".join(f" {'auto/' + name:>16}" for name in others) + "".join(f" {'OOMs ' + n:>16}" for n in names)
    print(header)
    with scratch_root as scratch:
        run(texts[:300], lengths[:300], Path(scratch, "warmup"), args.batch_size, max_tokens=best)
        for index in range(args.rounds):
            order = names[index % len(names) :] + names[: index % len(names)]
            storages = {}
            for name in order:
                storages[name] = Path(scratch, f"r{index}-{name.replace(' ', '_')}")
                runner = runners.get(name, resume_after_learning)
                figures[name].append(runner(texts, lengths, storages[name], args.batch_size))
            check_outputs(storages, args.examples)
            speed = {name: figures[name][-1]["examples"] / figures[name][-1]["cpu"] for name in runners}
            wall = {name: figures[name][-1]["examples"] / figures[name][-1]["wall"] for name in runners}
            print(
                f"{index:>5} " + " ".join(f"{f'{speed[name]:.1f} ({wall[name]:.1f})':>30}" for name in runners)
                + "".join(f" {speed['auto'] / speed[name]:>16.3f}" for name in others)
                + "".join(f" {_ooms(figures[name][-1]):>16}" for name in names)
            )
    assert all(f["ooms"] == 0 for f in figures.get("by hand", [])), "the best max_tokens by hand ran out of memory"

    def ratios(a: str, b: str, key: str) -> list[float]:
        pairs = zip(figures[a], figures[b], strict=True)
        return [(x["examples"] / x[key]) / (y["examples"] / y[key]) for x, y in pairs]

    print()
    print("| figure | median of the rounds [min-max] | goal |")
    print("|---|---|---|")
    for name, goal in (("by hand", ">= 0.95"), ("no learning", ">= 1.5")):
        if name not in runners:
            continue
        for key, what in (("cpu", "CPU time"), ("wall", "wall time")):
            values = ratios("auto", name, key)
            print(
                f"| auto / {name}, {what} | {statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}] "
                f"| {goal if key == 'cpu' else ''} |"
            )
    auto = figures["auto"][-1]["result"]
    learned = auto.memory_limits or {}
    for name in names:
        goal = {"auto": "a handful", "resume": "0"}.get(name, "")
        label = "the resumed call, after learning" if name == "resume" else name
        print(f"| out-of-memory errors per job, {label} | [{', '.join(_ooms(f) for f in figures[name])}] | {goal} |")
    if "resume" in figures:
        first = [f["first_ooms"] for f in figures["resume"]]
        print(f"| out-of-memory errors of the resume's first call (what it learned from) | {first} | |")
    if "resume" in figures and args.device == "cuda":
        left = [f["left_allocated"] / 2**20 for f in figures["resume"] if f["left_allocated"] is not None]
        print(
            f"| device memory allocated when the resumed call starts (MiB; the model: {model_mib:.1f}) "
            f"| [{', '.join(f'{mib:.1f}' for mib in left)}] | |"
        )
    print(f"| batches run in parts, auto (per job) | {auto.split_batches} of {auto.num_batches} | |")
    print(f"| learned by auto | {learned.get('text', 'nothing')} | |")
    print(f"| learned max_tokens (auto) / best by hand | {learned.get('budget', math.nan)} / {best} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
