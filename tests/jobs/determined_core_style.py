"""Determined client code that builds its own distributed context and reports the model it uses.

Only the imports were changed (originally ``from determined import core`` and ``from determined.pytorch import
experimental``). Determined's ``core.DistributedContext.from_torch_distributed()`` and its model registry
objects are not available without Determined, so this script defines stand-ins with the same attributes.
"""

import os
import sys

import torch
import torch.distributed as dist

from torch_batch_process.pytorch import experimental


class DistributedContext:  # stand-in for determined.core.DistributedContext.from_torch_distributed()
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def get_rank(self):
        return self.rank

    def get_size(self):
        return self.size


class Checkpoint:  # stand-in for determined.experimental.checkpoint.Checkpoint
    uuid = "5d7e8c1a-0000-4000-8000-000000000001"


class ModelVersion:  # stand-in for determined.experimental.model.ModelVersion
    model_id = 12
    model_version = 3
    name = "digits-cnn"
    checkpoint = Checkpoint()


class Processor(experimental.TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        context.report_task_using_model_version(ModelVersion())
        context.report_task_using_checkpoint(Checkpoint())
        self.count = context.wrap_reducer(lambda values: sum(values), name="examples")

    def process_batch(self, batch, batch_idx):
        self.count.update(len(batch))


if __name__ == "__main__":
    dist.init_process_group("gloo")  # the user's own process group
    distributed = DistributedContext(dist.get_rank(), dist.get_world_size())
    experimental.torch_batch_process(
        Processor, torch.arange(100), batch_size=10, checkpoint_interval=2, distributed_context=distributed
    )
    assert dist.is_initialized(), "the user's process group is left alone"
    dist.destroy_process_group()
    print(f"rank {os.environ['RANK']} done", file=sys.stderr)
