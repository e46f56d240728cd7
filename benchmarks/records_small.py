"""Tiny-batch record job against hand-written Parquet loops (issue 32 item 3, issue 45), and shards per job (issue 28).

    python -m benchmarks.records_small                          # 1e6 rows, batches of 100, 3 rotated rounds
    python -m benchmarks.records_small --rows 100000 --rounds 1
    python -m benchmarks.records_small --ablate                 # also: the job with one of its costs taken out
    python -m benchmarks.records_small --s3-read                # also: read_outputs on S3 (moto), by layout
    python -m benchmarks.records_small --base /tmp/before        # also: another checkout's job, in the same rounds

Each measurement runs in a fresh process and times only the work (imports, ``pyarrow``'s too, and the dataset
outside the clock; ``pandas``, which ``pyarrow`` imports at its first table, inside it for every contender):

- *tbp*: ``torch_batch_process`` with a processor that ``context.write()``\\ s two columns per batch of 100 tiny
  examples (``x = batch * 2``, ``y = batch * 0.5``), default ``checkpoint_interval=5`` (2,000 commits for 1e6
  rows), local storage, Parquet;
- *hand, buffered* (the baseline: the same work as the library's shard): the same ``DataLoader`` and the same rows
  (with ``index``), buffered into row groups of :data:`~torch_batch_process.outputs.records.ROW_GROUP_BYTES` of rows
  (by Arrow bytes, as the library does) and written through one ``pyarrow.parquet.ParquetWriter`` with the
  library's writer options (snappy, page CRCs, no dictionary for numbers);
- *hand, unbuffered*: the same, a ``write_table`` (a row group) per batch: the loop most users write first.

Every round runs the contenders once each, in an order that rotates from round to round. Three clocks per run:
*job* (wall seconds of the call), *main CPU* (the calling thread's CPU seconds) and *CPU* (the whole process's,
every thread). The table gives the same-round ratios tbp / hand as median [min-max].

``--ablate``: the job again with one of the library's costs taken out, to say what each costs (a measurement aid,
never a setting: it breaks the exactly-once guarantee): ``no-commits`` (``checkpoint_interval`` past the job: one
commit at the end), ``no-segment`` (commits do not append the rows to the segment log), ``no-fsync`` (commit records
written without ``fsync``), ``no-crc`` (shards without page CRCs).

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


def _clocks() -> tuple[float, float, float]:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), time.thread_time(), usage.ru_utime + usage.ru_stime


def _since(start: tuple[float, float, float]) -> dict:
    now = _clocks()
    return {"seconds": now[0] - start[0], "main_cpu": now[1] - start[1], "cpu": now[2] - start[2]}


def _ablate(kind: str) -> dict:
    """Takes one of the library's costs out of the job (see the module docstring); returns call options."""
    if kind == "no-segment":
        from torch_batch_process.outputs.segment_log import SegmentLog

        SegmentLog.append = lambda self, table, stage: None
    elif kind == "no-fsync":
        from torch_batch_process.storage import local

        plain = local.LocalStorage.write_bytes
        local.LocalStorage.write_bytes = lambda self, rel, data, *, fsync=False: plain(self, rel, data)
    elif kind == "no-crc":
        import pyarrow.parquet as pq

        plain_init = pq.ParquetWriter.__init__

        def init(self, *args, **kwargs):
            kwargs["write_page_checksum"] = False
            plain_init(self, *args, **kwargs)

        pq.ParquetWriter.__init__ = init
    elif kind == "no-commits":
        return {"checkpoint_interval": 1 << 30}
    return {}


