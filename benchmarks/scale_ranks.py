"""The ranks of the scale simulation (``python -m benchmarks.scale``): W processes forked from one parent.

``python -m benchmarks.scale_ranks --world W --cells cells.json --out DIR`` imports torch and the library once,
then forks W processes that join one gloo process group (the env contract: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; rank 0's process hosts the rendezvous store, as without torchrun) and run
the cells of ``cells.json`` one after the other, each a real ``torch_batch_process`` call on every rank (with
``--independent``, each process runs one-rank jobs of its own instead: what W processes cost this machine when the
library coordinates nothing). Forking
after the imports shares the imported code between the ranks (copy-on-write), so 32 ranks start in about a
second and fit in memory; each rank is still a process of its own, with its own interpreter, threads and
sockets, as under torchrun.

A cell's job: a range-like dataset of ``n`` examples (example ``i`` is the integer ``i``; the dataset holds nothing
per example), batches of ``batch_size``, trivial work, and record outputs (``context.write``) of one int column per
batch. A rank stops itself (SIGTERM, as a cluster preempts: the ranks agree, commit and return ``preempted=True``)
when it takes batch ``batches - 1`` (measured runs: the job's first ``batches`` batch ids, whichever rank takes
them: with ``schedule="dynamic"`` ranks take different numbers) or after ``batches_per_rank`` of its own batches
(other cells), so a cell is bounded whatever ``n`` is, while the plan, the commit records and the dealing of
batches cover all ``n`` examples. Each rank writes ``DIR/<cell>/rank_<r>.json``:

- ``cpu_s`` / ``batches``: the process's CPU time (user + system, every thread: the loop, the library's background
  threads, gloo's, and on rank 0 the rendezvous store's server) from its first batch with an id of at least
  ``warmup`` (or its ``warmup``-th batch) to its last one, and the batches in between; the library's cost per
  batch is the sum over ranks of ``cpu_s`` over the sum of ``batches`` (the work itself is nil);
- ``commit_wall_ms`` / ``commit_cpu_ms``: for each commit in that window, the wall time from
  ``on_checkpoint_start()`` to the next ``process_batch()`` (the commit on the loop's path, plus loading the next,
  tiny, batch) and the main thread's CPU time over the same span;
- ``peak_rss_mib``: the process's peak resident memory during the call (``VmHWM``, reset before it), and
  ``start_rss_mib`` its resident memory when the call started (what earlier cells of the same process left);
- ``first_batch_s``: seconds from the call to this rank's first batch (start-up: the job's records, the plan, the
  dealing of the remaining batches);
- ``after_first_s`` / ``after_first_cpu_s``: wall and CPU time from the first batch to the end of the call (cells
  in which one rank sleeps in a batch: the others' CPU while they wait for it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from torch_batch_process import TorchBatchProcessor, torch_batch_process

__all__ = ["RangeDataset", "ScaleProcessor"]

CELL: dict[str, Any] = {}
"""The cell being run (read by the processor, which the library builds from its class)."""

BUILT: list[ScaleProcessor] = []
"""The processor the library built for the current cell."""


class RangeDataset(Dataset):
    """Example ``i`` is the integer ``i``; a batch of consecutive indices is one ``arange`` (no per-example work)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        first, last = indices[0], indices[-1]
        if last - first + 1 == len(indices):
            return torch.arange(first, last + 1)
        return torch.tensor(indices)


def _identity(batch: Any) -> Any:
    return batch


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _threads_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each of the process's threads, by thread name (``name:tid``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{name}:{task.name}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _reset_vm_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


