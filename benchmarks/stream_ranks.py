"""Rows decoded per row by a stream job on 2 ranks, by schedule and row-group size (DESIGN §12).

    python -m benchmarks.stream_ranks

100,000 rows in 8 Parquet files, batches of 1000, 2 processes running ``tests/jobs/stream_job.py``;
the rows every process decodes are added up by ``RowsReadLog``. 1.00 means no row decoded twice.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> int:
    sys.path.insert(0, str(TESTS))
    from harness import JOBS, spawn_ranks, wait_all
    from test_stream_jobs import write_parquet_files

    from torch_batch_process import sources

    rows = 100_000
    for row_group in (16_384, 1000):
        for schedule in ("static", "dynamic"):
            with tempfile.TemporaryDirectory(prefix="tbp-stream-ranks-") as scratch:
                d = Path(scratch)
                write_parquet_files(str(d / "data"), [rows // 8] * 8, row_group=row_group)
                spec = {
                    "source": {"kind": "parquet", "url": str(d / "data" / "*.parquet")},
                    "batch_size": 1000, "checkpoint_interval": 20, "storage": str(d / "s"),
                    "report_dir": str(d / "r"), "reads_log": str(d / "reads"), "kwargs": {"schedule": schedule},
                }
                outcomes = wait_all(spawn_ranks(2, JOBS / "stream_job.py", json.dumps(spec)), 300)
                if any(rc != 0 for rc, _, _ in outcomes):
                    raise RuntimeError(f"a rank failed: {outcomes}")
                ratio = sources.RowsReadLog(d / "reads").total() / rows
                print(f"row groups of {row_group}, schedule={schedule}, 2 ranks: rows decoded / rows = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
