"""Hugging Face accelerate: ``prepare`` + loop + ``gather_for_metrics``, as its distributed-inference docs show.

The predictions of every process are gathered (``gather_for_metrics`` drops the duplicates that
even batches add) and the main process writes one file per step. Two processes run under torchrun
(what ``accelerate launch`` uses), with ``Accelerator(cpu=True)`` on gloo.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from benchmarks.common import Reporter, parse_options, save_tensor
from benchmarks.workloads import output_name


def main() -> None:
    opts = parse_options()
    workload = opts.workload
    dataset = workload.dataset()
    reporter = Reporter(opts.report)

    accelerator = Accelerator(cpu=True)
    model = workload.build_model()
    loader = DataLoader(
        dataset, batch_size=workload.batch_size, num_workers=opts.workers, collate_fn=workload.collate_fn()
    )
    model, loader = accelerator.prepare(model, loader)
    model.eval()
    opts.out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for step, batch in enumerate(loader):
            predictions = accelerator.gather_for_metrics(workload.predict(model, batch))
            if accelerator.is_main_process:
                save_tensor(predictions, opts.out / output_name(step))
            reporter.batch_done(workload.batch_examples(batch))
    accelerator.wait_for_everyone()
    reporter.finish(accelerator.process_index, accelerator.num_processes)
    accelerator.end_training()


if __name__ == "__main__":
    main()
