"""Ray Data: ``map_batches`` with a pool of model actors (one per "process"), then ``write_numpy``.

The CNN's images are made by Ray tasks (``map_batches`` over ``ray.data.range``) in parallel with the
actors, as Ray Data's streaming executor is meant to run; the MiniLM actors tokenize and embed.
Ray gets every core of the machine (``ray.init(num_cpus=os.cpu_count())``); each actor and each
loading task asks for half a CPU, so loading overlaps with the model (a whole CPU per actor would
leave no CPU for the loading tasks with 2 actors on 2 cores). The timing starts after
``ray.init()``: starting the actor pool (its processes import torch) is inside it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from benchmarks.common import Reporter, parse_options
from benchmarks.workloads import RandomImages, Workload, configure_process

ACTOR_CPUS = 0.5
TASK_CPUS = 0.5


class LoadImages:
    """Ray task body: the images of a batch of example ids (same images as the other contenders)."""

    def __init__(self, num_examples: int) -> None:
        self.dataset = RandomImages(num_examples)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = torch.stack([self.dataset[int(i)][0] for i in batch["id"]])
        return {"image": images.numpy()}


def load_images(batch: dict[str, np.ndarray], num_examples: int) -> dict[str, np.ndarray]:
    return LoadImages(num_examples)(batch)


class Predictor:
    """Ray actor: builds the model once, then maps batches to outputs."""

    def __init__(self, workload: Workload, threads: int) -> None:
        configure_process(threads)
        self.workload = workload
        self.model = workload.build_model()
        self.tokenize = workload.collate_fn()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            if self.workload.name == "cnn":
                output = self.model(torch.from_numpy(batch["image"]))
            else:
                output = self.model(self.tokenize(list(batch["text"])))
        return {"output": output.numpy()}


def main() -> None:
    import ray

    opts = parse_options()
    workload = opts.workload
    sentences = workload.dataset().sentences if workload.name == "minilm" else None  # type: ignore[attr-defined]
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    reporter = Reporter(opts.report)

    size = workload.batch_size
    if workload.name == "cnn":
        data: Any = ray.data.range(workload.num_examples).map_batches(
            load_images, batch_size=size, fn_kwargs={"num_examples": workload.num_examples}, num_cpus=TASK_CPUS
        )
    else:
        data = ray.data.from_items([{"text": s} for s in sentences])
    data = data.map_batches(
        Predictor,
        batch_size=size,
        fn_constructor_args=(workload, opts.threads),
        concurrency=opts.nproc,
        num_cpus=ACTOR_CPUS,
    )
    opts.out.mkdir(parents=True, exist_ok=True)
    data.write_numpy(str(opts.out), column="output")
    reporter.batches = workload.num_batches
    reporter.finish(0, opts.nproc)
    ray.shutdown()


if __name__ == "__main__":
    main()
