"""One ``bucket_by`` plan over N lengths, in a fresh process: its time and peak memory (``python -m benchmarks.scale``).

    python -m benchmarks.scale_plan --n 100000000 --source arrow-chunked --report plan.json

The lengths are made first (sentence-like token counts: log-normal, median ~20, capped at 512, as ``int32``), then
the process's peak memory is reset and the plan is computed the way a call computes it: ``resolve_lengths`` of the
given ``bucket_by``, the plan (its layout and fingerprint), and its description for the start-up log line (padded
tokens). *Peak* is the process's peak resident memory during that, over its resident memory before (the lengths
themselves are the user's and excluded); *kept* is what is still resident after it (the plan's arrays).
Sources: ``numpy-int32`` (a numpy array), ``arrow`` (one ``pyarrow.Array``), ``arrow-chunked`` (a ``ChunkedArray``
of 1,000 chunks, as a Hugging Face dataset's column is), ``list`` (a Python list: 3+ GB at 10^8 before the plan
starts; the plan then copies it to the narrowest type), each with ``--max-tokens`` or not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from torch_batch_process.engine.plan.bucket_options import DEFAULT_BUCKET_WINDOW, resolve_lengths
from torch_batch_process.engine.plan.plans import dataset_plan

BATCH_SIZE = 32


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _lengths(n: int) -> np.ndarray:
    """Sentence-like lengths, made a chunk at a time (no temporary of the dataset's size but the result)."""
    out = np.empty(n, dtype=np.int32)
    rng = np.random.default_rng(0)
    step = 1 << 22
    for first in range(0, n, step):
        count = min(step, n - first)
        out[first : first + count] = np.minimum(rng.lognormal(3.0, 0.9, count).astype(np.int32) + 1, 512)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--source", choices=("numpy-int32", "arrow", "arrow-chunked", "list"), required=True)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args(argv)
    lengths = _lengths(args.n)
    source: object = lengths
    if args.source.startswith("arrow"):
        import pyarrow as pa

        if args.source == "arrow":
            source = pa.array(lengths)
        else:
            step = -(-args.n // 1000)
            source = pa.chunked_array([pa.array(lengths[i : i + step]) for i in range(0, args.n, step)])
    elif args.source == "list":
        source = lengths.tolist()
    before = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started = time.perf_counter()
    resolved = resolve_lengths(source, args.n)
    plan = dataset_plan(args.n, BATCH_SIZE, resolved, DEFAULT_BUCKET_WINDOW, args.max_tokens)
    plan.describe()  # the start-up log line's padded tokens
    plan_s = time.perf_counter() - started
    report = {
        "plan_s": plan_s,
        "peak_mib": _status_mib("VmHWM") - before,
        "kept_mib": _status_mib("VmRSS") - before,
        "batches": plan.num_batches,
        "max_tokens": args.max_tokens,
    }
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
