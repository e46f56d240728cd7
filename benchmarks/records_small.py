"""Tiny-batch record job against hand-written Parquet loops (issue 32 item 3), and shards per job (issue 28 item 1).

    python -m benchmarks.records_small                          # 1e6 rows, batches of 100, 3 interleaved rounds
    python -m benchmarks.records_small --rows 100000 --rounds 1
    python -m benchmarks.records_small --s3-read               # also: read_outputs on S3 (moto), this layout vs one shard per commit

Each measurement runs in a fresh process and times only the work (imports and the dataset outside the clock):

- *tbp*: ``torch_batch_process`` with a processor that ``context.write()``\\ s two columns per batch of 100 tiny
  examples (``x = batch * 2``, ``y = batch * 0.5``), default ``checkpoint_interval=5`` (2,000 commits for 1e6
  rows), local storage, Parquet;
- *hand*: the same ``DataLoader`` and the same rows (with ``index``) written through one
  ``pyarrow.parquet.ParquetWriter``, a ``write_table`` per batch;
- *hand, buffered*: the same, buffering rows into row groups of 64k rows (the fastest hand loop).

The table gives seconds per round and the ratio tbp / hand within each round (the machine's speed drifts, so only
same-round ratios are compared), plus the record shards the job left (``outputs/**/records/part-*``).

``--s3-read``: ``read_outputs`` timed on S3 (a moto server on 127.0.0.1) for jobs in batches of 10
(``checkpoint_interval=5``: a commit per 50 rows): 1e6 rows (20,000 commits) in this layout, and 1e5 rows (2,000
commits) in this layout and with ``TBP_SHARD_BYTES=1`` (a shard per commit: the file layout before segments). Each
job is written on local disk and its files copied to the bucket as they are (20,000 commits against moto, a Python
server, would take most of an hour; the stored layout does not depend on the backend).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _dataset(rows: int):
    import torch

    return torch.arange(rows)


def child_tbp(rows: int, batch_size: int, storage: str) -> dict:
    import glob

    from torch_batch_process import TorchBatchProcessor, torch_batch_process
    from torch_batch_process.outputs.readback import OUTPUTS_GLOB

    class Write(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context

        def process_batch(self, batch, batch_idx):
            self.context.write({"x": batch * 2, "y": batch * 0.5})

    dataset = _dataset(rows)
    t0 = time.perf_counter()
    result = torch_batch_process(Write, dataset, batch_size=batch_size, storage_path=storage, progress=False)
    seconds = time.perf_counter() - t0
    assert result.finished
    shards = glob.glob(os.path.join(storage, OUTPUTS_GLOB + "*"))
    return {"seconds": seconds, "shards": len(shards), "commits": result.to_json().get("commits")}


def child_hand(rows: int, batch_size: int, path: str, buffered: bool) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    dataset = _dataset(rows)
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    writer = None
    pending: list = []
    held = 0
    for batch in loader:
        with torch.inference_mode():
            table = pa.table({"index": batch.numpy(), "x": (batch * 2).numpy(), "y": (batch * 0.5).numpy()})
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        if not buffered:
            writer.write_table(table)
            continue
        pending.append(table)
        held += table.num_rows
        if held >= 65536:
            writer.write_table(pa.concat_tables(pending))
            pending, held = [], 0
    if pending:
        writer.write_table(pa.concat_tables(pending))
    writer.close()
    return {"seconds": time.perf_counter() - t0, "shards": 1}


def child_s3(rows: int, batch_size: int, url: str, per_commit: bool) -> dict:
    """Writes the job on local disk (20,000 commits against moto would take most of an hour), copies its files to
    ``url`` as they are (the layout does not depend on the backend), then times ``read_outputs(url)``."""
    if per_commit:
        os.environ["TBP_SHARD_BYTES"] = "1"
    import fsspec

    from torch_batch_process import TorchBatchProcessor, read_outputs, torch_batch_process

    class Write(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context

        def process_batch(self, batch, batch_idx):
            self.context.write({"x": batch * 2, "y": batch * 0.5})

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        torch_batch_process(Write, _dataset(rows), batch_size=batch_size, storage_path=f"{tmp}/job", progress=False)
        job = time.perf_counter() - t0
        fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, use_listings_cache=False)
        t0 = time.perf_counter()
        fs.put(f"{tmp}/job/", root, recursive=True)
        upload = time.perf_counter() - t0
    shards = len(fs.glob(f"{root}/outputs/commit_*/rank_*/records/part-*"))
    t0 = time.perf_counter()
    table = read_outputs(url)
    read = time.perf_counter() - t0
    assert table.num_rows == rows and table.column("index").to_pylist() == list(range(rows))
    return {"job": job, "upload": upload, "read": read, "shards": shards}


def _child(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.records_small", "--child", *args],
        capture_output=True, text=True, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--s3-read", action="store_true")
    parser.add_argument("--s3-rows", type=int, default=1_000_000)
    parser.add_argument("--s3-before-rows", type=int, default=100_000, help="rows of the shard-per-commit job")
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args(argv)
    if args.child:
        kind, rows, batch, where = args.child[0], int(args.child[1]), int(args.child[2]), args.child[3]
        if kind == "tbp":
            print(json.dumps(child_tbp(rows, batch, where)))
        elif kind == "s3":
            print(json.dumps(child_s3(rows, batch, where, args.child[4] == "1")))
        else:
            print(json.dumps(child_hand(rows, batch, where, kind == "buffered")))
        return 0
    print(f"{args.rows} rows, batches of {args.batch_size}, {args.rounds} rounds (interleaved)")
    print("| round | tbp (s) | hand (s) | hand, buffered (s) | tbp / hand | tbp / buffered | shards |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory() as tmp:
            tbp = _child("tbp", str(args.rows), str(args.batch_size), f"{tmp}/job")
            hand = _child("hand", str(args.rows), str(args.batch_size), f"{tmp}/hand.parquet")
            buffered = _child("buffered", str(args.rows), str(args.batch_size), f"{tmp}/buffered.parquet")
        print(
            f"| {r} | {tbp['seconds']:.2f} | {hand['seconds']:.2f} | {buffered['seconds']:.2f} | "
            f"{tbp['seconds'] / hand['seconds']:.2f} | {tbp['seconds'] / buffered['seconds']:.2f} | {tbp['shards']} |",
            flush=True,
        )
    if args.s3_read:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from s3 import MotoServer  # the tests' moto server on 127.0.0.1

        server = MotoServer()
        os.environ.update(server.env())
        try:
            print("\nread_outputs on S3 (moto), jobs in batches of 10 with checkpoint_interval=5 (a commit per 50 rows)")
            print("| rows | layout | commits | shards | read_outputs (s) |")
            print("|---:|---|---:|---:|---:|")
            cases = [(args.s3_before_rows, "a shard per commit (before)", "1"),
                     (args.s3_before_rows, "segments + shards by size", "0"),
                     (args.s3_rows, "segments + shards by size", "0")]
            for rows, label, per_commit in cases:
                url = f"s3://{server.new_bucket()}/job"
                res = _child("s3", str(rows), "10", url, per_commit)
                print(f"| {rows} | {label} | {rows // 50} | {res['shards']} | {res['read']:.2f} |", flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
