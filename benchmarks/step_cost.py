"""The CPU one step costs a rank of a 2-process job: the hand loop, each schedule, and the collective alone.

    python -m benchmarks.step_cost                   # 4,000 batches on 2 ranks, 3 rounds
    python -m benchmarks.step_cost --batches 8000 --rounds 5

Trivial batches (the same prebuilt tensor, an identity ``collate_fn``, a ``process_batch`` that does nothing and
writes nothing), so what is left is the loop around them: for the hand loop, its DataLoader; for the library, its
loop plus what each schedule adds per step (``static``: the ranks' agreement, an asynchronous MAX ``all_reduce``
of three integers every ~50 ms or every step (``*_every_step``: ``TBP_AGREEMENT_S=0``, as before issue 45), and a
commit's votes every ``checkpoint_interval`` steps; ``dynamic``: one claim from the
rendezvous store's counter per batch, and the rank's own commits). The variant ``collective`` runs the static
agreement's ``all_reduce`` alone, posted and waited the way the agreement does, in plain ``torch.distributed``.

Each rank records its process CPU time (all threads) at its first and last batch; the figure is the CPU per step
between them (start and end left out), averaged over the 2 ranks, min and median over the rounds (CPU time
drifts less than the wall clock on a shared machine). The CPU of the call outside those steps (process group,
the job's opening, the closing commit and the end; the hand loop's process group and barrier) is the second
figure, summed over the ranks. Every variant runs under torchrun, gloo, 1 thread per
process, interleaved round by round. Storage is a temporary folder on ``/dev/shm`` when there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.batch_cost import BATCH, SameBatch, identity
from benchmarks.launch import run_logged
from benchmarks.report import emit_figures, machine, machine_line, median_spread, new_results_dir, save_json
from torch_batch_process.engine.schedule.agreement import AGREEMENT_ENV

VARIANTS: dict[str, str] = {
    "hand": "hand loop (no collective until the final barrier)",
    "collective": "the static agreement's all_reduce alone (plain torch.distributed)",
    "static": "library, static, a commit every 5 steps (the defaults: an agreement every ~50 ms and at commits)",
    "static_every_step": "library, static, a commit every 5 steps, an agreement every step (TBP_AGREEMENT_S=0)",
    "static_no_commit": "library, static, no commit until the end",
    "static_no_commit_every_step": "library, static, no commit until the end, an agreement every step",
    "dynamic": "library, dynamic, a commit every 5 of the rank's batches",
    "dynamic_no_commit": "library, dynamic, no commit until the end",
}
NPROC = 2


class _Clock:
    """This process's CPU time at its first and last step."""

    first: float | None = None
    last: float = 0.0
    steps = 0

    @classmethod
    def tick(cls) -> None:
        now = time.process_time()
        if cls.first is None:
            cls.first = now
        cls.last = now
        cls.steps += 1


def _processor() -> type:
    from torch_batch_process import TorchBatchProcessor

    class Nothing(TorchBatchProcessor):
        def __init__(self, context: Any) -> None:
            self.context = context

        def process_batch(self, batch: Any, batch_idx: int) -> None:
            _Clock.tick()

    return Nothing


