"""A generation job for the tests (issue 44): ``generation.Generate`` over a tiny random-weight Llama built from a
config with a fixed seed (no download), prompts of token ids made from the example's index.

The spec comes as JSON in argv[1]: ``storage``, ``n`` (prompts), ``batch_size``, ``schedule``, ``sampled`` (seeded
sampling, else greedy), ``max_in_flight``, ``drain_s``, ``max_new`` (longest answer), ``checkpoint_interval``,
``report_dir``, ``attempt``, ``progress`` (a file each rank appends one line to per delivered batch, for tests that
kill or stop it mid-job), ``too_long`` (indices whose prompt fills the context), ``on_error``,
``slow_s`` (seconds slept per delivered batch, so a test can catch it mid-job), ``oom_above`` (a simulated device:
a forward step of more tokens raises ``torch.OutOfMemoryError``), ``on_oom``.
"""

import faulthandler
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from torch_batch_process import generation, torch_batch_process

VOCAB, CONTEXT = 512, 96
BUDGET = generation.CacheBudget(max_sequences=8, batch_tokens=64, page_size=16)
SAMPLED = generation.Sampling(temperature=0.9, top_k=100, seed=7)


def tiny_llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval().to(device)


def on_small_device(build, tokens):
    """``build`` (device -> model) on a simulated device whose memory holds ``tokens`` tokens per forward step (more
    raise a real ``torch.OutOfMemoryError``, inside the engine's loop as on a GPU); ``seen``, if given, gets each
    step's tokens."""

    def build_small(device, seen=None):
        model = build(device)

        class OnSmallDevice(type(model)):
            def forward(self, input_ids=None, *args, **kwargs):
                n = int(input_ids.shape[-1])
                if seen is not None:
                    seen.append(n)
                if n > tokens:
                    raise torch.OutOfMemoryError(f"simulated device: {n} tokens in one step, {tokens} fit")
                return super().forward(input_ids, *args, **kwargs)

        model.__class__ = OnSmallDevice
        return model

    return build_small


class Prompts(torch.utils.data.Dataset):
    """Example i: 2-24 token ids and an answer of 1-``max_new`` tokens, both drawn from i; the indices in ``too_long``
    get a prompt of the model's whole context (it cannot be answered: a failing example)."""

    def __init__(self, n, max_new, too_long=()):
        self.n, self.max_new, self.too_long = n, max_new, set(too_long)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = random.Random(i)
        ids = [rng.randrange(1, VOCAB) for _ in range(CONTEXT if i in self.too_long else rng.randrange(2, 25))]
        return {"ids": ids, "max_new": rng.randrange(1, self.max_new + 1)}


def answered_at_once(n, max_new, sampling=None, skip=()):
    """The prompts of ``Prompts(n, max_new)`` but ``skip``, answered by one engine in one go in this process (no job,
    no limit on the device): what a job over them must write, however it was stopped, killed or short of memory."""
    prompts = Prompts(n, max_new)
    wanted = [i for i in range(n) if i not in skip]
    with generation.TransformersEngine(tiny_llama("cpu"), sampling=sampling, budget=BUDGET, eos_token_id=()) as engine:
        engine.submit(generation.Prompt(i, prompts[i]["ids"], prompts[i]["max_new"]) for i in wanted)
        done = {}
        deadline = time.monotonic() + 120
        while len(done) < len(wanted) and time.monotonic() < deadline:
            done.update((c.index, list(c.token_ids)) for c in engine.poll(timeout=1.0))
    assert len(done) == len(wanted), f"{len(wanted) - len(done)} prompts unanswered after 120 s"
    return done


def collate(rows):
    return rows  # a list of row dicts (token id lists of several lengths)


def main():
    from report_file import write_report

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = json.loads(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))
    report = {"rank": rank}
    model = on_small_device(tiny_llama, spec["oom_above"]) if spec.get("oom_above") else tiny_llama
    Gen = generation.Generate(
        model=model, prompt="ids", max_new_tokens="max_new", sampling=SAMPLED if spec.get("sampled") else None,
        eos_token_id=(), budget=BUDGET, columns=("token_ids", "finish_reason", "prompt_tokens", "completion_tokens"),
        max_in_flight=spec.get("max_in_flight"), drain_s=spec.get("drain_s"), model_id="tiny-llama-seed0",
    )
    progress, slow_s = spec.get("progress"), spec.get("slow_s", 0.0)
    if progress or slow_s:
        write = Gen._write

        def slow_write(self, completions):
            write(self, completions)
            if progress:
                with open(progress, "a") as f:
                    f.write(f"{rank}\n")
            time.sleep(slow_s)

        Gen._write = slow_write
    try:
        result = torch_batch_process(
            Gen, Prompts(spec["n"], spec.get("max_new", 24), spec.get("too_long", ())),
            batch_size=spec.get("batch_size", 8),
            storage_path=spec["storage"], schedule=spec.get("schedule", "static"),
            checkpoint_interval=spec.get("checkpoint_interval", 2), dataloader_kwargs={"collate_fn": collate},
            on_error=spec.get("on_error", "raise"), on_oom=spec.get("on_oom", "split"),
        )
        report["result"] = {
            "preempted": result.preempted, "processed": result.examples_processed, "ooms": result.ooms,
            "generation_budget": result.generation_budget,
        }
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    report_dir = Path(spec["report_dir"])
    report_dir.mkdir(parents=True, exist_ok=True)
    write_report(report_dir / f"attempt{spec.get('attempt', 1)}_rank{rank}.json", report)
    sys.exit(1 if "error" in report else 0)


if __name__ == "__main__":
    main()
