"""How the members of a replica get the same batch (DESIGN §18): each loads it, or the first loads and broadcasts.

    python -m benchmarks.mesh_feed                  # one replica of 2 ranks, 3 rounds
    python -m benchmarks.mesh_feed --members 4      # one replica of 4

Every rank of a replica must run the same batch. Three ways, each timed over the same batches on one replica (one
torchrun of ``--members`` processes, gloo on CPU):

- ``each loads``: every member runs the dataset's ``__getitem__`` and the ``collate_fn`` itself (no communication;
  the same batch only if loading is deterministic);
- ``broadcast``: the first member loads, ``engine.mesh.broadcast.broadcast_batch`` sends it (the structure pickled
  with tensor slots, then the tensors' bytes in one buffer: three collectives) over the replica's gloo group;
- ``broadcast_object_list``: the first member loads, torch's ``broadcast_object_list`` pickles the whole batch.

Batches (64 examples each):

- ``images``: 3x224x224 ``uint8`` images (copies of seeded random images: decoder-sized data, cheap to make), 9.6 MB;
- ``small tensors``: 3x32x32 float images drawn per example from a seeded generator (``benchmarks.workloads``), 0.8 MB;
- ``tokenized text``: docstring sentences tokenized by MiniLM's tokenizer in the ``collate_fn`` (padded, at most 128
  tokens), about 0.1 MB.

Figures per batch, each round the mean over ``--batches`` batches (the ways in rotated order), shown as median
[min-max] over rounds: *wall*, from a barrier until the last member holds the batch; *CPU*, the CPU time of every
member summed (what loading costs the machine). Loading here runs in the main process (no ``DataLoader`` workers),
so *wall* is the critical path a step waits for when nothing prefetches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.launch import REPO, worker_env
from benchmarks.report import fmt_spread, machine, machine_line, new_results_dir, save_json

WAYS = ("each loads", "broadcast", "broadcast_object_list")
CASES = ("images", "small tensors", "tokenized text")
BATCH = 64


def loader(case: str) -> Callable[[int], Any]:
    """``load(g)``: batch ``g`` of ``case``, collated."""
    import torch
    from torch.utils.data import default_collate

    if case == "images":
        pool = torch.randint(0, 256, (16, 3, 224, 224), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
        return lambda g: default_collate([(pool[i % 16].clone(), i) for i in range(g * BATCH, (g + 1) * BATCH)])
    if case == "small tensors":
        from benchmarks.workloads import RandomImages

        images = RandomImages(10**6)
        return lambda g: default_collate([images[i] for i in range(g * BATCH, (g + 1) * BATCH)])
    from benchmarks.workloads import Tokenize, load_sentences

    sentences, tokenize = load_sentences(4096), Tokenize()
    return lambda g: tokenize([sentences[i % 4096] for i in range(g * BATCH, (g + 1) * BATCH)])


def worker(args: argparse.Namespace) -> None:
    """One torchrun process: every way over every case, rounds rotated; rank 0 prints the figures as JSON."""
    import torch
    import torch.distributed as dist

    from torch_batch_process.engine.mesh.broadcast import broadcast_batch

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")  # the replica's group (the whole world is one replica here)

    def get(way: str, load: Callable[[int], Any], g: int) -> Any:
        if way == "each loads":
            return load(g)
        if way == "broadcast":
            return broadcast_batch(load(g) if rank == 0 else None, group, 0)
        box = [load(g) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    figures: dict[str, dict[str, list[dict[str, float]]]] = {}
    loads = {case: loader(case) for case in CASES}
    for case in CASES:
        get("broadcast", loads[case], 0)  # warm-up: connections, the tokenizer's first call
    for round_index in range(args.rounds):
        ways = WAYS[round_index % len(WAYS):] + WAYS[: round_index % len(WAYS)]
        for case in CASES:
            for way in ways:
                wall = cpu = 0.0
                for b in range(args.batches):
                    g = 1 + round_index * args.batches + b
                    dist.barrier(group)
                    t0, c0 = time.perf_counter(), time.process_time()
                    batch = get(way, loads[case], g)
                    spent = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
                    dist.all_reduce(spent[:1], op=dist.ReduceOp.MAX, group=group)
                    dist.all_reduce(spent[1:], op=dist.ReduceOp.SUM, group=group)
                    wall, cpu = wall + spent[0].item(), cpu + spent[1].item()
                    del batch
                entry = {"wall_ms": 1000 * wall / args.batches, "cpu_ms": 1000 * cpu / args.batches}
                figures.setdefault(case, {}).setdefault(way, []).append(entry)
    sizes = {case: _nbytes(loads[case](0)) for case in CASES}
    if rank == 0:
        print("FIGURES " + json.dumps({"figures": figures, "bytes": sizes}), flush=True)
    dist.destroy_process_group()


def _nbytes(batch: Any) -> int:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict) or hasattr(batch, "values"):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_nbytes(v) for v in batch)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=2, help="ranks of the replica")
    parser.add_argument("--batches", type=int, default=10, help="batches per way, case and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results_dir = new_results_dir(f"mesh-feed-k{args.members}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.members}",
               "-m", "benchmarks.mesh_feed", "--worker", "--batches", str(args.batches), "--rounds", str(args.rounds)]
    done = subprocess.run(command, cwd=str(REPO), env=worker_env(), capture_output=True, text=True, timeout=1800)
    (results_dir / "worker.log").write_text(done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
    if done.returncode != 0 or not lines:
        print(f"the workers failed (exit code {done.returncode}); see {results_dir / 'worker.log'}", file=sys.stderr)
        return 1
    data = json.loads(lines[-1].removeprefix("FIGURES "))
    info = machine()
    print(f"one replica of {args.members} ranks (gloo, CPU); {args.batches} batches of {BATCH} per way, case and "
          f"round; {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print(machine_line(info))
    print("| batch | bytes | way | wall per batch (ms) | CPU per batch, all members (ms) |")
    print("|---|---|---|---|---|")
    for case in CASES:
        for way in WAYS:
            rows = data["figures"][case][way]
            print(f"| {case} | {data['bytes'][case] / 1e6:.2f} MB | {way} | "
                  f"{fmt_spread([r['wall_ms'] for r in rows], 1)} | {fmt_spread([r['cpu_ms'] for r in rows], 1)} |")
    save_json(results_dir / "results.json", {"machine": info, "args": vars(args), **data})
    print(f"\nresults: {results_dir.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
