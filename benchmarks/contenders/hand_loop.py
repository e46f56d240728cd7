"""The baseline: the loop an experienced user writes by hand.

One process: a DataLoader over the dataset, ``torch.inference_mode()``, one ``torch.save`` per batch.
Under torchrun: a gloo process group, global batch ``g`` on rank ``g % W`` (the same split as
torch_batch_process), a barrier at the end. No checkpoints, no resume, no exactly-once guarantee.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.common import Options, Reporter, env_rank, parse_options, save_tensor
from benchmarks.workloads import output_name


def run(opts: Options) -> dict[str, Any]:
    workload = opts.workload
    dataset = workload.dataset()
    reporter = Reporter(opts.report)

    rank, world_size = env_rank()
    if world_size > 1:
        dist.init_process_group("gloo")
    model = workload.build_model()
    size, n = workload.batch_size, workload.num_examples
    my_batches = list(range(rank, workload.num_batches, world_size))
    batch_indices = [list(range(g * size, min((g + 1) * size, n))) for g in my_batches]
    loader = DataLoader(dataset, batch_sampler=batch_indices, num_workers=opts.workers, collate_fn=workload.collate_fn())
    opts.out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for batch_idx, batch in zip(my_batches, loader):
            save_tensor(workload.predict(model, batch), opts.out / output_name(batch_idx))
            reporter.batch_done(workload.batch_examples(batch))
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return reporter.finish(rank, world_size)


if __name__ == "__main__":
    run(parse_options())
