"""The probes behind notes/43-mesh.md (torch 2.14.1, gloo, CPU): each prints what it found on rank 0 (or the ranks
named). Run one with

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 notes/43-mesh-probes.py <probe>

Probes: ``collectives`` (which collectives gloo runs on a mesh's groups, next to a control group), ``inference_mode``
(DTensor's collectives per forward of the examples' tensor-parallel encoder, under ``no_grad`` and
``inference_mode``), ``pipeline_shapes`` (one ``ScheduleGPipe`` fed batches of another size; uneven microbatches),
``release`` (whether a member that raised can free a peer blocked in a collective of the mesh's group: ``abort``,
``shutdown``, ``destroy_process_group``; and a peer's exit).
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "mesh"))

from encoder import TokenDataset, build_encoder, pipeline_stage, tensor_parallel_plan  # noqa: E402


def say(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def collectives():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "tp"))
    control = dist.new_group(backend="gloo")
    tp = mesh["tp"].get_group()
    x = torch.ones(4) * (dist.get_rank() + 1)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x.clone(), group=tp),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(8), x.clone(), group=tp),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(2), x.clone(), group=tp),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4), x.clone(), group=tp),
        "broadcast": lambda: dist.broadcast(x.clone(), group_src=0, group=tp),
        "control all_reduce": lambda: dist.all_reduce(x.clone(), group=control),
    }
    for name, call in calls.items():
        try:
            call()
            say(name, "works")
        except Exception as exc:  # noqa: BLE001
            say(name, "FAILS:", str(exc).splitlines()[0][:160])


def inference_mode():
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = parallelize_module(build_encoder(), mesh, tensor_parallel_plan())
    tokens = torch.stack([TokenDataset(8)[i] for i in range(8)])
    for mode in (torch.no_grad, torch.inference_mode):
        counter = CommDebugMode()
        with mode(), counter:
            out = model(tokens)
        with torch.no_grad():
            diff = (out - build_encoder()(tokens)).abs().max().item()
        say(mode.__name__, dict(counter.get_comm_counts()), f"max diff {diff:.1e}")


def pipeline_shapes():
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "pp"))
    pp = mesh["pp"]
    stage = pp.get_local_rank()
    whole = build_encoder()
    module = pipeline_stage(build_encoder(), stage, 2)
    schedule = ScheduleGPipe(PipelineStage(module, stage, 2, torch.device("cpu"), group=pp.get_group()), 4)
    for size in (8, 6, 8):  # one schedule, two batch sizes
        tokens = torch.stack([TokenDataset(8)[i] for i in range(size)])
        try:
            with torch.no_grad():
                out = schedule.eval(tokens) if stage == 0 else schedule.eval()
            if stage == 1 and dist.get_rank() == 1:
                print(
                    "one schedule, batch",
                    size,
                    "->",
                    tuple(out.shape),
                    "max diff",
                    (out - whole(tokens)).abs().max().item(),
                    flush=True,
                )
        except Exception as exc:  # noqa: BLE001
            if dist.get_rank() == 1:
                print("one schedule, batch", size, "FAILS:", str(exc).splitlines()[0][:120], flush=True)
    uneven = ScheduleGPipe(PipelineStage(module, stage, 2, torch.device("cpu"), group=pp.get_group()), 4)
    tokens = torch.stack([TokenDataset(8)[i] for i in range(6)])  # 6 examples in 4 microbatches
    with torch.no_grad():
        out = uneven.eval(tokens) if stage == 0 else uneven.eval()
    if dist.get_rank() == 1:
        print("fresh schedule, 6 examples in 4 microbatches ->", tuple(out.shape), flush=True)


def release():
    how = os.environ.get("HOW", "abort")  # abort | shutdown | destroy | exit
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "tp"))
    tp = mesh["tp"].get_group()
    start = time.perf_counter()
    if dist.get_rank() == 0:  # "raised" before its collective, then tries to free its peer
        time.sleep(1)
        if how == "abort":
            tp.abort()
        elif how == "shutdown":
            tp.shutdown()
        elif how == "destroy":
            dist.destroy_process_group(tp)
        elif how == "exit":
            os._exit(1)
        time.sleep(8)  # alive, as a rank that raised and waits in the library's failure path
    elif dist.get_rank() == 1:
        try:
            dist.all_reduce(torch.ones(4), group=tp)
        except Exception as exc:  # noqa: BLE001
            print(
                f"{how}: rank 1's collective raised after {time.perf_counter() - start:.1f}s:",
                str(exc).splitlines()[0][:90],
                flush=True,
            )
    os._exit(0)


dist.init_process_group("gloo")
{"collectives": collectives, "inference_mode": inference_mode, "pipeline_shapes": pipeline_shapes, "release": release}[
    sys.argv[1]
]()
dist.destroy_process_group()
