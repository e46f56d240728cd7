"""torch_batch_process with ``mesh=``: the mesh examples' encoder, tensor parallel or pipelined, one file per batch.

The same work as ``examples/mesh/hand_loop.py`` (the baseline of ``benchmarks/mesh.py``): the same model split the
same way, the same batches, the replica's writer saving each batch's ``{"index", "embedding"}`` with ``torch.save``
(here through ``upload_path()``, committed with the job's checkpoints). Written against the ``mesh=`` API of
DESIGN §18 (a mesh job runs ``process_batch`` under ``torch.no_grad()``, as the hand loop does). Arguments: those of
``hand_loop.py``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "mesh"))

from encoder import EncoderConfig, Pipeline, TokenDataset, build_encoder, tensor_parallel_plan  # noqa: E402
from hand_loop import parse_args  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

from torch_batch_process import TorchBatchProcessor, torch_batch_process  # noqa: E402

CONFIG = EncoderConfig()


class MeshEncoder(TorchBatchProcessor):
    mode = "tp"
    microbatches = 4
    first_batch: float | None = None
    last_batch: float | None = None
    first_cpu = last_cpu = 0.0
    batches = 0

    def __init__(self, context: Any) -> None:
        self.context = context
        if self.mode == "tp":
            model = build_encoder(CONFIG).to(context.device)
            self.model = parallelize_module(model, context.mesh["tp"], tensor_parallel_plan(CONFIG))
        else:
            group = context.mesh["pp"].get_group()
            self.model = Pipeline(build_encoder(CONFIG), group, context.device, self.microbatches)

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        embeddings = self.model(self.context.to_device(batch))
        if self.context.is_writer:
            with self.context.upload_path() as path:
                index = torch.tensor(list(self.context.batch_indices))
                torch.save({"index": index, "embedding": embeddings.cpu()}, Path(path) / f"batch_{batch_idx}.pt")
            MeshEncoder.batches += 1
        if MeshEncoder.first_batch is None:
            MeshEncoder.first_batch, MeshEncoder.first_cpu = time.time(), time.thread_time()
        MeshEncoder.last_batch, MeshEncoder.last_cpu = time.time(), time.thread_time()


def main() -> None:
    args = parse_args()
    start = time.time()
    MeshEncoder.mode, MeshEncoder.microbatches = args.mode, args.microbatches
    torch_batch_process(
        MeshEncoder,
        TokenDataset(args.examples, CONFIG),
        batch_size=args.batch_size,
        mesh={"replica": -1, args.mode: args.size},
        storage_path=str(args.out),
        progress=False,
    )
    end = time.time()
    if args.report is not None:
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        args.report.mkdir(parents=True, exist_ok=True)
        report = {
            "rank": rank,
            "world_size": world,
            "start": start,
            "first_batch": MeshEncoder.first_batch,
            "last_batch": MeshEncoder.last_batch,
            "steady_cpu": MeshEncoder.last_cpu - MeshEncoder.first_cpu,
            "end": end,
            "batches": MeshEncoder.batches,
        }
        (args.report / f"rank_{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
