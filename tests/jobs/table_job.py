"""A job writing ``context.write`` rows into a table target, run in real worker processes by tests/test_tables.py.

The spec comes as JSON in argv[1]: ``table`` (``{"format": "delta"|"iceberg"|"lance", "uri"|"identifier",
"storage_options"|"catalog", "commit_interval_s"}``), ``n``, ``batch_size``, ``checkpoint_interval``, ``storage``,
``kwargs`` (more options of torch_batch_process), ``sleep`` (seconds per batch), ``progress_file`` (touched after
each batch, for tests that kill workers), ``report_dir``, ``attempt``. Example ``i`` gets ``emb=[i, i+0.5, -i]``
(float32) and ``label="ex<i>"``. An error is stored in the report and the process exits with status 1.
``TBP_TEST_TABLE_KILL`` in the environment kills rank 0 around a table transaction (:func:`kill_at_table_moments`).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from report_file import write_report

from torch_batch_process import TorchBatchProcessor, tables, torch_batch_process

SPEC = json.loads(sys.argv[1])


def make_table(spec):
    interval = spec.get("commit_interval_s", 1.0)
    if spec["format"] == "delta":
        return tables.delta(spec["uri"], storage_options=spec.get("storage_options"), commit_interval_s=interval)
    if spec["format"] == "iceberg":
        return tables.iceberg(spec["identifier"], catalog=spec["catalog"], commit_interval_s=interval)
    return tables.lance(spec["uri"], storage_options=spec.get("storage_options"), commit_interval_s=interval)


class Processor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        values = [int(v) for v in batch]
        self.context.write(
            {
                "emb": torch.stack([torch.tensor([v, v + 0.5, -v]) for v in values]),
                "label": [f"ex{v}" for v in values],
            }
        )
        if SPEC.get("sleep"):
            time.sleep(SPEC["sleep"])
        if SPEC.get("progress_file"):
            Path(SPEC["progress_file"]).touch()


def kill_at_table_moments(wanted):
    """``TBP_TEST_TABLE_KILL`` (this job's, not the library's): ``before:<k>`` / ``after:<k>`` makes rank 0 SIGKILL
    itself right before or right after its ``k``-th table transaction, ``compact:<k>`` right before its ``k``-th
    compaction: the moments between a record and the table's commit that fault tests must reach. It wraps the
    library's own methods; nothing else of the library is replaced."""
    from torch_batch_process.outputs.tables.commits import TableCommits

    moment, _, k = wanted.partition(":")
    counts = {"transact": 0, "compact": 0}
    transact, compact = TableCommits._transact, TableCommits._compact

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def transact_then_maybe_die(self, groups, schema):
        counts["transact"] += 1
        if moment == "before" and counts["transact"] == int(k):
            die()
        transact(self, groups, schema)
        if moment == "after" and counts["transact"] == int(k):
            die()

    def compact_or_die(self):
        if self.table.target.compact:
            counts["compact"] += 1
            if moment == "compact" and counts["compact"] == int(k):
                die()
        compact(self)

    TableCommits._transact = transact_then_maybe_die
    TableCommits._compact = compact_or_die


def main():
    if os.environ.get("TBP_TEST_TABLE_KILL"):
        kill_at_table_moments(os.environ["TBP_TEST_TABLE_KILL"])
    rank = int(os.environ.get("RANK", "0"))
    report = {"rank": rank}
    try:
        result = torch_batch_process(
            Processor,
            list(range(SPEC["n"])),
            batch_size=SPEC["batch_size"],
            checkpoint_interval=SPEC.get("checkpoint_interval", 2),
            storage_path=SPEC["storage"],
            progress=False,
            table=make_table(SPEC["table"]),
            **SPEC.get("kwargs", {}),
        )
        report["result"] = result.to_json()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["error"] = {"type": type(exc).__name__, "message": str(exc)}
    report_dir = Path(SPEC["report_dir"])
    report_dir.mkdir(parents=True, exist_ok=True)
    write_report(report_dir / f"attempt{SPEC.get('attempt', 1)}_rank{rank}.json", report)
    if "error" in report:
        sys.exit(1)


if __name__ == "__main__":
    main()
