"""A job over a streaming source, for the tests, run in real worker processes.

The spec comes as JSON in argv[1]:

- ``source``: ``{"kind": "parquet", "url": GLOB}``, ``{"kind": "jsonl", "url": GLOB, "count_rows": bool}``,
  ``{"kind": "hf_parquet", "files": [...]}`` (a Hugging Face streaming dataset over Parquet files, one shard
  per file) or ``{"kind": "hf_generator", "num_shards": S, "size": N}`` (``IterableDataset.from_generator``).
  Every row has an int ``id``.
- ``reads_log``: a file that adds up the rows read by every process (``RowsReadLog``).
- ``batch_size``, ``checkpoint_interval``, ``sleep`` (per batch), ``kwargs`` (more options),
  ``storage``, ``report_dir``, ``attempt``, ``progress_file`` (touched after each batch), ``fail_rows`` (ids
  whose batch raises after its work: with ``on_error="skip"`` they are recorded as failures).

Each batch writes ``batch_<idx>.json``: ``{"ids": [...], "indices": context.batch_indices}``. Each rank
writes ``<report_dir>/attempt<k>_rank<r>.json`` with its calls and the result or the exception.
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

from torch_batch_process import TorchBatchProcessor, sources, torch_batch_process

SPEC = json.loads(sys.argv[1])
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks for the stacks


def generate(starts, size):
    for start in starts:
        for i in range(size):
            yield {"id": start * size + i}


def make_source():
    spec = SPEC["source"]
    kind = spec["kind"]
    if kind == "parquet":
        source = sources.parquet(spec["url"])
    elif kind == "jsonl":
        source = sources.jsonl(spec["url"], count_rows=spec.get("count_rows", False))
    elif kind == "hf_parquet":
        import datasets

        ds = datasets.load_dataset("parquet", data_files=spec["files"], split="train", streaming=True)
        source = sources.from_hf(ds)
    elif kind == "hf_generator":
        import datasets

        ds = datasets.IterableDataset.from_generator(
            generate, gen_kwargs={"starts": list(range(spec["num_shards"])), "size": spec["size"]}
        )
        source = sources.from_hf(ds)
    else:
        raise ValueError(f"unknown source kind {kind!r}")
    if SPEC.get("reads_log"):
        source.on_rows_read = sources.RowsReadLog(SPEC["reads_log"])
    return source


class Processor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.calls = []
        self.total = context.wrap_reducer(lambda values: sum(values), name="id_sum")

    def process_batch(self, batch, batch_idx):
        self.calls.append(batch_idx)
        ids = [int(v) for v in batch["id"]]
        self.total.update(sum(ids))
        if SPEC.get("sleep"):
            time.sleep(SPEC["sleep"])
        with self.context.upload_path() as path:
            record = {"ids": ids, "indices": list(self.context.batch_indices)}
            (path / f"batch_{batch_idx}.json").write_text(json.dumps(record))
        if SPEC.get("progress_file"):
            Path(SPEC["progress_file"]).touch()
        bad = set(SPEC.get("fail_rows", ())).intersection(ids)
        if bad:  # with on_error="skip": everything above is rolled back, the rows are recorded as failures
            raise ValueError(f"bad rows {sorted(bad)}")


PROCESSOR = None


class Recording(Processor):
    def __init__(self, context):
        global PROCESSOR
        super().__init__(context)
        PROCESSOR = self


def main():
    rank = int(os.environ.get("RANK", "0"))
    report = {"rank": rank, "pid": os.getpid()}
    try:
        result = torch_batch_process(
            Recording,
            make_source(),
            batch_size=SPEC["batch_size"],
            checkpoint_interval=SPEC.get("checkpoint_interval", 5),
            dataloader_kwargs=SPEC.get("dataloader_kwargs"),
            storage_path=SPEC["storage"],
            **SPEC.get("kwargs", {}),
        )
        report["result"] = result.to_json()
        exit_code = 0
    except BaseException as exc:  # noqa: BLE001 - report it, then fail like a real script would
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        exit_code = 1
    if PROCESSOR is not None:
        report["calls"] = PROCESSOR.calls
    report_dir = Path(SPEC["report_dir"])
    report_dir.mkdir(parents=True, exist_ok=True)
    write_report(report_dir / f"attempt{SPEC.get('attempt', 1)}_rank{rank}.json", report)
    if exit_code:
        print(report["error"]["traceback"], file=sys.stderr, flush=True)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