def _rank_main(variant: str, batches: int, storage: str) -> dict[str, Any]:
    """One rank of one variant; returns its CPU per step."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dataset = SameBatch(batches)
    from torch_batch_process import torch_batch_process  # imported before the clock, as the job clock of benchmarks.run

    processor = _processor()
    started = time.process_time()
    if variant in ("hand", "collective"):
        dist.init_process_group("gloo")
        if variant == "hand":
            size = len(BATCH)
            sampler = [list(range(g * size, (g + 1) * size)) for g in range(rank, batches, world)]
            with torch.inference_mode():
                for _ in DataLoader(dataset, batch_sampler=sampler, collate_fn=identity):
                    _Clock.tick()
        else:
            pending = None
            for _ in range(batches // world):
                _Clock.tick()
                if pending is not None:
                    pending.wait()
                pending = dist.all_reduce(torch.tensor([0, 0], dtype=torch.int64), op=dist.ReduceOp.MAX, async_op=True)
            pending.wait()
        dist.barrier()
        dist.destroy_process_group()
    else:
        schedule = variant.split("_")[0]
        interval = batches + 1 if "no_commit" in variant else 5
        if variant.endswith("every_step"):  # the static agreement at every step boundary (before issue 45)
            os.environ[AGREEMENT_ENV] = "0"
        torch_batch_process(
            processor, dataset, batch_size=len(BATCH), storage_path=storage, checkpoint_interval=interval,
            progress=False, dataloader_kwargs={"collate_fn": identity}, schedule=schedule,
        )
    ended = time.process_time()
    assert _Clock.first is not None and _Clock.steps > 1
    steady = _Clock.last - _Clock.first
    return {
        "rank": rank, "steps": _Clock.steps, "cpu_us_per_step": steady / (_Clock.steps - 1) * 1e6,
        "cpu_s_outside_steps": ended - started - steady,
    }


def _run_variant(variant: str, batches: int, scratch: Path, log: Path) -> list[dict[str, Any]]:
    """Both ranks of ``variant`` under torchrun; their reports."""
    out = scratch / "reports"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(scratch / "job", ignore_errors=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
        "-m", "benchmarks.step_cost", "--rank-of", variant, "--batches", str(batches),
        "--storage", str(scratch / "job"), "--reports", str(out),
    ]
    code = run_logged(command, log, timeout_s=600)
    if code != 0:
        raise RuntimeError(f"{variant} failed ({'timeout' if code is None else f'exit code {code}'}); see {log}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=4000, help="global batches (each rank runs half)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--storage", help=argparse.SUPPRESS)
    parser.add_argument("--reports", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        report = _rank_main(args.rank_of, args.batches, args.storage)
        Path(args.reports).mkdir(parents=True, exist_ok=True)
        (Path(args.reports) / f"rank_{report['rank']}.json").write_text(json.dumps(report))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    out_dir = new_results_dir("step_cost")
    costs: dict[str, list[float]] = {v: [] for v in variants}
    fixed: dict[str, list[float]] = {v: [] for v in variants}
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tbp-step-cost-", dir=base) as scratch:
        for round_index in range(args.rounds):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                reports = _run_variant(variant, args.batches, Path(scratch), out_dir / f"r{round_index}-{variant}.log")
                cost = statistics.fmean(r["cpu_us_per_step"] for r in reports)
                costs[variant].append(cost)
                fixed[variant].append(sum(r["cpu_s_outside_steps"] for r in reports))
                print(
                    f"[round {round_index}] {variant}: {cost:.0f} us CPU per step per rank, "
                    f"{fixed[variant][-1]:.3f} s outside the steps", flush=True,
                )
    info = machine()
    save_json(
        out_dir / "results.json",
        {"machine": info, "batches": args.batches, "cpu_us_per_step": costs, "cpu_s_outside_steps": fixed},
    )
    hand = min(costs["hand"]) if "hand" in costs else None
    print(
        "\n| Variant | CPU us per step per rank (min) | median | over the hand loop (min) "
        "| CPU s outside the steps, both ranks (median) |"
    )
    print("|---|---:|---:|---:|---:|")
    for variant in variants:
        values = sorted(costs[variant])
        extra = f"+{values[0] - hand:.0f}" if hand is not None and variant != "hand" else "–"
        print(
            f"| {VARIANTS[variant]} | {values[0]:.0f} | {statistics.median(values):.0f} | {extra} "
            f"| {statistics.median(fixed[variant]):.3f} |"
        )
    print(f"\n{args.batches:,} batches on {NPROC} ranks, {args.rounds} rounds. Machine: {machine_line(info)}.")
    emit_figures({f"step_cost.{variant}.cpu_us": list(median_spread(costs[variant])) for variant in variants})
    print(f"results: {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
