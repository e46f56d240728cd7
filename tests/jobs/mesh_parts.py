"""The mesh's parts on real processes (tests/test_mesh_parts.py), run under torchrun with 4 ranks: 2 replicas x 2.

Over the library's own default and control groups (:class:`DistributedEnv`), for ``{"replica": -1, "tp": 2}`` and
``{"replica": -1, "pp": 2}``: :func:`build_job_mesh` (its coordinates and replica group against the layout's; built
once), the examples' encoder split by ``parallelize_module`` or ``torch.distributed.pipelining``, and batches dealt
over the replicas in lockstep steps as the static schedule deals them (a control-group ``all_gather`` per step, next to
the mesh's collectives), each loaded by the replica's first member and sent with :func:`broadcast_batch`. The
batches have two sizes (the last one is smaller). Each writer compares its embeddings with the whole encoder's on this
process. argv[1]: a folder for ``rank_<r>.json``.
"""

import datetime
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "mesh"))

from encoder import EncoderConfig, Pipeline, TokenDataset, build_encoder, tensor_parallel_plan  # noqa: E402

from torch_batch_process.engine.distributed import DistributedEnv  # noqa: E402
from torch_batch_process.engine.mesh.broadcast import broadcast_batch  # noqa: E402
from torch_batch_process.engine.mesh.groups import build_job_mesh  # noqa: E402
from torch_batch_process.mesh_shape import parse_mesh  # noqa: E402

EXAMPLES, BATCH = 40, 6
cfg = EncoderConfig(layers=2)
dataset = TokenDataset(EXAMPLES, cfg)
whole = build_encoder(cfg)


def load(g: int) -> dict:
    indices = list(range(g * BATCH, min((g + 1) * BATCH, EXAMPLES)))
    return {"tokens": torch.stack([dataset[i] for i in indices]), "indices": indices, "note": f"batch {g}"}


def run(spec: dict, env: DistributedEnv) -> dict:
    layout = parse_mesh(spec).resolve(env.info.size)
    mesh = build_job_mesh(layout, env.device, datetime.timedelta(seconds=60))
    assert build_job_mesh(layout, env.device, datetime.timedelta(seconds=60)) is mesh
    p = mesh.position
    assert tuple(mesh.device_mesh.get_coordinate()) == p.coordinate, (mesh.device_mesh.get_coordinate(), p)
    assert dist.get_process_group_ranks(mesh.replica_group) == list(layout.replica_ranks(p.replica_rank))
    dim = layout.names[1]
    if dim == "tp":
        model = parallelize_module(build_encoder(cfg), mesh.device_mesh["tp"], tensor_parallel_plan(cfg))
    else:
        model = Pipeline(build_encoder(cfg), mesh.device_mesh["pp"].get_group(), env.device, microbatches=4)
    batches = math.ceil(EXAMPLES / BATCH)
    written, max_diff, same_batch = [], 0.0, True
    for step in range(math.ceil(batches / layout.num_replicas)):
        g = step * layout.num_replicas + p.replica_rank
        if g < batches:
            batch = broadcast_batch(load(g) if p.is_source else None, mesh.replica_group, p.first_rank)
            own = load(g)
            same_batch &= torch.equal(batch["tokens"], own["tokens"]) and batch["indices"] == own["indices"]
            same_batch &= batch["note"] == own["note"]
            with torch.no_grad():
                out = model(batch["tokens"])
                if p.is_writer:
                    max_diff = max(max_diff, (out - whole(batch["tokens"])).abs().max().item())
                    written.append(g)
        steps = env.collectives.all_gather(step)  # the library's control group, between the mesh's collectives
        assert steps == [step] * env.info.size
    return {"written": written, "max_diff": max_diff, "same_batch": same_batch, "writer": p.is_writer}


with DistributedEnv() as env:
    result = {
        name: run(spec, env) for name, spec in (("tp", {"replica": -1, "tp": 2}), ("pp", {"replica": -1, "pp": 2}))
    }
Path(sys.argv[1], f"rank_{env.info.rank}.json").write_text(json.dumps(result))
