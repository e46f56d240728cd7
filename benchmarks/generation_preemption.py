"""What continuing partial answers saves (issue 44, item 8): a generation job preempted half way, resumed with the
stop's partial answers against resumed from the prompts alone.

    python -m benchmarks.generation_preemption                       # 500 prompts, stop at 50%, 3 rounds
    python -m benchmarks.generation_preemption --prompts 2000 --preempt-at 0.5 --drain-s 0

**Workload**: that of :mod:`benchmarks.generation` (stdlib docstrings, long-tailed answer lengths, EOS disabled, a
4-layer Llama of width 256 built from a config; greedy), through ``generation.Generate`` in this process (one
rank, batches of ``--batch-size``, up to 4 x ``--max-sequences`` prompts in flight).

**Each round**: the job runs until the batches it delivered hold ``--preempt-at`` of every answer token, then gets a
SIGTERM (a preemption with ``--drain-s`` seconds of grace: what finishes in time is committed, the answers still
being written are kept as partial answers). Its storage is then copied twice: one copy is resumed as it is (``with
partial answers``), the other with its latest commit record naming no partial answers (``from the prompts``: what
a resume did before item 8, and what every peer does). Both resumes start from the same commit; their order is
rotated every round.

Figures: the resume's job clock (the call, in this process), the answer tokens the resume generated (its answers'
tokens minus the tokens it continued from partial answers), the tokens it reused, and the same-round ratios;
median [min-max] over the rounds. The answers of both resumes must be equal (greedy; the table says how many are).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.generation import Workload, build_workload
from benchmarks.report import fmt_spread, machine, machine_line, rotated
from benchmarks.workloads import configure_process

CONTENDERS = ("with partial answers", "from the prompts")


def _stats(storage: Path) -> dict[str, Any]:
    """The latest commit record's ``stats``."""
    latest = max((storage / "_tbp" / "commits").glob("[0-9]*.json"))
    return dict(json.loads(latest.read_text())["stats"])


def run_job(work: Workload, storage: Path, stop_at_tokens: int | None, drain_s: float) -> float:
    """The job over ``work`` into ``storage``; SIGTERM once its delivered answers hold ``stop_at_tokens`` tokens
    (``None``: to the end). Returns its seconds."""
    from torch_batch_process import generation, torch_batch_process

    dataset = [{"ids": prompt, "max_new": work.max_new_tokens[i]} for i, prompt in enumerate(work.prompts)]
    processor = generation.Generate(
        model=work.model, prompt="ids", max_new_tokens="max_new", budget=work.budget, eos_token_id=(),
        columns=("token_ids",), model_id="benchmark-llama-4x256", drain_s=drain_s,
    )
    if stop_at_tokens is not None:
        write, delivered = processor._write, [0]  # type: ignore[attr-defined]

        def write_then_stop(self: Any, completions: Any) -> None:
            write(self, completions)
            before = delivered[0]
            delivered[0] += sum(c.completion_tokens for c in completions)
            if before < stop_at_tokens <= delivered[0]:
                os.kill(os.getpid(), signal.SIGTERM)

        processor._write = write_then_stop  # type: ignore[attr-defined]
    started = time.perf_counter()
    torch_batch_process(
        processor, dataset, batch_size=work.batch_size, storage_path=str(storage), checkpoint_interval=4,
        dataloader_kwargs={"collate_fn": list},
    )
    return time.perf_counter() - started


def answers_of(storage: Path) -> dict[int, list[int]]:
    from torch_batch_process import read_outputs

    table = read_outputs(str(storage)).to_pydict()
    return dict(zip(table["index"], table["token_ids"], strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preempt-at", type=float, default=0.5, help="share of the answer tokens delivered")
    parser.add_argument("--drain-s", type=float, default=0.0, help="the stop's grace (Generate(drain_s=...))")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-sequences", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=192)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if not 0 < args.preempt_at < 1:
        parser.error("--preempt-at must be in (0, 1)")
    configure_process(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("torch_batch_process").setLevel(logging.ERROR)
    work = build_workload(args.prompts, args.batch_size, args.max_prompt_tokens, args.max_sequences)
    total = work.answer_tokens
    print(machine_line(machine()))
    print(
        f"{args.prompts} prompts, {total:,} answer tokens; SIGTERM once {args.preempt_at:.0%} of them are delivered, "
        f"drain_s={args.drain_s:g}; one rank, batches of {args.batch_size}, {work.budget}; job clock"
    )
    seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    generated: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    reused: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    first: list[float] = []
    equal: list[int] = []
    heads = " ".join(f"{n + ' s / tokens':>34}" for n in CONTENDERS)
    print(f"{'round':>5} {'stopped after s':>16} {'kept':>6} {heads}")
    for index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="tbp-bench-preempt-") as root:
            stopped = Path(root, "stopped")
            first.append(run_job(work, stopped, round(args.preempt_at * total), args.drain_s))
            before = _stats(stopped)
            kept = list((stopped / "_tbp" / "partials").glob("*.json"))
            for name in CONTENDERS:
                shutil.copytree(stopped, Path(root, name))
                if name == "from the prompts":  # as before item 8: a record naming no partial answers
                    latest = max(Path(root, name, "_tbp", "commits").glob("[0-9]*.json"))
                    record = json.loads(latest.read_text())
                    record.pop("partial_answers", None)
                    latest.write_text(json.dumps(record))
            results = {}
            for name in rotated(list(CONTENDERS), index):
                storage = Path(root, name)
                seconds[name].append(run_job(work, storage, None, args.drain_s))
                after = _stats(storage)
                new = after["completion_tokens"] - before.get("completion_tokens", 0)
                again = after.get("reused_tokens", 0) - before.get("reused_tokens", 0)
                generated[name].append(new - again)
                reused[name].append(again)
                results[name] = answers_of(storage)
            a, b = (results[name] for name in CONTENDERS)
            assert sorted(a) == sorted(b) == list(range(args.prompts)), "answers missing or duplicated"
            equal.append(sum(a[i] == b[i] for i in a))
        print(
            f"{index:>5} {first[-1]:>16.1f} {len(kept):>6} "
            + " ".join(f"{f'{seconds[n][-1]:.1f} s / {generated[n][-1]:,.0f}':>34}" for n in CONTENDERS)
        )
    print()
    print("| resume after a stop at", f"{args.preempt_at:.0%}", "| job seconds | answer tokens generated | "
          "tokens continued from partial answers |")
    print("|---|---|---|---|")
    for name in CONTENDERS:
        print(f"| {name} | {fmt_spread(seconds[name], 1)} | {fmt_spread(generated[name], 0)} | "
              f"{fmt_spread(reused[name], 0)} |")
    with_, without = CONTENDERS
    print()
    print("| same round | median [min-max] |")
    print("|---|---|")
    time_ratio = [b / a for a, b in zip(seconds[with_], seconds[without], strict=True)]
    saved = [b - a for a, b in zip(generated[with_], generated[without], strict=True)]
    print(f"| resume seconds, from the prompts / with partial answers | {fmt_spread(time_ratio, 2)} |")
    print(f"| answer tokens not generated again (with partial answers) | {fmt_spread(saved, 0)} |")
    print(f"| answers equal between the two resumes | {min(equal)}/{args.prompts} (worst round) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