class ScaleProcessor(TorchBatchProcessor):
    """Trivial work: writes the batch's values as one record column, times itself, stops itself (see the module
    docstring)."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.count = 0
        self.marks: dict[str, Any] = {
            "cpu0": None, "wall0": None, "cpu1": None, "wall1": None, "first": None, "first_cpu": None,
        }
        self.commit_wall: list[float] = []
        self.commit_cpu: list[float] = []
        self._commit_started: tuple[float, float] | None = None
        self._stop_sent = False
        BUILT.append(self)

    def process_batch(self, batch: torch.Tensor, batch_idx: int) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self.marks["first"] is None:
            self.marks["first"], self.marks["first_cpu"] = now, cpu
        if self._commit_started is not None:
            if self.marks["cpu0"] is not None:
                wall, thread = self._commit_started
                self.commit_wall.append((now - wall) * 1000)
                self.commit_cpu.append((time.thread_time() - thread) * 1000)
            self._commit_started = None
        if CELL["write"]:
            self.context.write({"value": batch})
        self.count += 1
        if self.count == CELL.get("sleep_at") and self.context.get_distributed_rank() == CELL.get("sleep_rank"):
            time.sleep(CELL["sleep_s"])  # a slow rank: the others wait for it (their CPU meanwhile is measured)
        total = CELL.get("batches")  # measured runs: the job's first ``batches`` batch ids, whoever takes them
        warm = batch_idx >= CELL["warmup"] if total else self.count >= max(1, CELL["warmup"])
        if warm and self.marks["cpu0"] is None:
            self.marks["cpu0"], self.marks["wall0"], self.marks["count0"] = cpu, now, self.count
            self.marks["threads0"] = _threads_cpu()
        self.marks["cpu1"], self.marks["wall1"], self.marks["count1"] = cpu, now, self.count
        last = batch_idx >= total - 1 if total else self.count >= CELL["batches_per_rank"]
        if last and not self._stop_sent:
            self._stop_sent = True
            self.marks["threads1"] = _threads_cpu()
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption: the ranks commit and stop together

    def on_checkpoint_start(self) -> None:
        self._commit_started = (time.perf_counter(), time.thread_time())


def run_cell(cell: dict[str, Any], rank: int, world: int, out: Path) -> None:
    """One ``torch_batch_process`` call of ``cell`` on this rank; writes its report."""
    CELL.clear()
    CELL.update(cell)
    BUILT.clear()
    _reset_vm_peak()
    start_rss = _status_mib("VmRSS")
    started, cpu_started = time.perf_counter(), time.process_time()
    result = torch_batch_process(
        ScaleProcessor,
        RangeDataset(cell["n"]),
        batch_size=cell["batch_size"],
        checkpoint_interval=cell["interval"],
        storage_path=cell["storage"],
        storage_options=cell.get("storage_options"),
        schedule=cell["schedule"],
        dataloader_kwargs={"collate_fn": _identity},
        progress=False,
    )
    ended, cpu_ended = time.perf_counter(), time.process_time()
    processor = BUILT[-1] if BUILT else None
    marks = processor.marks if processor is not None else {}
    counted = marks["count1"] - marks["count0"] if marks.get("cpu0") is not None else 0
    report = {
        "cell": cell["name"],
        "rank": rank,
        "world": world,
        "batches": counted,
        "batches_total": processor.count if processor is not None else 0,
        "cpu_s": (marks["cpu1"] - marks["cpu0"]) if counted else 0.0,
        "wall_s": (marks["wall1"] - marks["wall0"]) if counted else 0.0,
        "call_s": ended - started,
        "call_cpu_s": cpu_ended - cpu_started,
        "first_batch_s": (marks["first"] - started) if marks.get("first") else None,
        "after_first_s": (ended - marks["first"]) if marks.get("first") else None,
        "after_first_cpu_s": (cpu_ended - marks["first_cpu"]) if marks.get("first") else None,
        "commit_wall_ms": processor.commit_wall if processor is not None else [],
        "commit_cpu_ms": processor.commit_cpu if processor is not None else [],
        "threads_cpu_s": _thread_window(marks.get("threads0"), marks.get("threads1")),
        "peak_rss_mib": _status_mib("VmHWM"),
        "start_rss_mib": start_rss,
        "preempted": result.preempted,
        "commits": result.commits,
        "batches_committed": result.batches_committed,
    }
    folder = out / cell["name"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank_{rank}.json").write_text(json.dumps(report))


def _thread_window(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """CPU seconds per thread kind (the name without its id) between two :func:`_threads_cpu` samples."""
    if not before or not after:
        return {}
    kinds: dict[str, float] = {}
    for key, value in after.items():
        kind = key.rsplit(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0.0) + value - before.get(key, 0.0)
    return kinds


def _rank_main(rank: int, world: int, port: int, cells: list[dict[str, Any]], out: Path, independent: bool) -> int:
    if independent:  # W one-rank jobs side by side: the machine's cost of W processes, without the library's
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        torch.set_num_threads(1)
        for cell in cells:
            run_cell(cell | {"storage": f"{cell['storage']}/rank_{rank}"}, rank, world, out)
        return 0
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(600))
    for cell in cells:
        if world > 1:
            dist.barrier()
        try:
            run_cell(cell, rank, world, out)
        except Exception:  # noqa: BLE001 - the driver marks the cell failed; every rank raised: go on together
            folder = out / cell["name"]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank_{rank}.error").write_text(traceback.format_exc())
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--cells", type=Path, required=True, help="JSON list of cells")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed")
    parser.add_argument("--independent", action="store_true", help="each process runs one-rank jobs of its own")
    args = parser.parse_args(argv)
    cells = json.loads(args.cells.read_text())
    import pyarrow.parquet  # noqa: F401 - imported once here, shared by the forked ranks (not in a cell's figures)

    if any(str(cell["storage"]).startswith("s3://") for cell in cells):
        import s3fs  # noqa: F401
    port = _free_port()
    children = []
    for rank in range(args.world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank_main(rank, args.world, port, cells, args.out, args.independent)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    deadline = time.monotonic() + args.timeout
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        for pid in children:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0:  # one rank failed: the others would wait for it in a collective
                    deadline = min(deadline, time.monotonic() + 60)
        if time.monotonic() > deadline:
            for pid in children:
                if pid not in codes:
                    os.kill(pid, signal.SIGKILL)
            print(f"scale_ranks: killed the ranks after the deadline; exit codes so far {codes}", file=sys.stderr)
            return 1
        time.sleep(0.2)
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
