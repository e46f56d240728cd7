"""A synthetic job for the library-level figures: fixed work per batch, tiny examples, one small file per batch.

Run by ``commit_interval.py``, ``resume.py``, ``memory.py`` and ``startup.py`` (plain ``python -m`` or
under torchrun). ``--mode tbp`` runs ``torch_batch_process``; ``--mode hand`` runs the same batches in a
hand-written DataLoader loop (the reference). Each process writes ``<report>/rank_<r>.json`` with the
call's wall time, the time to the first batch, the peak RSS and the result's counts.

The work of a batch is ``--work-ms`` of busy CPU (like compute; a sleep would leave the CPU free for
the library's own work and flatter it) or, with ``--sleep``, of sleeping (like waiting for a GPU).
``--skew SIGMA`` makes batch times log-normal (median ``--work-ms``, the same draw for a batch on every
run: seeded by its index) and ``--slow-rank-factor F`` makes the last rank F times slower (a slower GPU or
host), as for the dynamic-schedule figures; ``--schedule`` picks the library's schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

PROCESS_START = time.time()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

IMPORTED_TORCH = time.time()

ARGS: argparse.Namespace
STATE: dict[str, Any] = {"first_batch": None, "batches": 0, "preempt_sent": False}


class TinyExamples(Dataset):
    """Example ``i`` is the integer ``i`` as a 0-d tensor; holds nothing per example."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return torch.tensor(index)


def work_seconds(batch_idx: int) -> float:
    """Duration of batch ``batch_idx`` on this rank: ``--work-ms``, log-normal with ``--skew``, times the
    slow rank's factor."""
    seconds = ARGS.work_ms / 1000
    if ARGS.skew:
        seconds *= float(np.random.default_rng(batch_idx).lognormal(0.0, ARGS.skew))
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and rank == world_size - 1:
        seconds *= ARGS.slow_rank_factor
    return seconds


def work(batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
    """The batch's work (see :func:`work_seconds`); returns its output (the batch's sum)."""
    seconds = work_seconds(batch_idx)
    if seconds > 0:
        if ARGS.sleep:
            time.sleep(seconds)
        else:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
    return batch.sum().reshape(1)


def batch_done(batch_idx: int, num_batches: int) -> None:
    if STATE["first_batch"] is None:
        STATE["first_batch"] = time.time()
    STATE["batches"] += 1
    if ARGS.preempt_at is not None and not STATE["preempt_sent"] and batch_idx + 1 >= ARGS.preempt_at * num_batches:
        STATE["preempt_sent"] = True
        os.kill(os.getpid(), signal.SIGTERM)  # as a cluster would: commit and stop at the next step boundary


def processor_class() -> type:
    """The processor (defined here so that ``--mode hand`` never imports torch_batch_process)."""
    from torch_batch_process import TorchBatchProcessor

    class SyntheticProcessor(TorchBatchProcessor):
        def __init__(self, context: Any) -> None:
            self.context = context
            self.num_batches = -(-ARGS.examples // ARGS.batch_size)

        def process_batch(self, batch: torch.Tensor, batch_idx: int) -> None:
            output = work(batch, batch_idx)
            if ARGS.outputs:
                with self.context.upload_path() as path:
                    torch.save(output, Path(path) / f"batch_{batch_idx:07d}.pt")
            batch_done(batch_idx, self.num_batches)

    return SyntheticProcessor


def run_hand(dataset: Dataset) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    num_batches = -(-ARGS.examples // ARGS.batch_size)
    mine = list(range(rank, num_batches, world_size))
    sampler = ([g * ARGS.batch_size + i for i in range(min(ARGS.batch_size, ARGS.examples - g * ARGS.batch_size))] for g in mine)
    loader = DataLoader(dataset, batch_sampler=_Sized(sampler, len(mine)), num_workers=ARGS.workers)
    out = Path(ARGS.storage) / "outputs"
    out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for batch_idx, batch in zip(mine, loader):
            output = work(batch, batch_idx)
            if ARGS.outputs:
                torch.save(output, out / f"batch_{batch_idx:07d}.pt")
            batch_done(batch_idx, num_batches)
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return {"rank": rank, "world_size": world_size}


class _Sized:
    """An iterable of index lists with a length, built lazily (holds nothing per batch)."""

    def __init__(self, iterable: Any, length: int) -> None:
        self.iterable, self.length = iterable, length

    def __iter__(self) -> Any:
        return iter(self.iterable)

    def __len__(self) -> int:
        return self.length


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("tbp", "hand"), default="tbp")
    parser.add_argument("--examples", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--work-ms", type=float, default=0.0)
    parser.add_argument("--sleep", action="store_true", help="sleep instead of busy work")
    parser.add_argument("--skew", type=float, default=0.0, help="sigma of log-normal batch times (0: fixed)")
    parser.add_argument("--slow-rank-factor", type=float, default=1.0, help="the last rank's batches take this much longer")
    parser.add_argument("--schedule", choices=("static", "dynamic"), default="static")
    parser.add_argument("--interval", type=int, default=None, help="checkpoint_interval (default: the library's)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--no-outputs", dest="outputs", action="store_false")
    parser.add_argument("--preempt-at", type=float, default=None, help="SIGTERM itself after this fraction of batches")
    parser.add_argument("--storage", required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--launched", type=float, default=None, help="time.time() when the launcher started us")
    ARGS = parser.parse_args()
    torch.set_num_threads(1)
    imported_tbp = time.time()
    if ARGS.mode == "tbp":
        from torch_batch_process import torch_batch_process

        processor_cls = processor_class()
    import_tbp_s = time.time() - imported_tbp
    dataset = TinyExamples(ARGS.examples)
    start = time.time()
    info: dict[str, Any]
    if ARGS.mode == "hand":
        info = run_hand(dataset)
    else:
        options: dict[str, Any] = {"schedule": ARGS.schedule}
        if ARGS.interval is not None:
            options["checkpoint_interval"] = ARGS.interval
        result = torch_batch_process(
            processor_cls,
            dataset,
            batch_size=ARGS.batch_size,
            dataloader_kwargs={"num_workers": ARGS.workers},
            storage_path=ARGS.storage,
            **options,
        )
        info = {
            "rank": int(os.environ.get("RANK", "0")),
            "world_size": result.world_size,
            "preempted": result.preempted,
            "finished": result.finished,
            "commits": result.commits,
            "batches_processed": result.batches_processed,
            "batches_committed": result.batches_committed,
            "timings": result.timings,
        }
    end = time.time()
    report = {
        **info,
        "process_start": PROCESS_START,
        "launched": ARGS.launched,
        "import_torch_s": IMPORTED_TORCH - PROCESS_START,
        "import_tbp_s": import_tbp_s,
        "start": start,
        "first_batch": STATE["first_batch"],
        "end": end,
        "call_s": end - start,
        "batches": STATE["batches"],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    ARGS.report.mkdir(parents=True, exist_ok=True)
    (ARGS.report / f"rank_{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
