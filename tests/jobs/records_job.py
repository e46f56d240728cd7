"""A job writing record outputs (``context.write``), run in real worker processes by tests/test_records.py.

The spec comes as JSON in argv[1]: ``n``, ``batch_size``, ``checkpoint_interval``, ``storage``, ``kwargs``
(more options of torch_batch_process), ``sleep`` (seconds per batch), ``progress_file`` (touched after each
batch, for tests that kill workers), ``report_dir``, ``die_at`` (the process SIGKILLs itself at that moment of a
shard roll-over, see :func:`die_at`; ``die_after`` commits first); ``mode="predict"`` calls ``predict`` instead and stores
what it returned on each rank. Example ``i`` gets the row ``emb=[i, i+0.5, -i]``, ``label="ex<i>"``,
``parts=[i] * (i % 3)`` (with ``plain=True`` instead ``x=2i`` and ``y=i/2``, tensors of one number per example: the
short way of ``context.write``); with ``conflict=True`` rank 1 writes ``label`` as ints (each rank sees one type). An
error is stored in the report (``error``: type and message) and the process exits with status 1.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from report_file import write_report

from torch_batch_process import TorchBatchProcessor, predict, torch_batch_process

SPEC = json.loads(sys.argv[1])


class Processor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        values = [int(v) for v in batch]
        ints = SPEC.get("conflict") and self.context.distributed.get_rank() == 1
        assert values == list(self.context.batch_indices), (values, list(self.context.batch_indices))
        if SPEC.get("plain"):  # one number per example in each column: context.write's short way (plain_columns.py)
            ids = torch.tensor(values)
            self.context.write({"x": ids * 2, "y": ids.float() / 2})
        else:
            self._write_rich(values, ints)
        if SPEC.get("sleep"):
            time.sleep(SPEC["sleep"])
        if SPEC.get("progress_file"):
            Path(SPEC["progress_file"]).touch()

    def _write_rich(self, values, ints):
        self.context.write(
            {
                "emb": torch.stack([torch.tensor([v, v + 0.5, -v]) for v in values]),
                "label": values if ints else [f"ex{v}" for v in values],
                "parts": [[v] * (v % 3) for v in values],
            }
        )


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_at(moment: str, after: int) -> None:
    """Makes this process SIGKILL itself at ``moment`` of the first shard roll-over after commit ``after``
    (fault injection around the library's own calls; nothing of it is replaced):

    - ``before_record``: the shard is sealed into its stage, its commit record is not written;
    - ``before_publish``: the record is durable, the stage (with the shard) is not published;
    - ``mid_delete``: the shard is published, one of the segments it holds is deleted, the others not (a segment log,
      one per shard: not deleted);
    - ``roll_at_start``: at the next start, the leftover segments' shard is published, none of them deleted;
    - ``mid_append`` (not at a roll-over): the first append to a segment log after commit ``after`` (of the stage being
      sealed, before its vote) is cut off halfway: half of its first record batch's bytes reach the file;
    - ``after_slow_append`` (one process, whose appends are its encoder thread's): every append of a stage after
      ``after`` takes 0.2 s longer, and the process dies just after the first record that commits such a stage.
    """
    from torch_batch_process.jobstore.store import JobStore
    from torch_batch_process.outputs import segments
    from torch_batch_process.outputs.records import RecordWriter

    def staged_shard(store, stage):
        return any(store.storage.list(f"_tbp/staging/{stage:08d}/rank_{r}/records") for r in range(4))

    if moment == "before_record":
        write_record = JobStore.write_record

        def record(self, rec):
            if rec.commit > after and staged_shard(self, rec.commit):
                _die()
            write_record(self, rec)

        JobStore.write_record = record
    elif moment == "before_publish":
        publish = JobStore.publish

        def publish_stage(self, stage, rank=None, **kw):
            if stage > after and staged_shard(self, stage):
                _die()
            publish(self, stage, rank, **kw)

        JobStore.publish = publish_stage
    elif moment == "mid_delete":
        published = RecordWriter.published

        def delete(self, stage):
            doomed = self._doomed.get(stage) or []
            if stage > after and doomed:  # a segment log per shard: killed before deleting it; else after the first
                self._stager.storage.delete_files(doomed[:1] if len(doomed) > 1 else [])
                _die()
            published(self, stage)

        RecordWriter.published = delete
    elif moment == "roll_at_start":
        roll = segments._roll

        class KillOnDelete:
            def __init__(self, storage):
                self._storage = storage

            def __getattr__(self, name):
                return getattr(self._storage, name)

            def delete_files(self, rels):
                _die()

        segments._roll = lambda storage, *args: roll(KillOnDelete(storage), *args)
    elif moment == "mid_append":
        import pyarrow as pa

        from torch_batch_process.outputs.segment_log import STAGE_KEY, SegmentLog

        append = SegmentLog.append

        def torn(self, table, stage):
            if stage <= after or self._writer is None:
                return append(self, table, stage)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_batch(table.to_batches()[0], custom_metadata={STAGE_KEY: str(stage).encode()})
            schema_bytes = self._schema.serialize().size
            message = sink.getvalue().to_pybytes()[schema_bytes:-8]  # the batch's message: no schema, no end
            with open(self.path, "ab") as f:
                f.write(message[: len(message) // 2])
            _die()

        SegmentLog.append = torn
    elif moment == "after_slow_append":
        import time

        from torch_batch_process.outputs.segment_log import SegmentLog

        append = SegmentLog.append

        def late(self, table, stage):
            if stage > after:
                time.sleep(0.2)
            append(self, table, stage)

        SegmentLog.append = late
        write_record = JobStore.write_record

        def record_then_die(self, rec):
            write_record(self, rec)
            if rec.commit > after:
                _die()

        JobStore.write_record = record_then_die
    else:
        raise ValueError(moment)


def main():
    if SPEC.get("die_at"):
        die_at(SPEC["die_at"], SPEC.get("die_after", 0))
    rank = int(os.environ.get("RANK", "0"))
    dataset = list(range(SPEC["n"]))
    report = {"rank": rank}
    if SPEC.get("mode") == "predict":
        out = predict(lambda b: torch.stack([b.float(), b.float() * 2], dim=1), dataset, SPEC["batch_size"],
                      checkpoint_interval=SPEC.get("checkpoint_interval", 2))
        report["predicted"] = out.tolist()
    else:
        try:
            result = torch_batch_process(
                Processor,
                dataset,
                batch_size=SPEC["batch_size"],
                checkpoint_interval=SPEC.get("checkpoint_interval", 2),
                storage_path=SPEC["storage"],
                progress=False,
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
