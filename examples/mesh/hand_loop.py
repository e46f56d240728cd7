"""The mesh examples' model written by hand, without the library: the baseline of ``benchmarks/mesh.py`` and the
standalone check that tensor parallel and pipeline stages give the one-process outputs.

    torchrun --standalone --nproc-per-node 4 examples/mesh/hand_loop.py --mode tp --out /tmp/tp   # 2 replicas x 2
    torchrun --standalone --nproc-per-node 4 examples/mesh/hand_loop.py --mode pp --out /tmp/pp

What a user writes by hand: the mesh ``(replicas, 2)`` with ``init_device_mesh``, global batch ``g`` dealt to replica
``g % replicas``, every member of a replica loading the same batches itself (a ``DataLoader`` over the replica's
batches), and the replica's last member (the last pipeline stage) saving each batch's embeddings as
``<out>/batch_<g>.pt`` (``{"index": ..., "embedding": ...}``). No checkpoint, no resume: a failure loses the run.
``--report DIR`` writes each rank's timestamps (``rank_<r>.json``, the benchmarks' format).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from encoder import EncoderConfig, Pipeline, TokenDataset, build_encoder, tensor_parallel_plan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DataLoader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``benchmarks/contenders/tbp_mesh.py`` takes the same)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("tp", "pp"), required=True, help="tensor parallel or pipeline stages")
    parser.add_argument("--size", type=int, default=2, help="ranks of one replica")
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline only")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.time()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = world // args.size
    mesh = init_device_mesh(device.type, (replicas, args.size), mesh_dim_names=("replica", args.mode))
    replica = mesh.get_local_rank("replica")
    member = mesh.get_local_rank(args.mode)
    writer = member == args.size - 1

    cfg = EncoderConfig()
    if args.mode == "tp":
        model = parallelize_module(build_encoder(cfg).to(device), mesh["tp"], tensor_parallel_plan(cfg))
    else:
        model = Pipeline(build_encoder(cfg), mesh["pp"].get_group(), device, args.microbatches)

    dataset = TokenDataset(args.examples, cfg)
    batches = math.ceil(len(dataset) / args.batch_size)
    mine = [
        list(range(g * args.batch_size, min((g + 1) * args.batch_size, len(dataset))))
        for g in range(replica, batches, replicas)
    ]
    loader = DataLoader(dataset, batch_sampler=mine, pin_memory=cuda)
    args.out.mkdir(parents=True, exist_ok=True)
    first = last = first_cpu = last_cpu = None
    with torch.no_grad():  # not inference_mode: DTensor then gathers instead of all-reducing (see notes/43-mesh.md)
        for indices, tokens in zip(mine, loader, strict=True):
            embeddings = model(tokens.to(device, non_blocking=True))
            if writer:
                g = indices[0] // args.batch_size
                torch.save({"index": torch.tensor(indices), "embedding": embeddings.cpu()}, args.out / f"batch_{g}.pt")
            if first is None:
                first, first_cpu = time.time(), time.thread_time()
            last, last_cpu = time.time(), time.thread_time()
    end = time.time()
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        report = {
            "rank": rank,
            "world_size": world,
            "start": start,
            "first_batch": first,
            "last_batch": last,
            "steady_cpu": last_cpu - first_cpu if first_cpu is not None and last_cpu is not None else None,
            "end": end,
            "batches": len(mine) if writer else 0,
        }
        (args.report / f"rank_{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
