"""Record outputs at scale: 1e6 rows of 384-float embeddings written by one process, then read back.

    nice python -m benchmarks.records                    # 1e5 and 1e6 rows, batches of 256
    python -m benchmarks.records --rows 100000,1000000 --batch-size 256 --minilm-batch-s 0.55

Each measurement runs in a fresh process (peak RSS is the process's ``ru_maxrss``):

- *write*: ``torch_batch_process`` with a processor that ``context.write()``\\ s a ``(batch, 384)`` float32 tensor
  per batch (a fixed tensor: no random numbers on the clock), ``checkpoint_interval=50``, local storage; the
  same job with the write left out is the baseline. Write cost per batch = (job seconds - baseline seconds) /
  batches; it is compared with the time of one MiniLM batch (``--minilm-batch-s``: 32 sentences on this
  machine's CPU, BENCHMARKS.md; a GPU batch is shorter, see the printed per-batch cost in microseconds).
- *read_outputs*: the whole table sorted by ``index`` (seconds, peak RSS).
- *iter_outputs*: every record batch in order, nothing kept (seconds, peak RSS; flat means bounded memory).
- *tables* (``--tables delta,iceberg,lance``, each format whose package is installed): the same write job with
  ``table=tables.<format>(...)`` (a local table; Iceberg on a SQL catalog in sqlite), in the same round as the
  Parquet-shard job; its write cost per row (job seconds - no-write seconds) is divided by the shards' one from
  the same round (goal <= 1.2x), in wall time and in CPU time (the process's, all threads: what the other users
  of a shared machine disturb least), and the table's data files before and after compaction are counted
  (the table is written with ``compact=False`` and compacted after the job, on a clock of its own).

    python -m benchmarks.records --rows 100000 --tables delta,iceberg,lance --rounds 3
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIM = 384


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_target(kind: str, root: str) -> object:
    from torch_batch_process import tables

    if kind == "delta":  # compact=False: the child compacts after the job, on a clock of its own
        return tables.delta(f"{root}/delta", compact=False)
    if kind == "iceberg":
        Path(root).mkdir(parents=True, exist_ok=True)  # sqlite makes the file, not its folder
        catalog = {"type": "sql", "uri": f"sqlite:///{root}/catalog.db", "warehouse": f"file://{root}/warehouse"}
        return tables.iceberg("bench.rows", catalog=catalog, compact=False)
    return tables.lance(f"{root}/rows.lance", compact=False)


def child_write(rows: int, batch_size: int, storage: str, write: bool, table: str = "") -> dict:
    import torch

    from torch_batch_process import TorchBatchProcessor, torch_batch_process

    base = torch.randn(batch_size, DIM)

    class Embed(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context

        def process_batch(self, batch, batch_idx):
            emb = base[: len(batch)] + float(batch_idx)
            if write:
                self.context.write({"embedding": emb})

    target = make_target(table, storage + "-table") if table else None
    if target is not None:
        target.check()  # imports the format's package: not on the clock, as torch's import is not
    t0, c0 = time.perf_counter(), time.process_time()
    result = torch_batch_process(Embed, range(rows), batch_size=batch_size, checkpoint_interval=50,
                                 storage_path=storage, progress=False, dataloader_kwargs={"collate_fn": list},
                                 table=target)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    assert result.finished
    files = compact_s = compact_cpu_s = files_before = 0
    if target is not None:  # what a finished job does when compact=True (the default), timed apart
        opened = target.open()
        files_before = opened.live_files()
        t1, c1 = time.perf_counter(), time.process_time()
        opened.compact()
        compact_s, compact_cpu_s = time.perf_counter() - t1, time.process_time() - c1
        files = opened.live_files()
    return {"seconds": seconds, "cpu_s": cpu_s, "peak_rss_mib": _peak_mib(), "batches": result.num_batches,
            "compact_s": compact_s, "compact_cpu_s": compact_cpu_s, "files_before_compaction": files_before,
            "process_s": result.timings.get("process", 0.0), "commit_s": result.timings.get("commit", 0.0),
            "files_after_compaction": files, "commits": result.to_json().get("commits")}


def child_read(storage: str, how: str) -> dict:
    import pyarrow.parquet  # noqa: F401 - imports are not on the clock

    from torch_batch_process import iter_outputs, read_outputs

    t0 = time.perf_counter()
    if how == "read":
        table = read_outputs(storage)
        rows = table.num_rows
        ordered = table.column("index").to_numpy()
        assert (ordered[1:] > ordered[:-1]).all()
    else:
        rows, last = 0, -1
        for batch in iter_outputs(storage):
            index = batch.column(0).to_numpy()
            assert index[0] > last
            last = int(index[-1])
            rows += batch.num_rows
    return {"seconds": time.perf_counter() - t0, "peak_rss_mib": _peak_mib(), "rows": rows}


def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.records", "--child", *args], capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--minilm-batch-s", type=float, default=0.55,
                        help="seconds of one MiniLM batch of 32 on this machine (BENCHMARKS.md: ~58 examples/s)")
    parser.add_argument("--tables", default="", help="also write to these table formats (delta,iceberg,lance)")
    parser.add_argument("--rounds", type=int, default=1, help="--tables: rounds (ratios are per round, then median)")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        kind, *rest = args.child
        if kind == "write":
            print(json.dumps(child_write(int(rest[0]), int(rest[1]), rest[2], rest[3] == "1", *rest[4:])))
        else:
            print(json.dumps(child_read(rest[0], kind)))
        return 0
    sizes = [int(float(s)) for s in args.rows.split(",")]
    if args.tables:
        return compare_tables(sizes, args.batch_size, [t for t in args.tables.split(",") if t], args.rounds)
    table = []
    with tempfile.TemporaryDirectory(prefix="tbp-records-") as scratch:
        for n in sizes:
            storage = str(Path(scratch) / f"job-{n}")
            base = _child("write", str(n), str(args.batch_size), str(Path(scratch) / f"base-{n}"), "0")
            wrote = _child("write", str(n), str(args.batch_size), storage, "1")
            read = _child("read", storage)
            it = _child("iter", storage)
            size = sum(p.stat().st_size for p in Path(storage, "outputs").rglob("*.parquet"))
            per_batch = (wrote["seconds"] - base["seconds"]) / wrote["batches"]
            per_row = per_batch / args.batch_size
            in_batch = (wrote["process_s"] - base["process_s"]) / wrote["batches"]  # on the batch's path
            in_commit = (wrote["commit_s"] - base["commit_s"]) / wrote["batches"]  # closing shards, amortized
            table.append({
                "rows": n, "mib": size / 2**20, "write_s": wrote["seconds"], "base_s": base["seconds"],
                "rows_per_s": n / wrote["seconds"], "mib_per_s": size / 2**20 / wrote["seconds"],
                "write_cost_us_per_batch": per_batch * 1e6, "write_cost_us_per_32_rows": per_row * 32 * 1e6,
                "in_batch_us": in_batch * 1e6, "in_commit_us": in_commit * 1e6,
                "write_rss_mib": wrote["peak_rss_mib"], "base_rss_mib": base["peak_rss_mib"],
                "read_s": read["seconds"], "read_rss_mib": read["peak_rss_mib"],
                "iter_s": it["seconds"], "iter_rss_mib": it["peak_rss_mib"],
            })
            print(json.dumps(table[-1]), file=sys.stderr)
    print(f"\n{DIM}-float32 embeddings, 1 process, batches of {args.batch_size}, checkpoint_interval=50, local storage")
    print("| rows | Parquet MiB | write s (no-write job s) | rows/s | MiB/s | write cost per batch (in process_batch + in commits) | peak RSS write (no-write) "
          "| read_outputs s | read_outputs peak RSS | iter_outputs s | iter_outputs peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['rows']:,} | {r['mib']:.0f} | {r['write_s']:.1f} ({r['base_s']:.1f}) | {r['rows_per_s']:,.0f} | "
              f"{r['mib_per_s']:.0f} | {r['write_cost_us_per_batch']:.0f} us ({r['in_batch_us']:.0f} + {r['in_commit_us']:.0f}) | {r['write_rss_mib']:.0f} MiB "
              f"({r['base_rss_mib']:.0f}) | {r['read_s']:.2f} | {r['read_rss_mib']:.0f} MiB | {r['iter_s']:.2f} | "
              f"{r['iter_rss_mib']:.0f} MiB |")
    if len(table) > 1:
        first, last = table[0], table[-1]
        print(f"\npeak RSS growth {first['rows']:,} -> {last['rows']:,} rows: write "
              f"{last['write_rss_mib'] / first['write_rss_mib'] - 1:+.1%}, iter_outputs "
              f"{last['iter_rss_mib'] / first['iter_rss_mib'] - 1:+.1%} (goal <= 5%)")
        cost = last["write_cost_us_per_32_rows"] / 1e6
        print(f"write cost of a MiniLM batch (32 rows): {cost * 1e6:.0f} us = {cost / args.minilm_batch_s:.2%} of a "
              f"{args.minilm_batch_s:.2f} s CPU MiniLM batch (goal <= 3%)")
    return 0


def compare_tables(sizes: list[int], batch_size: int, kinds: list[str], rounds: int) -> int:
    """Write cost per row of each table format against the Parquet shards, same-round ratios (module docstring)."""
    import statistics

    results: dict[tuple[int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tbp-tables-") as scratch:
        for n in sizes:
            for r in range(rounds):
                def run(name: str, write: bool, kind: str = "") -> dict:
                    folder = str(Path(scratch) / f"{name}-{n}-{r}")
                    return _child("write", str(n), str(batch_size), folder, "1" if write else "0", *([kind] if kind else []))

                base = run("base", False)
                shards = run("shards", True)
                shard_cost = shards["seconds"] - base["seconds"]
                for kind in kinds:
                    wrote = run(kind, True, kind)
                    entry = dict(wrote, base_s=base["seconds"], shards_s=shards["seconds"],
                                 ratio=(wrote["seconds"] - base["seconds"]) / shard_cost,
                                 base_cpu_s=base["cpu_s"], shards_cpu_s=shards["cpu_s"],
                                 cpu_ratio=(wrote["cpu_s"] - base["cpu_s"]) / (shards["cpu_s"] - base["cpu_s"]))
                    results.setdefault((n, kind), []).append(entry)
                    print(json.dumps({"rows": n, "round": r, "format": kind, **entry}), file=sys.stderr)
    print(f"\n{DIM}-float32 embeddings, 1 process, batches of {batch_size}, checkpoint_interval=50, local storage; "
          f"{rounds} round(s), median of the same-round ratios")
    print("| rows | table | write job s (Parquet shards s, no-write s) | write cost per row: table, shards "
          "| table / shards (each round) | CPU time: table / shards (each round) | compaction s (per row) "
          "| with compaction / shards, CPU time | commits | data files before -> after compaction |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (n, kind), entries in results.items():
        mid = sorted(entries, key=lambda e: e["ratio"])[len(entries) // 2]
        per_row = (mid["seconds"] - mid["base_s"]) / n * 1e6
        shard_row = (mid["shards_s"] - mid["base_s"]) / n * 1e6
        with_compaction = statistics.median(  # CPU time, as the ratio before it
            (e["cpu_s"] + e["compact_cpu_s"] - e["base_cpu_s"]) / (e["shards_cpu_s"] - e["base_cpu_s"]) for e in entries
        )
        print(f"| {n:,} | {kind} | {mid['seconds']:.2f} ({mid['shards_s']:.2f}, {mid['base_s']:.2f}) | "
              f"{per_row:.1f} us, {shard_row:.1f} us | {statistics.median(e['ratio'] for e in entries):.2f}x "
              f"({', '.join(format(e['ratio'], '.2f') for e in entries)}) | "
              f"{statistics.median(e['cpu_ratio'] for e in entries):.2f}x "
              f"({', '.join(format(e['cpu_ratio'], '.2f') for e in entries)}) | {mid['compact_s']:.2f} "
              f"({mid['compact_s'] / n * 1e6:.1f} us) | {with_compaction:.2f}x | {mid['commits']} | "
              f"{mid['files_before_compaction']} -> {mid['files_after_compaction']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
