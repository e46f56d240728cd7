"""A job on a simulated device memory (tests/jobs/simulated_memory.py), for tests/test_oom.py, in real processes.

The spec comes as JSON in argv[1]: ``storage``, ``report_dir``, ``n``, ``lengths`` (one per example; default
:func:`lengths_for`), ``batch_size``, ``budget`` (padded tokens the simulated device holds), ``bucket`` (pass
``bucket_by``; default true), ``max_tokens``, ``bucket_window``, ``on_oom``, ``on_error``, ``schedule``,
``checkpoint_interval``, ``num_workers``, ``sleep`` (seconds per batch), ``progress_file`` (touched at each batch),
``attempt``. Each rank writes ``<report_dir>/attempt<k>_rank<r>.json`` with the result (or the exception), the
out-of-memory errors its model raised and the sizes of the batches it was given.
"""

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from report_file import write_report
from simulated_memory import Embedder, SimulatedMemory, Texts, lengths_for, pad_collate

from torch_batch_process import torch_batch_process

SPEC = json.loads(sys.argv[1])
faulthandler.register(signal.SIGUSR1, all_threads=True)


class Job(Embedder):
    def process_batch(self, batch, batch_idx):
        super().process_batch(batch, batch_idx)
        marker = SPEC.get("progress_file")
        if marker:
            Path(marker).touch()
        time.sleep(SPEC.get("sleep", 0.0))


def main():
    rank = int(os.environ.get("RANK", "0"))
    lengths = SPEC.get("lengths") or lengths_for(SPEC["n"])
    Job.memory = SimulatedMemory(SPEC.get("budget"), SPEC.get("unit", "tokens"))
    report = {"rank": rank}
    names = ("max_tokens", "bucket_window", "on_oom", "on_error", "schedule")
    kwargs = {k: SPEC[k] for k in names if k in SPEC}
    try:
        result = torch_batch_process(
            Job,
            Texts(lengths),
            batch_size=SPEC.get("batch_size", 64),
            bucket_by=lengths if SPEC.get("bucket", True) else None,
            checkpoint_interval=SPEC.get("checkpoint_interval", 1),
            dataloader_kwargs={"num_workers": SPEC.get("num_workers", 0), "collate_fn": pad_collate},
            storage_path=SPEC["storage"],
            progress=False,
            tensorboard=False,
            **kwargs,
        )
        report["result"] = result.to_json()
    except BaseException as exc:  # noqa: BLE001
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    report["ooms"] = Job.memory.ooms
    report["calls"] = Job.memory.calls
    out = Path(SPEC["report_dir"])
    out.mkdir(parents=True, exist_ok=True)
    write_report(out / f"attempt{SPEC.get('attempt', 1)}_rank{rank}.json", report)
    if "error" in report:
        sys.exit(1)


if __name__ == "__main__":
    main()
