"""torch_batch_process: a ``TorchBatchProcessor`` writing one file per batch through ``upload_path()``.

Default settings (``checkpoint_interval=5``, local storage in the output folder); the library makes
the process group itself when started under torchrun.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Options, Reporter, env_rank, parse_options, save_tensor
from benchmarks.workloads import output_name
from torch_batch_process import TorchBatchProcessor, torch_batch_process


class BenchProcessor(TorchBatchProcessor):
    """Runs the workload's model on each batch and writes its output through ``upload_path()``."""

    opts: Options
    reporter: Reporter
    checkpoint_starts = 0  # on_checkpoint_start() calls on this rank (per-rank call counts differ by schedule)

    def __init__(self, context: Any) -> None:
        self.context = context
        self.workload = self.opts.workload
        self.model = context.prepare_model_for_inference(self.workload.build_model())

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        output = self.workload.predict(self.model, self.context.to_device(batch))
        with self.context.upload_path() as path:
            save_tensor(output, Path(path) / output_name(batch_idx))
        self.reporter.batch_done(self.workload.batch_examples(batch))

    def on_checkpoint_start(self) -> None:
        BenchProcessor.checkpoint_starts += 1


def run(
    opts: Options,
    prepare: Callable[[Any], dict[str, Any]] | None = None,
    processor: type[BenchProcessor] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """One job; ``options`` go to ``torch_batch_process`` (default: its defaults).

    ``prepare(dataset)``, if given, returns more options; it runs inside the job's clock (a plan's cost,
    e.g. computing lengths, is part of the job) and its time is reported as ``plan_seconds``. ``processor``:
    a subclass of :class:`BenchProcessor` (the embeddings' agreement check also writes each batch's indices).
    """
    processor = processor or BenchProcessor
    workload = opts.workload
    dataset = workload.dataset()
    reporter = Reporter(opts.report)
    BenchProcessor.opts, BenchProcessor.reporter = opts, reporter
    plan_seconds = 0.0
    if prepare is not None:
        started = time.perf_counter()
        options.update(prepare(dataset))
        plan_seconds = time.perf_counter() - started
    interval = opts.extra.get("checkpoint_interval")
    if interval:
        options.setdefault("checkpoint_interval", interval)
    result = torch_batch_process(
        processor,
        dataset,
        batch_size=workload.batch_size,
        dataloader_kwargs={"num_workers": opts.workers, "collate_fn": workload.collate_fn()},
        storage_path=str(opts.out),
        **options,
    )
    rank, world_size = env_rank()
    return reporter.finish(
        rank, world_size, commits=result.commits, timings=result.timings, plan_seconds=plan_seconds,
        checkpoint_starts=BenchProcessor.checkpoint_starts,
    )


if __name__ == "__main__":
    run(parse_options())
