"""The incremental planner at scale (DESIGN §21, issue 46): time and peak memory of planning a rerun.

    python -m benchmarks.incremental                       # 10^5, 10^6, 10^7 int keys; str keys; 3 rounds
    python -m benchmarks.incremental --sizes 1e7 --keys int --rounds 1
    python -m benchmarks.incremental --hash-only            # the content hash's cost per example

The scenario of the issue: a job stored ``N`` rows (one run, keys ``0..N-1``, or ``"doc-000000000042"`` strings); the
rerun's dataset has those ``N`` keys with 10% of their contents changed, plus ``N/10`` new keys. Both sides are
written first to Arrow IPC files (as a source's key and content-hash columns and the stored shards' key columns
would be read), in batches of 2**20 rows; then, in a fresh process per measurement, the contender reads them batch
by batch and finds the examples to run (``0.2 N``) and the removed keys (none here). Clocks: *plan s* is the wall
time of that (reading the files included); *CPU s* is the process's CPU time (user + system, all threads: steadier
than wall time on a loaded machine); *peak MiB* is the process's peak resident memory during it over its
resident memory before (``VmHWM`` after resetting it; inputs are read into memory, never memory-mapped, so every
byte read counts); *base MiB* is that resident memory before (Python, numpy, pyarrow).

Contenders, in rotated order each round:

- ``planner``: :func:`torch_batch_process.outputs.keyed.diff.plan_increment` (partitions spilled to local files;
  ``rows_per_partition`` 2**21);
- ``in memory``: the hand-written way: every key of both sides concatenated in memory, then numpy (int keys: sort
  and ``searchsorted``) or pyarrow's hash join (str keys). Its memory grows with the keys: the comparison point.

With ``--hash-only``: CPU microseconds per example of
:func:`~torch_batch_process.outputs.keyed.content_hash.content_hash` for a few example shapes (median [min-max] of
rounds), in one process.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

BATCH = 1 << 20
CONTENDERS = ("planner", "in memory")


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _keys(first: int, count: int, kind: str) -> pa.Array:
    ints = pa.array(np.arange(first, first + count, dtype=np.int64))
    if kind == "int":
        return ints
    return pc.binary_join_element_wise("doc-", pc.utf8_lpad(pc.cast(ints, pa.string()), 12, "0"), "")


def _hashes(first: int, count: int, changed: bool) -> np.ndarray:
    keys = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        hashes = (keys * np.uint64(0x9E3779B97F4A7C15)).view(np.int64).copy()
    if changed:
        hashes[(keys % np.uint64(10)) == 3] += 1  # 10% of the stored keys changed
    return hashes


def write_inputs(folder: Path, n: int, kind: str) -> None:
    """``stored.arrows`` (key, hash, run, version, failed) and ``new.arrows`` (key, hash) of the scenario."""
    stored_schema = pa.schema([("key", pa.int64() if kind == "int" else pa.string()), ("hash", pa.int64()),
                               ("run", pa.int32()), ("version", pa.string()), ("failed", pa.bool_())])
    with pa.ipc.new_stream(str(folder / "stored.arrows"), stored_schema) as writer:
        for first in range(0, n, BATCH):
            count = min(BATCH, n - first)
            writer.write_batch(pa.record_batch([
                _keys(first, count, kind), pa.array(_hashes(first, count, False)),
                pa.array(np.ones(count, np.int32)), pa.array(["v1"] * count), pa.array(np.zeros(count, bool)),
            ], schema=stored_schema))
    total = n + n // 10
    new_schema = pa.schema([("key", stored_schema.field("key").type), ("hash", pa.int64())])
    with pa.ipc.new_stream(str(folder / "new.arrows"), new_schema) as writer:
        for first in range(0, total, BATCH):
            count = min(BATCH, total - first)
            writer.write_batch(pa.record_batch(
                [_keys(first, count, kind), pa.array(_hashes(first, count, True))], schema=new_schema
            ))


def _read(path: Path):
    with pa.OSFile(str(path)) as source:
        yield from pa.ipc.open_stream(source)


def _planner(folder: Path, n: int) -> dict[str, int]:
    import os

    from torch_batch_process.outputs.keyed.diff import ROWS_PER_PARTITION, plan_increment

    increment = plan_increment(
        _read(folder / "new.arrows"), _read(folder / "stored.arrows"), new_rows=n + n // 10, stored_rows=n,
        version="v1", scratch=str(folder),
        rows_per_partition=int(os.environ.get("TBP_BENCH_ROWS_PER_PARTITION", ROWS_PER_PARTITION)),
    )
    return {"selected": increment.selection.count, "removed": increment.counts.removed}


def _in_memory(folder: Path, n: int) -> dict[str, int]:
    new = pa.ipc.open_stream(pa.OSFile(str(folder / "new.arrows"))).read_all()
    stored = pa.ipc.open_stream(pa.OSFile(str(folder / "stored.arrows"))).read_all().select(["key", "hash"])
    if pa.types.is_integer(new.schema.field("key").type):
        new_keys, stored_keys = new.column("key").to_numpy(), stored.column("key").to_numpy()
        if len(np.unique(new_keys)) != len(new_keys):
            raise ValueError("duplicate keys")
        order = np.argsort(stored_keys, kind="stable")
        ordered = stored_keys[order]
        at = np.minimum(np.searchsorted(ordered, new_keys), len(ordered) - 1)
        matched = ordered[at] == new_keys
        stored_hash = stored.column("hash").to_numpy()[order][at]
        run = ~matched | (stored_hash != new.column("hash").to_numpy())
        in_new = np.zeros(len(ordered), bool)
        in_new[at[matched]] = True
        return {"selected": int(run.sum()), "removed": int((~in_new).sum())}
    if pc.count_distinct(new.column("key")).as_py() != new.num_rows:
        raise ValueError("duplicate keys")
    new = new.append_column("index", pa.array(np.arange(new.num_rows)))
    joined = new.join(stored.rename_columns(["key", "stored_hash"]), "key", join_type="left outer")
    stored_hash = joined.column("stored_hash")
    run = pc.or_(pc.is_null(stored_hash), pc.not_equal(stored_hash, joined.column("hash")).fill_null(True))
    removed = stored.join(new.select(["key"]), "key", join_type="left anti").num_rows
    return {"selected": pc.sum(run).as_py(), "removed": removed}


def one(folder: Path, n: int, contender: str) -> dict[str, float]:
    """Runs one contender in this (fresh) process; returns its figures."""
    base = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    started, cpu = time.perf_counter(), _cpu()
    found = (_planner if contender == "planner" else _in_memory)(folder, n)
    seconds, cpu = time.perf_counter() - started, _cpu() - cpu
    expected = n // 10 * 2
    if found["selected"] != expected or found["removed"] != 0:
        raise AssertionError(f"{contender}: found {found}, expected {expected} selected, 0 removed")
    return {"seconds": seconds, "cpu": cpu, "peak_mib": _status_mib("VmHWM") - base, "base_mib": base}


def _cpu() -> float:
    """CPU seconds of this process (user + system, every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def hash_costs(rounds: int) -> None:
    """Prints microseconds per example of the content hash for a few example shapes."""
    import torch

    from torch_batch_process.outputs.keyed.content_hash import content_hash

    rng = np.random.default_rng(0)
    text = "".join(chr(c) for c in rng.integers(97, 123, 1000))
    shapes = {
        "dict: int id + 200-char text": ({"id": 12345, "text": text[:200]}, 20000),
        "dict: id + 1000-char text + label": ({"id": 7, "text": text, "label": "positive"}, 20000),
        "dict: id + 512 int64 token ids (numpy)": ({"id": 3, "input_ids": rng.integers(0, 30000, 512)}, 20000),
        "tensor 3x224x224 uint8 (an image)": (torch.zeros(3, 224, 224, dtype=torch.uint8), 2000),
        "tuple (tensor 3x32x32 float32, int label)": ((torch.rand(3, 32, 32), 4), 20000),
    }
    print(f"content hash, CPU microseconds per example ({rounds} rounds, median [min-max]):")
    print(f"| {'example':44} | {'bytes':>8} | {'CPU us/example':>22} |")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 24}|")
    from torch_batch_process.outputs.keyed.content_hash import encode

    for name, (example, count) in shapes.items():
        times = []
        for _ in range(rounds):
            started = time.process_time()  # CPU time of this process: steadier than wall time on a loaded machine
            for _ in range(count):
                content_hash(example)
            times.append((time.process_time() - started) / count * 1e6)
        print(f"| {name:44} | {len(encode(example)):>8} | {_spread(times, 2):>22} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1e5,1e6,1e7", help="stored keys N, comma-separated")
    parser.add_argument("--keys", default="int,str", help="key kinds: int, str")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--hash-only", action="store_true")
    parser.add_argument("--one", nargs=3, metavar=("FOLDER", "N", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(Path(args.one[0]), int(args.one[1]), args.one[2])))
        return 0
    if args.hash_only:
        hash_costs(args.rounds)
        return 0
    contenders = args.contenders.split(",")
    print(f"| {'keys':>12} | {'kind':4} | {'contender':9} | {'plan s (wall)':>20} | {'CPU s':>20} | "
          f"{'peak MiB':>17} | {'base MiB':>8} |")
    print(f"|{'-' * 14}|{'-' * 6}|{'-' * 11}|{'-' * 22}|{'-' * 22}|{'-' * 19}|{'-' * 10}|")
    for kind in args.keys.split(","):
        for size in args.sizes.split(","):
            n = int(float(size))
            with tempfile.TemporaryDirectory(prefix="tbp-bench-incr-") as tmp:
                folder = Path(tmp)
                write_inputs(folder, n, kind)
                results: dict[str, list[dict[str, float]]] = {c: [] for c in contenders}
                for r in range(args.rounds):
                    for contender in contenders[r % len(contenders):] + contenders[: r % len(contenders)]:
                        done = subprocess.run(
                            [sys.executable, "-m", "benchmarks.incremental", "--one", tmp, str(n), contender],
                            check=True, capture_output=True, text=True,
                        )
                        results[contender].append(json.loads(done.stdout.strip().splitlines()[-1]))
                for contender in contenders:
                    rows = results[contender]
                    print(
                        f"| {n:>12,} | {kind:4} | {contender:9} | {_spread([x['seconds'] for x in rows], 2):>20} | "
                        f"{_spread([x['cpu'] for x in rows], 2):>20} | {_spread([x['peak_mib'] for x in rows], 0):>17} "
                        f"| {statistics.median(x['base_mib'] for x in rows):>8.0f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
