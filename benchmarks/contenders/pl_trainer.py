"""PyTorch Lightning: ``Trainer.predict`` with a ``BasePredictionWriter`` writing one file per batch.

Two processes use Lightning's own ``ddp`` strategy on CPU (``devices=2``): Lightning starts the
second process itself and shards the predict set with its unrepeated distributed sampler.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader

from benchmarks.common import Reporter, parse_options, save_tensor
from benchmarks.workloads import Workload, output_name


class Module(pl.LightningModule):
    def __init__(self, workload: Workload) -> None:
        super().__init__()
        self.workload = workload
        self.model = workload.build_model()

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self.workload.predict(self.model, batch)


class FileWriter(BasePredictionWriter):
    def __init__(self, out: Path, reporter: Reporter) -> None:
        super().__init__(write_interval="batch")
        self.out = out
        self.reporter = reporter

    def write_on_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        save_tensor(prediction, self.out / output_name(batch_idx, rank=trainer.global_rank))
        self.reporter.batch_done(int(prediction.shape[0]))


def main() -> None:
    warnings.filterwarnings("ignore")
    opts = parse_options()
    workload = opts.workload
    dataset = workload.dataset()
    reporter = Reporter(opts.report)

    opts.out.mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=opts.nproc,
        strategy="ddp" if opts.nproc > 1 else "auto",
        callbacks=[FileWriter(opts.out, reporter)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(
        dataset, batch_size=workload.batch_size, num_workers=opts.workers, collate_fn=workload.collate_fn()
    )
    trainer.predict(Module(workload), dataloaders=loader, return_predictions=False)
    reporter.finish(trainer.global_rank, trainer.world_size)


if __name__ == "__main__":
    main()
