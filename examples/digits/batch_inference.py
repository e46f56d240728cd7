"""Batch inference of a digits classifier with torch_batch_process.

Predictions are written as one CSV per batch through ``upload_path()``; accuracy is computed over the
whole held-out set by a metric reducer, exactly, on any number of processes and across resumes.

    python examples/digits/batch_inference.py                                   # one process
    torchrun --standalone --nproc-per-node 2 examples/digits/batch_inference.py  # two processes

Interrupt it (Ctrl-C) and run the same command again: it resumes where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import load_trained_model, test_dataset  # noqa: E402

from torch_batch_process import MetricReducer, TorchBatchProcessor, torch_batch_process  # noqa: E402


class AccuracyReducer(MetricReducer):
    """Counts correct predictions on each rank; the cross-rank reduction divides the totals."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.correct = 0
        self.total = 0

    def update(self, correct: int, total: int) -> None:
        self.correct += correct
        self.total += total

    def per_slot_reduce(self) -> tuple[int, int]:
        return self.correct, self.total

    def cross_slot_reduce(self, per_slot_metrics: list[tuple[int, int]]) -> dict[str, float]:
        correct = sum(c for c, _ in per_slot_metrics)
        total = sum(t for _, t in per_slot_metrics)
        return {"accuracy": correct / max(total, 1), "examples": total}


class DigitsInference(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(load_trained_model())
        self.accuracy = context.wrap_reducer(AccuracyReducer())

    def process_batch(self, batch, batch_idx):
        images, labels, indices = batch
        predictions = self.model(self.context.to_device(images)).argmax(dim=1).cpu()
        self.accuracy.update(int((predictions == labels).sum()), len(labels))
        with self.context.upload_path() as path:
            with open(path / f"predictions_{batch_idx:05d}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["index", "label", "prediction"])
                writer.writerows(zip(indices.tolist(), labels.tolist(), predictions.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default=None, help="storage path or URL (default: ./tbp_runs/batch_inference)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-interval", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--fresh", action="store_true", help="erase a previous run at the storage path first")
    args = parser.parse_args()

    result = torch_batch_process(
        DigitsInference,
        test_dataset(),
        batch_size=args.batch_size,
        checkpoint_interval=args.checkpoint_interval,
        dataloader_kwargs={"num_workers": args.workers},
        storage_path=args.storage,
        resume=not args.fresh,
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return  # the result is the same on every rank: print it once
    if result.preempted:
        print(f"Preempted after {result.examples_committed}/{result.num_examples} examples; run again to resume.")
        return
    accuracy = result.metrics["accuracy"]
    print(f"Accuracy: {accuracy:.4f} over {result.metrics['examples']} held-out digits")
    print(f"Predictions (CSV, one file per batch): {result.outputs_path}")
    if result.already_finished:  # a re-run of a finished job does no work and returns its stored result
        print(
            f"Already finished earlier: {result.examples_committed} examples, accuracy {accuracy:.4f} "
            "(the stored result; nothing was processed now; --fresh runs it again)"
        )
        return
    print(
        f"Processed {result.examples_processed} examples in {result.elapsed_s:.1f}s "
        f"on {result.world_size} process(es)"
    )


if __name__ == "__main__":
    main()