def two_columns_processor() -> type:
    """The library contenders' processor: ``context.write`` of two columns per batch (``x = batch * 2``,
    ``y = batch * 0.5``); built on call, so that the library is imported in the measured process only."""
    from torch_batch_process import TorchBatchProcessor

    class Write(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context

        def process_batch(self, batch, batch_idx):
            self.context.write({"x": batch * 2, "y": batch * 0.5})

    return Write


def child_tbp(rows: int, batch_size: int, storage: str, ablate: str = "") -> dict:
    import glob

    import pyarrow.parquet  # noqa: F401 - imported before the clock, as in the hand loops (the library's is lazy)

    from torch_batch_process import torch_batch_process
    from torch_batch_process.outputs.readback import OUTPUTS_GLOB

    Write = two_columns_processor()
    options = _ablate(ablate) if ablate else {}
    dataset = _dataset(rows)
    start = _clocks()
    result = torch_batch_process(
        Write, dataset, batch_size=batch_size, storage_path=storage, progress=False, **options
    )
    clocks = _since(start)
    assert result.finished
    shards = glob.glob(os.path.join(storage, OUTPUTS_GLOB + "*"))
    return {**clocks, "shards": len(shards), "commits": result.to_json().get("commits")}


def child_hand(rows: int, batch_size: int, path: str, buffered: bool) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from torch_batch_process.outputs.records import ROW_GROUP_BYTES

    dataset = _dataset(rows)
    start = _clocks()
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    writer = None
    pending: list = []
    held = 0
    for batch in loader:
        with torch.inference_mode():
            table = pa.table({"index": batch.numpy(), "x": (batch * 2).numpy(), "y": (batch * 0.5).numpy()})
        if writer is None:  # the library's shard options: snappy, page CRCs, dictionaries for text only
            writer = pq.ParquetWriter(path, table.schema, use_dictionary=False, write_page_checksum=True)
        if not buffered:
            writer.write_table(table)
            continue
        pending.append(table)
        held += table.get_total_buffer_size()
        if held >= ROW_GROUP_BYTES:
            group = pa.concat_tables(pending)
            writer.write_table(group, row_group_size=group.num_rows)
            pending, held = [], 0
    if pending:
        group = pa.concat_tables(pending)
        writer.write_table(group, row_group_size=group.num_rows)
    writer.close()
    return {**_since(start), "shards": 1}


def child_s3(rows: int, batch_size: int, url: str, per_commit: bool) -> dict:
    """Writes the job on local disk (20,000 commits against moto would take most of an hour), copies its files to
    ``url`` as they are (the layout does not depend on the backend), then times ``read_outputs(url)``."""
    if per_commit:
        os.environ["TBP_SHARD_BYTES"] = "1"
    import fsspec

    from torch_batch_process import read_outputs, torch_batch_process

    Write = two_columns_processor()
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


def _child(*args: str, tree: str = "") -> dict:
    """One measurement in a fresh process (``tree``: another checkout of the library, first on its path)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.records_small", "--child", *args],
        capture_output=True, text=True, check=False, env=env, cwd=tree or None,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


CONTENDERS = ("tbp", "buffered", "hand")
LABELS = {"tbp": "tbp", "tbp-base": "tbp, --base tree", "buffered": "hand, buffered", "hand": "hand, unbuffered"}
ABLATIONS = ("no-commits", "no-segment", "no-fsync", "no-crc")


def run_rounds(
    rows: int, batch_size: int, rounds: int, contenders: list[str], base: str = ""
) -> list[dict[str, dict]]:
    """Every contender once per round, in an order rotated per round; each in a fresh process (``base``: the
    checkout the ``tbp-base`` contender runs)."""
    from benchmarks.report import rotated

    results = []
    for r in range(rounds):
        runs: dict[str, dict] = {}
        for kind in rotated(list(contenders), r):
            with tempfile.TemporaryDirectory() as tmp:
                if kind == "tbp-base":
                    runs[kind] = _child("tbp", str(rows), str(batch_size), f"{tmp}/job", tree=base)
                elif kind == "tbp" or kind.startswith("no-"):
                    runs[kind] = _child("tbp", str(rows), str(batch_size), f"{tmp}/job", kind if kind != "tbp" else "")
                else:
                    runs[kind] = _child(kind, str(rows), str(batch_size), f"{tmp}/{kind}.parquet")
        print(f"round {r + 1}: " + ", ".join(f"{k} {v['seconds']:.2f} s" for k, v in runs.items()), file=sys.stderr)
        results.append(runs)
    return results


def ratio_spread(results: list[dict[str, dict]], mine: str, base: str, clock: str) -> list[float]:
    """The same-round ratios ``mine / base`` on ``clock``, as ``[median, min, max]``."""
    from benchmarks.report import median_spread

    return list(median_spread(r[mine][clock] / r[base][clock] for r in results if mine in r and base in r))


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import emit_figures, fmt_spread, machine, machine_line

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ablate", action="store_true", help="also run the job with each of its costs taken out")
    parser.add_argument("--s3-read", action="store_true")
    parser.add_argument("--s3-rows", type=int, default=1_000_000)
    parser.add_argument("--s3-before-rows", type=int, default=100_000, help="rows of the shard-per-commit job")
    parser.add_argument("--base", default="", help="another checkout (e.g. before a change): its job runs as the "
                        "contender tbp-base in the same rounds")
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args(argv)
    if args.child:
        kind, rows, batch, where = args.child[0], int(args.child[1]), int(args.child[2]), args.child[3]
        if kind == "tbp":
            print(json.dumps(child_tbp(rows, batch, where, args.child[4] if len(args.child) > 4 else "")))
        elif kind == "s3":
            print(json.dumps(child_s3(rows, batch, where, args.child[4] == "1")))
        else:
            print(json.dumps(child_hand(rows, batch, where, kind == "buffered")))
        return 0
    contenders = list(CONTENDERS) + (["tbp-base"] if args.base else []) + (list(ABLATIONS) if args.ablate else [])
    print(f"{args.rows:,} rows, batches of {args.batch_size}, {args.rounds} rounds (order rotated per round)")
    base = os.path.abspath(args.base) if args.base else ""
    results = run_rounds(args.rows, args.batch_size, args.rounds, contenders, base)
    print("| contender | job (s) | main CPU (s) | CPU (s) | / hand, buffered: job | main CPU | CPU | shards |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in contenders:
        runs = [r[kind] for r in results]
        cells = [fmt_spread((run[c] for run in runs), 2) for c in ("seconds", "main_cpu", "cpu")]
        clocks = ("seconds", "main_cpu", "cpu")
        ratios = [fmt_spread([r[kind][c] / r["buffered"][c] for r in results], 2) for c in clocks]
        shards = runs[0].get("shards", "")
        print(f"| {LABELS.get(kind, 'tbp, ' + kind)} | {' | '.join(cells)} | {' | '.join(ratios)} | {shards} |")
    print(f"\nMedian [min–max] over {args.rounds} rounds, ratios within a round. Machine: {machine_line(machine())}.")
    figures = {
        "records_small.tbp_over_buffered.job": ratio_spread(results, "tbp", "buffered", "seconds"),
        "records_small.tbp_over_buffered.main_cpu": ratio_spread(results, "tbp", "buffered", "main_cpu"),
        "records_small.tbp_over_buffered.cpu": ratio_spread(results, "tbp", "buffered", "cpu"),
        "records_small.tbp_over_unbuffered.job": ratio_spread(results, "tbp", "hand", "seconds"),
    }
    for kind in ABLATIONS if args.ablate else ():
        figures[f"records_small.{kind}_over_tbp.main_cpu"] = ratio_spread(results, kind, "tbp", "main_cpu")
    if args.base:
        figures["records_small.tbp_over_base.job"] = ratio_spread(results, "tbp", "tbp-base", "seconds")
        figures["records_small.tbp_over_base.main_cpu"] = ratio_spread(results, "tbp", "tbp-base", "main_cpu")
        print("tbp / the --base tree's, same round: " + "; ".join(
            f"{label} {fmt_spread([r['tbp'][c] / r['tbp-base'][c] for r in results], 3)}"
            for label, c in (("job", "seconds"), ("main CPU", "main_cpu"), ("CPU", "cpu"))))
    emit_figures(figures)
    if args.s3_read:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from s3 import MotoServer  # the tests' moto server on 127.0.0.1

        server = MotoServer()
        os.environ.update(server.env())
        try:
            print("\nread_outputs on S3 (moto), jobs in batches of 10 with checkpoint_interval=5 "
                  "(a commit per 50 rows)")
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
