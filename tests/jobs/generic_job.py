"""A configurable job for the tests, run in real worker processes.

The spec comes as JSON in argv[1]. Each rank writes ``<report_dir>/attempt<k>_rank<r>.json`` with
the calls it saw, its hyperparameters and the result (or the exception) of ``torch_batch_process``.
Without ``storage`` in the spec the storage path comes from the environment (``tbp run``). With
``pid_dir``, each rank writes ``<pid_dir>/rank<r>_restart<k>.pid`` when it starts (``k``: torchrun's
restart count), for tests that kill workers.
"""

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from report_file import write_report

from torch_batch_process import MetricReducer, TorchBatchProcessor, torch_batch_process

SPEC = json.loads(sys.argv[1])
if SPEC.get("torch_without_set_timeout") and hasattr(torch.distributed, "set_timeout"):
    del torch.distributed.set_timeout  # as torch 2.11: no public torch.distributed.set_timeout
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks for the stacks


class RangeDataset(torch.utils.data.Dataset):
    """Example i is the integer i (as a 0-d tensor)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in SPEC.get("bad_items", []):
            raise ValueError(f"bad item {i}")
        return torch.tensor(i)


class SumReducer(MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.total = 0
        self.count = 0

    def update(self, values):
        self.total += int(sum(values))
        self.count += len(values)

    def per_slot_reduce(self):
        return self.total, self.count

    def cross_slot_reduce(self, per_slot_metrics):
        totals, counts = zip(*per_slot_metrics)
        return {"sum_cls": sum(totals), "count_cls": sum(counts)}


class Processor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.rank = context.distributed.get_rank()
        self.calls = []
        self.call_times = []
        self.checkpoints = 0
        self.finishes = 0
        self.buffer = []
        self.flushes = 0
        self.blocked = False
        self.hparams = context.get_hparams()
        self.fn_sum = context.wrap_reducer(lambda values: sum(values), name="sum_fn")
        self.cls_sum = context.wrap_reducer(SumReducer())
        if SPEC.get("fail_init_rank") == self.rank:
            raise RuntimeError(f"init failure on rank {self.rank}")
        if SPEC.get("sigterm_init_rank") == self.rank:  # preempted while the processors are being built
            os.kill(os.getpid(), signal.SIGTERM)

    def process_batch(self, batch, batch_idx):
        self.calls.append(batch_idx)
        self.call_times.append(time.time())
        values = [int(v) for v in batch]
        self.fn_sum.update(sum(values))
        self.cls_sum.update(values)
        if SPEC.get("sleep"):
            time.sleep(SPEC["sleep"])
        if SPEC.get("sleep_rank", {}).get(str(self.rank)):  # a straggler: this rank sleeps longer per batch
            time.sleep(SPEC["sleep_rank"][str(self.rank)])
        if SPEC.get("report_metrics"):
            self.context.report_metrics("inference", batch_idx + 1, {"batch_sum": sum(values), "rank": self.rank})
        mode = SPEC.get("outputs", "per_batch")
        if mode in ("per_batch", "both"):
            with self.context.upload_path() as path:
                (path / f"batch_{batch_idx}.json").write_text(json.dumps(values))
        if mode in ("buffered", "both"):
            self.buffer.extend(values)
        # ">=" and once: under schedule="dynamic" rank 0 may never take the very batch named
        if self.rank == 0 and not self.blocked and batch_idx >= SPEC.get("block_records_at", float("inf")):
            self.blocked = True
            _block_record_writes()
        if batch_idx == SPEC.get("fail_batch") and self.rank == SPEC.get("fail_rank", self.rank):
            raise RuntimeError(f"failure at batch {batch_idx} on rank {self.rank}")
        _progress()
        if batch_idx >= SPEC.get("gate_batch", 0):
            _wait_at_gate()

    def on_checkpoint_start(self):
        self.checkpoints += 1
        if self.buffer:
            with self.context.upload_path() as path:
                name = f"buffer_rank{self.rank}_{self.flushes}.json"
                (path / name).write_text(json.dumps(self.buffer))
            self.flushes += 1
            self.buffer = []
        if SPEC.get("fail_checkpoint_rank") == self.rank and self.checkpoints == SPEC.get("fail_checkpoint_at", 1):
            raise RuntimeError(f"checkpoint failure on rank {self.rank}")

    def on_finish(self):
        self.finishes += 1


PROCESSOR = None


def _progress():
    """Tests that kill workers wait for this file to know the job is under way."""
    marker = SPEC.get("progress_file")
    if marker:
        Path(marker).touch()


def _block_record_writes():
    """Makes rank 0's next commit-record writes fail for real: a folder stands where each of the next records
    would be renamed to (the earlier records stay intact, so a re-run after removing them resumes)."""
    commits = Path(SPEC["storage"], "_tbp", "commits")
    numbers = [int(p.stem) for p in commits.glob("*.json") if p.stem.isdigit()]
    for number in range(max(numbers, default=0) + 1, max(numbers, default=0) + 500):
        try:
            (commits / f"{number:08d}.json").mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            pass  # written by rank 0's background thread meanwhile: the next ones are blocked


def _wait_at_gate():
    """While the file ``gate_file`` exists, stop before the next batch (tests that need a job held mid-run);
    ``<gate_file>.reached`` tells them it is held."""
    gate = SPEC.get("gate_file")
    if not gate:
        return
    deadline = time.monotonic() + 300
    while Path(gate).exists() and time.monotonic() < deadline:
        Path(gate + ".reached").touch()
        time.sleep(0.05)


class Recording(Processor):
    def __init__(self, context):
        global PROCESSOR
        super().__init__(context)
        PROCESSOR = self


Recording.__qualname__ = SPEC.get("processor_name", "Processor")


def main():
    rank = int(os.environ.get("RANK", "0"))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    report = {"rank": rank, "pid": os.getpid(), "restart": int(restart)}
    report["env"] = {name: os.environ.get(name) for name in SPEC.get("report_env", [])}
    if SPEC.get("pid_dir"):
        pid_dir = Path(SPEC["pid_dir"])
        pid_dir.mkdir(parents=True, exist_ok=True)
        (pid_dir / f"rank{rank}_restart{restart}.pid").write_text(str(os.getpid()))
    dataset = RangeDataset(SPEC["n"])
    kwargs = dict(SPEC.get("kwargs", {}))
    try:
        result = torch_batch_process(
            Recording,
            dataset,
            batch_size=SPEC.get("batch_size"),
            max_batches=SPEC.get("max_batches"),
            checkpoint_interval=SPEC.get("checkpoint_interval", 5),
            dataloader_kwargs=SPEC.get("dataloader_kwargs"),
            **({"storage_path": SPEC["storage"]} if "storage" in SPEC else {}),
            **kwargs,
        )
        report["result"] = result.to_json()
        report["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        exit_code = 0
        if SPEC.get("sleep_after"):  # the script's own work after the job (a test signals the launcher meanwhile)
            Path(SPEC["report_dir"]).mkdir(parents=True, exist_ok=True)
            Path(SPEC["report_dir"], f"returned_rank{rank}").touch()
            time.sleep(SPEC["sleep_after"])
    except BaseException as exc:  # noqa: BLE001 - report it, then fail like a real script would
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        exit_code = 1
    if PROCESSOR is not None:
        report.update(
            calls=PROCESSOR.calls,
            call_times=PROCESSOR.call_times,
            checkpoints=PROCESSOR.checkpoints,
            finishes=PROCESSOR.finishes,
            hparams=PROCESSOR.hparams,
        )
    report_dir = Path(SPEC["report_dir"])
    report_dir.mkdir(parents=True, exist_ok=True)
    attempt = SPEC.get("attempt", 1)
    write_report(report_dir / f"attempt{attempt}_rank{rank}.json", report)
    if exit_code:
        print(report["error"]["traceback"], file=sys.stderr, flush=True)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
