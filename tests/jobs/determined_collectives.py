"""Client code written for Determined that coordinates its ranks through ``context.distributed`` (Determined's
``core.DistributedContext``): every accessor and object collective, from the hooks Determined runs on every rank.

Only the import was changed (originally ``from determined.pytorch import experimental``). Each rank stores what it
saw as ``collectives_<rank>.json`` through ``upload_path()`` in ``on_finish``.
"""

import json
import pathlib
import sys

import torch

from torch_batch_process import experimental


class Processor(experimental.TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.distributed = context.distributed
        self.rank = self.distributed.get_rank()
        self.examples = 0
        self.checkpoint_counts = []

    def process_batch(self, batch, batch_idx):
        self.examples += len(batch)

    def on_checkpoint_start(self):
        self.checkpoint_counts.append(self.distributed.allgather(self.examples))

    def on_finish(self):
        d = self.distributed
        seen = {
            "ranks": [d.get_rank(), d.get_size(), d.get_local_rank(), d.get_local_size(), d.get_cross_rank(),
                      d.get_cross_size(), d.get_num_agents()],
            "allgather": d.allgather(self.rank * 10),
            "gather": d.gather(self.rank + 100),
            "broadcast": d.broadcast(f"from {self.rank}"),
            "allgather_local": d.allgather_local(self.rank),
            "gather_local": d.gather_local(self.rank),
            "broadcast_local": d.broadcast_local(f"local from {self.rank}"),
            "checkpoint_counts": self.checkpoint_counts,
        }
        d.close()
        with self.context.upload_path() as path:
            pathlib.Path(path, f"collectives_{self.rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    experimental.torch_batch_process(Processor, torch.arange(int(sys.argv[1])), batch_size=5, checkpoint_interval=2)
