"""One transformer over two ranks with tensor parallel, two replicas of it over four ranks (DESIGN §18).

    torchrun --standalone --nproc-per-node 4 examples/mesh/tensor_parallel.py      # 2 replicas x 2, gloo on CPU
    torchrun --standalone --nproc-per-node 2 examples/mesh/tensor_parallel.py      # 1 replica x 2
    torchrun --standalone --nproc-per-node 8 examples/mesh/tensor_parallel.py      # 4 replicas x 2 (8 GPUs: NCCL)

``mesh={"replica": -1, "tp": 2}``: the ranks form replicas of 2 (``-1``: as many replicas as the world size allows).
The library deals the batches over the replicas, gives every rank of a replica the same batch, and builds
``context.mesh``, a torch ``DeviceMesh`` with these dimension names, so the model is split with torch's own
``parallelize_module`` (``q``/``k``/``v``/``up`` column-wise, ``o``/``down`` row-wise, see ``encoder.py``). Every
rank of a replica computes the same embeddings; the rows of the replica's writer (``context.is_writer``, its last
rank) are the outputs, once per example whatever the number of replicas, and a job stopped on 2 replicas x 2 resumes
on 1 x 4 or 3 x 2.

Then the embeddings are read back in dataset order and compared with the whole encoder run on one process.
Interrupt it and run it again: it resumes. ``hand_loop.py --mode tp`` is the same work written by hand.
"""

from __future__ import annotations

import argparse
import os

from encoder import EncoderConfig, TokenDataset, build_encoder, compare_with_whole, tensor_parallel_plan
from torch.distributed.tensor.parallel import parallelize_module

from torch_batch_process import TorchBatchProcessor, read_outputs, torch_batch_process

CONFIG = EncoderConfig()


class TensorParallelEncoder(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        model = build_encoder(CONFIG).to(context.device)
        self.model = parallelize_module(model, context.mesh["tp"], tensor_parallel_plan(CONFIG))

    def process_batch(self, batch, batch_idx):
        embeddings = self.model(self.context.to_device(batch))  # the same on every rank of the replica
        # On the replica's other ranks, write() checks the rows and keeps none: the writer's are the outputs.
        self.context.write({"embedding": embeddings})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2, help="ranks of one replica")
    parser.add_argument("--storage", default="tbp_runs/mesh_tensor_parallel")
    args = parser.parse_args()
    dataset = TokenDataset(args.examples, CONFIG)
    result = torch_batch_process(
        TensorParallelEncoder,
        dataset,
        batch_size=args.batch_size,
        mesh={"replica": -1, "tp": args.tp},
        storage_path=args.storage,
    )
    if not result.preempted and os.environ.get("RANK", "0") == "0":
        compare_with_whole(read_outputs(args.storage), dataset, CONFIG)


if __name__ == "__main__":
    main()
