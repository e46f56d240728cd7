"""What every contender script shares: its command line, its timing report, and output counting.

A contender is started by the runner (as ``python -m benchmarks.contenders.<name>``, under torchrun,
or with its framework's own launcher) and writes, per process, ``<report>/rank_<r>.json``::

    {"rank": 0, "world_size": 2, "start": <time.time()>, "first_batch": ..., "end": ..., "batches": 40}

``start`` is taken after the imports (the workload's lazy ones too: transformers' BERT modules) and the
dataset object (cheap, identical everywhere), right
before the contender's own job begins: process group, model, data loader, processing, writing
outputs and the framework's finishing work are all inside ``[start, end]``. The runner derives the
job time of a run as ``max(end) - max(start)`` over the processes (from the moment the last
process is ready to the moment the last one is done) and also measures the whole command's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import Workload, configure_process


@dataclass
class Options:
    """Command line of a contender script."""

    workload: Workload
    out: Path
    report: Path
    nproc: int
    workers: int
    threads: int
    extra: dict[str, Any] = field(default_factory=dict)


def parse_options(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description="one benchmark contender (started by benchmarks.run)")
    parser.add_argument("--workload", choices=("cnn", "minilm"), required=True)
    parser.add_argument("--num-examples", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for the output files")
    parser.add_argument("--report", type=Path, required=True, help="folder for the timing reports")
    parser.add_argument("--nproc", type=int, default=1, help="number of processes (Lightning, Ray)")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per process")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--cache", type=Path, default=None, help="folder for the cached text corpus")
    parser.add_argument("--checkpoint-interval", type=int, default=None, help="torch_batch_process only")
    args = parser.parse_args(argv)
    configure_process(args.threads)
    workload = Workload(args.workload, args.num_examples, args.batch_size, args.cache)
    workload.warm_imports()
    extra = {"checkpoint_interval": args.checkpoint_interval}
    return Options(workload, args.out, args.report, args.nproc, args.workers, args.threads, extra)


class Reporter:
    """Collects one process's timestamps and writes them to ``<report>/rank_<r>.json``."""

    def __init__(self, report: Path) -> None:
        self.report = report
        self._cpu0 = cpu_times()
        self.start = time.time()
        self.first_batch: float | None = None
        self.last_batch: float | None = None
        self.batches = 0
        self.examples = 0

    def batch_done(self, examples: int = 0) -> None:
        now = time.time()
        if self.first_batch is None:
            self.first_batch = now
        self.last_batch = now
        self.batches += 1
        self.examples += examples

    def finish(self, rank: int, world_size: int, **extra: Any) -> dict[str, Any]:
        """Writes the report of this process (and returns it)."""
        end = time.time()
        self.report.mkdir(parents=True, exist_ok=True)
        data = {
            "rank": rank,
            "world_size": world_size,
            "start": self.start,
            "first_batch": self.first_batch,
            "end": end,
            "last_batch": self.last_batch,
            "batches": self.batches,
            "examples": self.examples,
            "pid": os.getpid(),
            "cpu": {k: v - self._cpu0[k] for k, v in cpu_times().items()},
            **extra,
        }
        path = self.report / f"rank_{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        return data


def cpu_times() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process's main thread, of its other threads (alive or ended:
    a framework's background threads, gloo's, the DataLoader's feeder) and of its children that ended (the
    DataLoader's workers, once the loader stopped them); on Linux also the main thread's context switches so far
    (``main_waits``: it blocked, on a lock, the loader or I/O; ``main_preempted``: the scheduler took its core).
    Read on the main thread."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    main = time.thread_time()
    times = {"main": main, "threads": time.process_time() - main, "children": children.ru_utime + children.ru_stime}
    if hasattr(resource, "RUSAGE_THREAD"):  # Linux: how often the main thread waited (voluntary) or was preempted
        thread = resource.getrusage(resource.RUSAGE_THREAD)
        times.update(main_waits=thread.ru_nvcsw, main_preempted=thread.ru_nivcsw)
    return times


def env_rank() -> tuple[int, int]:
    """(rank, world size) from the torchrun environment; (0, 1) without one."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def save_tensor(tensor: torch.Tensor, path: Path) -> None:
    """Writes one output file as a real job would (``torch.save`` of a compact CPU tensor)."""
    torch.save(tensor.detach().cpu().contiguous(), path)


def count_output_rows(folder: Path) -> tuple[int, int]:
    """(files, rows) of the outputs below ``folder``: ``.pt`` tensors and ``.npy``/``.parquet`` (Ray)."""
    files = rows = 0
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        if path.suffix == ".pt":
            rows += int(torch.load(path, map_location="cpu", weights_only=True).shape[0])
        elif path.suffix == ".npy":
            import numpy as np

            rows += int(np.load(path, mmap_mode="r").shape[0])
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows += pq.ParquetFile(path).metadata.num_rows
        else:
            continue
        files += 1
    return files, rows
