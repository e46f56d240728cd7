"""Determined-style client code whose rank 0 gathers every rank's outputs in ``on_finish`` (as Determined's embeddings
example does): each rank saves its buffered batches through ``upload_path()`` in ``on_checkpoint_start``; rank 0's
``on_finish`` lists ``<storage>/outputs`` and stores what it found as JSON at ``argv[2]``. Every rank's ``on_finish``
writes a file too; once the call returns, rank 0 lists those and stores their names as JSON at ``argv[3]``.

Rank 1 publishes its files a second late (a delay put in front of the library's own publication, nothing replaced),
so a rank 0 that does not wait for the others' publication finds their last files missing.
"""

import glob
import json
import os
import sys
import time

import torch

from torch_batch_process.pytorch import experimental


class Processor(experimental.TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.rank = context.get_distributed_rank()
        self.output = []

    def process_batch(self, batch, batch_idx):
        self.output.append(batch)

    def on_checkpoint_start(self):
        if self.output:
            with self.context.upload_path() as path:
                torch.save(torch.cat(self.output), path / f"embeddings_rank{self.rank}_{len(os.listdir(path))}.pt")
            self.output = []

    def on_finish(self):
        with self.context.upload_path() as path:
            (path / f"finished_rank{self.rank}.txt").write_text("done")
        if self.rank == 0:
            pattern = os.path.join(self.context.storage_path, "outputs", "**", "embeddings_*.pt")
            seen = sorted(int(i) for f in glob.glob(pattern, recursive=True) for i in torch.load(f))
            with open(sys.argv[2], "w") as report:
                json.dump(seen, report)


if __name__ == "__main__":
    if int(os.environ["RANK"]) == 1:
        from torch_batch_process.jobstore.store import JobStore

        publish = JobStore.publish

        def late_publish(self, *args, **kwargs):
            time.sleep(1.0)
            publish(self, *args, **kwargs)

        JobStore.publish = late_publish
    result = experimental.torch_batch_process(
        Processor, torch.arange(int(sys.argv[1])), batch_size=5, checkpoint_interval=3, storage_path="job"
    )
    if int(os.environ["RANK"]) == 0:
        finished = glob.glob(os.path.join(result.outputs_path, "**", "finished_rank*.txt"), recursive=True)
        with open(sys.argv[3], "w") as report:
            json.dump(sorted(os.path.basename(f) for f in finished), report)
