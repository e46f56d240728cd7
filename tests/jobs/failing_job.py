"""A job with failing examples, for tests/test_failures.py, run in real worker processes.

The spec comes as JSON in argv[1]: ``storage``, ``report_dir``, ``n``, ``batch_size``, ``bad_load`` (indices
whose ``__getitem__`` raises), ``bad_process`` (indices that make ``process_batch`` raise when in its batch),
``on_error``, ``max_failures``, ``batch_timeout``, ``stuck_batch`` (a batch whose ``process_batch`` sleeps for
an hour), ``stuck_load`` (an example whose ``__getitem__`` sleeps for an hour), ``kill_worker_at`` (an example whose loading
in a DataLoader worker SIGKILLs the worker), ``stuck_mode`` (``"blocked"``:
the stuck batch blocks the watchdog's signal), ``sleep`` (seconds per batch), ``num_workers``, ``schedule``,
``checkpoint_interval``, ``progress_file`` (touched at the first batch), ``kill_before_result`` (the process
SIGKILLs itself when the library is about to write ``result.json``, right after the final commit record),
``kill_at_publish`` (the process SIGKILLs itself when it is about to publish its k-th stage, right after the commit
record that commits it), ``attempt``.

Each batch writes ``vals_<batch_idx>.json`` (the dataset indices it processed) through ``upload_path()``, updates
a sum reducer and a function reducer, and ``report_metrics`` once. Each rank writes
``<report_dir>/attempt<k>_rank<r>.json`` with the result or the exception.
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

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks for the stacks

SPEC = json.loads(sys.argv[1])
BAD_LOAD = set(SPEC.get("bad_load", []))
BAD_PROCESS = set(SPEC.get("bad_process", []))


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return SPEC["n"]

    def __getitem__(self, i):
        if i in BAD_LOAD:
            raise ValueError(f"cannot load item {i}")
        if i == SPEC.get("kill_worker_at") and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)  # a DataLoader worker dies (as by the out-of-memory killer)
        if i == SPEC.get("stuck_load"):  # loading this example hangs (a stuck network read)
            Path(SPEC["report_dir"]).mkdir(parents=True, exist_ok=True)
            Path(SPEC["report_dir"], "stuck_pid").write_text(str(os.getpid()))  # a DataLoader worker's, or the rank's
            Path(SPEC["report_dir"], "stuck_at").write_text(str(time.time()))
            time.sleep(3600)
        return torch.tensor(i)


class SumReducer(MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.total, self.count = 0, 0

    def update(self, values):
        self.total += int(sum(values))
        self.count += len(values)

    def per_slot_reduce(self):
        return self.total, self.count

    def cross_slot_reduce(self, per_slot_metrics):
        totals, counts = zip(*per_slot_metrics)
        return {"sum": sum(totals), "count": sum(counts)}


class Processor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.sum = context.wrap_reducer(SumReducer(), name=None)
        self.seen = context.wrap_reducer(lambda values: sorted(v for batch in values for v in batch), name="seen")

    def process_batch(self, batch, batch_idx):
        values = [int(v) for v in batch]
        assert values == list(self.context.batch_indices), (values, list(self.context.batch_indices))
        progress = SPEC.get("progress_file")
        if progress and not os.path.exists(progress):
            Path(progress).touch()
        self.sum.update(values)  # before the failure: must be rolled back
        self.seen.update(values)
        self.context.report_metrics("batches", batch_idx, {"n": len(values)})
        with self.context.upload_path() as path:
            (path / f"vals_{batch_idx}.json").write_text(json.dumps(values))
        if batch_idx == SPEC.get("stuck_batch"):
            Path(SPEC["report_dir"]).mkdir(parents=True, exist_ok=True)
            Path(SPEC["report_dir"], "stuck_at").write_text(str(time.time()))
            if SPEC.get("stuck_mode") == "blocked":  # the watchdog's signal never gets through: it must exit
                signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
            time.sleep(3600)
        if BAD_PROCESS & set(values):
            raise RuntimeError(f"bad example in {values}")
        time.sleep(SPEC.get("sleep", 0.0))


def kill_before_result():
    """Makes ``JobStore.write_result`` (called right after the final commit record) SIGKILL this process."""
    from torch_batch_process.jobstore.store import JobStore

    def killed(self, result):
        os.kill(os.getpid(), signal.SIGKILL)

    JobStore.write_result = killed


def kill_at_publish(k):
    """Makes the ``k``-th ``JobStore.publish`` of this process (right after the commit record of its stage) SIGKILL
    it, so that the stage is committed and still staged."""
    from torch_batch_process.jobstore.store import JobStore

    publish, calls = JobStore.publish, []

    def killed(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return publish(self, *args, **kwargs)

    JobStore.publish = killed


def main():
    if SPEC.get("kill_before_result"):
        kill_before_result()
    if SPEC.get("kill_at_publish"):
        kill_at_publish(SPEC["kill_at_publish"])
    rank = int(os.environ.get("RANK", "0"))
    report = {"rank": rank}
    names = ("on_error", "max_failures", "batch_timeout", "schedule", "retry_failed")
    kwargs = {k: SPEC[k] for k in names if k in SPEC}
    try:
        result = torch_batch_process(
            Processor,
            Items(),
            batch_size=SPEC.get("batch_size", 4),
            checkpoint_interval=SPEC.get("checkpoint_interval", 2),
            dataloader_kwargs={"num_workers": SPEC.get("num_workers", 0)},
            storage_path=SPEC["storage"],
            progress=False,
            tensorboard=False,
            **kwargs,
        )
        report["result"] = result.to_json()
    except BaseException as exc:  # noqa: BLE001
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    out = Path(SPEC["report_dir"])
    out.mkdir(parents=True, exist_ok=True)
    write_report(out / f"attempt{SPEC.get('attempt', 1)}_rank{rank}.json", report)
    if "error" in report:
        sys.exit(1)


if __name__ == "__main__":
    main()
