"""A job that checks, on each rank, that the call let go of its processor, its reducer and its batches.

The spec comes as JSON in argv[1]: ``storage``, ``report_dir``, ``schedule``, and ``fail_batch`` (a batch that
raises, on whichever rank runs it; ``None``: none). The garbage collector is off for the call, so whatever a
reference cycle holds counts as kept. Each rank writes ``<report_dir>/rank<r>.json``: how the call ended and the
kinds of objects still alive after it (an empty list when everything was let go).
"""

import gc
import json
import os
import sys
import weakref
from pathlib import Path

import torch

from torch_batch_process import MetricReducer, TorchBatchProcessor, torch_batch_process

SEEN: list = []


class Total(MetricReducer):
    """Sums the values it is given, keeping the sum where they are (on the device too: a reducer's state is the
    user's, which a call must let go of as well)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.total = 0.0

    def update(self, value):
        self.total = self.total + value.sum()

    def per_slot_reduce(self):
        return float(self.total)

    def cross_slot_reduce(self, per_slot_metrics):
        return sum(per_slot_metrics)


class Processor(TorchBatchProcessor):
    fail_batch = None

    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(torch.nn.Linear(16, 1))
        self.reducer = Total()
        self.total = context.wrap_reducer(self.reducer, name="total")
        SEEN.extend([weakref.ref(self), weakref.ref(self.reducer)])

    def process_batch(self, batch, batch_idx):
        SEEN.append(weakref.ref(batch))
        if batch_idx == self.fail_batch:
            raise ValueError(f"batch {batch_idx} is bad")
        out = self.model(batch)[:, 0]
        self.context.write({"value": out})
        self.total.update(out)


def main():
    spec = json.loads(sys.argv[1])
    Processor.fail_batch = spec.get("fail_batch")
    rank = int(os.environ["RANK"])
    gc.collect()
    gc.disable()
    try:
        result = torch_batch_process(
            Processor, torch.randn(64, 16), batch_size=4, storage_path=spec["storage"], checkpoint_interval=2,
            schedule=spec["schedule"], progress=False, tensorboard=False,
        )
        ended = "finished" if result.finished else "preempted"
        del result
    except Exception as exc:  # noqa: BLE001 - reported, then dropped
        ended = type(exc).__name__
        del exc
    alive = sorted({type(ref()).__name__ for ref in SEEN if ref() is not None})
    report = {"ended": ended, "alive": alive, "seen": len(SEEN)}
    Path(spec["report_dir"], f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
