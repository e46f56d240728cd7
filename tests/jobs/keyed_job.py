"""A keyed job (``key="id"``), run in real worker processes by tests/test_incremental_jobs.py.

The spec comes as JSON in argv[1]: ``n`` (examples of the first dataset), ``changed_every`` (the text of every
id divisible by it changes, ``0``: none), ``extra`` (ids appended), ``version``, ``kwargs`` (more options of
torch_batch_process, e.g. ``incremental``), ``batch_size``, ``checkpoint_interval``, ``storage``, ``calls_dir``
(each process appends the dataset indices of every batch it is given, one JSON line per batch, to
``calls-<pid>.jsonl`` before it processes it), ``report_dir`` (``rank_<r>.json``: the result, or the error),
``die_after`` (``{"rank": r, "batches": b}``: that rank SIGKILLs itself when it is given its ``b``-th batch, after
noting it), ``delta`` (a local Delta table's path: the rows go there, ``table=tables.delta(path)``), ``table``
(``{"format": "delta"|"lance", "uri": path}`` or ``{"format": "iceberg", "identifier": ..., "catalog": {...}}``),
``table_kill`` (``before:<k>`` / ``after:<k>``: the process SIGKILLs itself right before / after its ``k``-th
table transaction, wrapping the library's own method), ``parquet`` (a glob of Parquet files the test wrote: the
dataset is ``sources.parquet(glob)`` instead of the list, with ``content=["text"]``), ``fail_ids`` (ids whose batch
raises ``ValueError``: failing examples with ``on_error="skip"`` in ``kwargs``). Example ``id`` has the
text ``t<id>`` (``t<id>-v2`` once changed, ``new<id>`` appended); its row is ``value = text.upper()``.
"""

import json
import os
import signal
import sys
from pathlib import Path

from report_file import write_report

from torch_batch_process import TorchBatchProcessor, sources, tables, torch_batch_process

SPEC = json.loads(sys.argv[1])


def dataset() -> list[dict]:
    every, n = SPEC.get("changed_every", 0), SPEC["n"]
    rows = [{"id": i, "text": f"t{i}-v2" if every and i % every == 0 else f"t{i}"} for i in range(n)]
    return rows + [{"id": i, "text": f"new{i}"} for i in range(n, n + SPEC.get("extra", 0))]


class Processor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.batches = 0
        self.calls = Path(SPEC["calls_dir"]) / f"calls-{os.getpid()}.jsonl"

    def process_batch(self, batch, batch_idx):
        indices = [int(i) for i in self.context.batch_indices]
        with open(self.calls, "a") as f:
            f.write(json.dumps(indices) + "\n")
        self.batches += 1
        die = SPEC.get("die_after")
        if die and die["rank"] == self.context.distributed.get_rank() and self.batches >= die["batches"]:
            os.kill(os.getpid(), signal.SIGKILL)
        failing = set(SPEC.get("fail_ids", ())) & {int(i) for i in batch["id"]}
        if failing:
            raise ValueError(f"cannot process ids {sorted(failing)}")
        self.context.write({"value": [text.upper() for text in batch["text"]]})


def kill_around_table_transactions(wanted: str) -> None:
    from torch_batch_process.outputs.tables.commits import TableCommits

    moment, _, k = wanted.partition(":")
    transact, made = TableCommits._transact, []

    def transact_or_die(self, groups, schema):
        made.append(1)
        if moment == "before" and len(made) == int(k):
            os.kill(os.getpid(), signal.SIGKILL)
        transact(self, groups, schema)
        if moment == "after" and len(made) == int(k):
            os.kill(os.getpid(), signal.SIGKILL)

    TableCommits._transact = transact_or_die


def table_option() -> dict:
    """The ``table=`` option of the spec (none: shards)."""
    spec = SPEC.get("table") or ({"format": "delta", "uri": SPEC["delta"]} if SPEC.get("delta") else None)
    if spec is None:
        return {}
    if spec["format"] == "iceberg":
        return {"table": tables.iceberg(spec["identifier"], catalog=spec["catalog"], commit_interval_s=0)}
    return {"table": getattr(tables, spec["format"])(spec["uri"], commit_interval_s=0)}


def main() -> None:
    if SPEC.get("table_kill"):
        kill_around_table_transactions(SPEC["table_kill"])
    rank = int(os.environ.get("RANK", "0"))
    report = Path(SPEC["report_dir"]) / f"rank_{rank}.json"
    Path(SPEC["calls_dir"]).mkdir(parents=True, exist_ok=True)
    try:
        data = sources.parquet(SPEC["parquet"]) if SPEC.get("parquet") else dataset()
        more = {"content": ["text"]} if SPEC.get("parquet") else {}
        result = torch_batch_process(
            Processor, data, **more, batch_size=SPEC["batch_size"], checkpoint_interval=SPEC["checkpoint_interval"],
            storage_path=SPEC["storage"], key="id", version=SPEC.get("version", "v1"), progress=False,
            **table_option(), **SPEC.get("kwargs", {}),
        )
    except Exception as exc:
        write_report(report, {"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)
    write_report(report, {"rank": rank, "result": result.to_json()})


if __name__ == "__main__":
    main()
