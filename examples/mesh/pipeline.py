"""One transformer cut into two pipeline stages with microbatches, two replicas of it over four ranks (DESIGN §18).

    torchrun --standalone --nproc-per-node 4 examples/mesh/pipeline.py      # 2 replicas x 2 stages, gloo on CPU
    torchrun --standalone --nproc-per-node 2 examples/mesh/pipeline.py      # 1 replica x 2 stages

``mesh={"replica": -1, "pp": 2}``: the ranks form replicas of 2 stages. Each rank builds its stage of the encoder and
runs it with torch's ``torch.distributed.pipelining`` (``PipelineStage`` over ``context.mesh["pp"]``'s group,
``ScheduleGPipe`` with 4 microbatches; ``encoder.Pipeline`` keeps one schedule per batch shape, since a schedule
learns its shapes at its first step). Every stage gets the same batch from the library (the first stage reads the
tokens; the last uses the batch's size); the last stage holds the embeddings and is the replica's writer
(``context.is_writer``): its rows are the outputs, once per example.

Then the embeddings are read back in dataset order and compared with the whole encoder run on one process.
``hand_loop.py --mode pp`` is the same work written by hand.
"""

from __future__ import annotations

import argparse
import os

from encoder import EncoderConfig, Pipeline, TokenDataset, build_encoder, compare_with_whole

from torch_batch_process import TorchBatchProcessor, read_outputs, torch_batch_process

CONFIG = EncoderConfig()


class PipelinedEncoder(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.pipeline = Pipeline(build_encoder(CONFIG), context.mesh["pp"].get_group(), context.device, microbatches=4)

    def process_batch(self, batch, batch_idx):
        embeddings = self.pipeline(self.context.to_device(batch))  # None on every stage but the last
        if self.context.is_writer:
            self.context.write({"embedding": embeddings})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--storage", default="tbp_runs/mesh_pipeline")
    args = parser.parse_args()
    dataset = TokenDataset(args.examples, CONFIG)
    result = torch_batch_process(
        PipelinedEncoder,
        dataset,
        batch_size=args.batch_size,
        mesh={"replica": -1, "pp": args.stages},
        storage_path=args.storage,
    )
    if not result.preempted and os.environ.get("RANK", "0") == "0":
        compare_with_whole(read_outputs(args.storage), dataset, CONFIG)


if __name__ == "__main__":
    main()
