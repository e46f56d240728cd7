"""A job that uses every capability that stores something with a commit, for the stored-job fixtures of
tests/test_previous_jobs.py (made by tests/fixtures/make_previous_jobs.py with an earlier version of the library,
resumed by the current one).

The spec comes as JSON in argv[1]: ``storage``, ``report_dir``, ``n``, ``batch_size``, ``checkpoint_interval``,
``schedule``, ``bucket`` (``bucket_by`` the lengths of :func:`length`), ``budget`` (a simulated device memory: a batch
larger than it raises ``torch.OutOfMemoryError``; sizes in padded tokens with ``bucket``, else in examples), ``bad``
(examples whose ``process_batch`` raises: ``on_error="skip"``), ``table`` (a Delta table's path: rows go there
instead of record shards; ``TBP_TEST_TABLE_KILL`` kills rank 0 around a table transaction, as in
tests/jobs/table_job.py), ``kill_after`` (the rank SIGKILLs itself when it is given its batch number
``kill_after + 1``, by rank), ``sleep`` (seconds per batch), ``attempt``.

Example ``i`` is the integer ``i``; its row holds ``emb=[i, -i]`` and ``label="ex<i>"``; a file per batch goes through
``upload_path()``; two reducers sum the examples; the processor's state counts its batches. Each rank writes
``<report_dir>/attempt<k>_rank<r>.json``: the result (or the error), the sizes of the batches it was given, its
simulated out-of-memory errors and the count its state restored.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from torch_batch_process import MetricReducer, TorchBatchProcessor, tables, torch_batch_process

SPEC = json.loads(sys.argv[1])
RANK = int(os.environ.get("RANK", "0"))


def length(i):
    """Example ``i``'s length (``bucket_by``): 1 to 64, fixed."""
    return 1 + (i * 37) % 64


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return SPEC["n"]

    def __getitem__(self, i):
        return torch.tensor(i)


class SumCount(MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.total, self.count = 0, 0

    def update(self, values):
        self.total += sum(values)
        self.count += len(values)

    def per_slot_reduce(self):
        return self.total, self.count

    def cross_slot_reduce(self, per_slot_metrics):
        return {"total": sum(t for t, _ in per_slot_metrics), "count": sum(c for _, c in per_slot_metrics)}


PROCESSOR = None


class Processor(TorchBatchProcessor):
    def __init__(self, context):
        global PROCESSOR
        PROCESSOR = self
        self.context = context
        self.sum = context.wrap_reducer(lambda values: sum(values), name="sum")
        self.sum_count = context.wrap_reducer(SumCount())
        self.batches = 0
        self.restored = None
        self.seen = set()
        self.sizes = []
        self.ooms = 0

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.restored = state["batches"]
        self.batches = state["batches"]

    def process_batch(self, batch, batch_idx):
        if batch_idx not in self.seen:
            self.seen.add(batch_idx)
            if len(self.seen) > SPEC.get("kill_after", {}).get(str(RANK), float("inf")):
                os.kill(os.getpid(), signal.SIGKILL)
        values = [int(v) for v in batch]
        self.sizes.append(len(values))
        size = len(values) * max(length(v) for v in values) if SPEC.get("bucket") else len(values)
        if SPEC.get("budget") and size > SPEC["budget"]:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"simulated: {size} > {SPEC['budget']}")
        bad = [v for v in values if v in SPEC.get("bad", [])]
        if bad:
            raise ValueError(f"bad example(s) {bad}")
        self.context.write({"emb": torch.tensor([[v, -v] for v in values], dtype=torch.float32),
                            "label": [f"ex{v}" for v in values]})
        with self.context.upload_path() as path:
            (path / f"batch_{batch_idx}.json").write_text(json.dumps(values))
        self.sum.update(sum(values))
        self.sum_count.update(values)
        self.batches += 1
        time.sleep(SPEC.get("sleep", 0.0))


def main():
    if os.environ.get("TBP_TEST_TABLE_KILL"):  # the fault tests' kill around a table transaction (table_job.py)
        from table_job import kill_at_table_moments

        kill_at_table_moments(os.environ["TBP_TEST_TABLE_KILL"])
    report = {"rank": RANK}
    table = SPEC.get("table")
    try:
        result = torch_batch_process(
            Processor,
            Numbers(),
            batch_size=SPEC["batch_size"],
            checkpoint_interval=SPEC["checkpoint_interval"],
            storage_path=SPEC["storage"],
            schedule=SPEC.get("schedule", "static"),
            bucket_by=[length(i) for i in range(SPEC["n"])] if SPEC.get("bucket") else None,
            on_error="skip" if SPEC.get("bad") else "raise",
            table=tables.delta(table, commit_interval_s=0) if table else None,
            progress=False,
            tensorboard=False,
        )
        report["result"] = result.to_json()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        report["error"] = {"type": type(exc).__name__, "message": str(exc)}
    if PROCESSOR is not None:
        report.update(sizes=PROCESSOR.sizes, ooms=PROCESSOR.ooms, restored=PROCESSOR.restored)
    out = Path(SPEC["report_dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"attempt{SPEC.get('attempt', 1)}_rank{RANK}.json").write_text(json.dumps(report))
    sys.exit(1 if "error" in report else 0)


if __name__ == "__main__":
    main()
