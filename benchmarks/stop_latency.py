"""How long a SIGTERM to one rank takes to stop every rank of a static 2-process job (issue 45 item 3).

    python -m benchmarks.stop_latency                    # batches of 5 and 20 ms, 5 signals each, both cadences
    python -m benchmarks.stop_latency --work-ms 20 --signals 3

Two ranks (torchrun, gloo, local storage on ``/dev/shm`` when there is one) run a static job whose batches sleep
``--work-ms`` milliseconds (the host's view of a GPU batch: the cores stay free), a commit every 5 steps (the
default). Once both ranks run, SIGTERM goes to rank 1 at a random moment; each rank records when each of its batches
started and ended. Per signal:

- *stop latency*: from the signal to the end of the last batch of the rank that stopped last (what the agreement
  adds: the closing commit that follows is the same with any cadence);
- *batches started after the signal*, the most over the ranks.

Two cadences of the agreement, rotated per signal: the default (``TBP_AGREEMENT_S``, an agreement every ~50 ms and
at every commit) and ``every step`` (``TBP_AGREEMENT_S=0``: the behaviour before issue 45). The bound the contract
promises is one agreement period plus a step: the signal joins the next agreement (at most a period away), read
one step later, after the batch that was running; about 50 ms + two batches at the end of a batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.launch import REPO, worker_env
from benchmarks.report import emit_figures, fmt_spread, machine, machine_line, median_spread, rotated
from torch_batch_process.engine.schedule.agreement import AGREEMENT_ENV, agreement_period_s

CADENCES = {"default": None, "every step": "0"}


def _rank_main(work_ms: float, storage: str, reports: str) -> None:
    import torch

    from torch_batch_process import TorchBatchProcessor, torch_batch_process

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    times: list[tuple[float, float]] = []
    folder = Path(reports)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"pid_{rank}").write_text(str(os.getpid()))

    class Sleep(TorchBatchProcessor):
        def __init__(self, context: Any) -> None:
            self.context = context

        def process_batch(self, batch: Any, batch_idx: int) -> None:
            began = time.time()
            time.sleep(work_ms / 1000)
            times.append((began, time.time()))
            if len(times) == 10:
                (folder / f"running_{rank}").write_text("")

    result = torch_batch_process(Sleep, list(range(100_000)), batch_size=10, storage_path=storage, progress=False)
    (folder / f"rank_{rank}.json").write_text(json.dumps({"times": times, "preempted": result.preempted}))


def _one(work_ms: float, cadence: str, scratch: Path) -> dict[str, float]:
    """One job, one signal; its stop latency (ms) and the batches started after the signal."""
    reports = scratch / f"reports-{time.time_ns()}"
    env = worker_env()
    env.pop(AGREEMENT_ENV, None)
    if CADENCES[cadence] is not None:
        env[AGREEMENT_ENV] = CADENCES[cadence]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
        "benchmarks.stop_latency", "--rank-of", str(work_ms), str(scratch / f"job-{time.time_ns()}"), str(reports),
    ]
    proc = subprocess.Popen(command, cwd=str(REPO), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((reports / f"running_{r}").exists() for r in (0, 1)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job ended or did not start (exit {proc.returncode})")
            time.sleep(0.01)
        time.sleep(random.uniform(0.2, 0.4))
        sent = time.time()
        os.kill(int((reports / "pid_1").read_text()), signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    ranks = [json.loads((reports / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert all(r["preempted"] for r in ranks), ranks
    last_end = max(r["times"][-1][1] for r in ranks)
    late = max(sum(1 for began, _ in r["times"] if began > sent) for r in ranks)
    return {"latency_ms": (last_end - sent) * 1000, "late": late}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-ms", default="5,20", help="comma-separated batch durations (ms)")
    parser.add_argument("--signals", type=int, default=5, help="signals (jobs) per cadence and batch duration")
    parser.add_argument("--rank-of", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        _rank_main(float(args.rank_of[0]), args.rank_of[1], args.rank_of[2])
        return 0
    random.seed(45)
    period_ms = agreement_period_s() * 1000
    print("| batch (ms) | agreement | stop latency, ms: median [min–max] | batches started after the signal "
          "| bound: one period + two batches (ms) |")
    print("|---:|---|---:|---:|---:|")
    figures: dict[str, Any] = {}
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tbp-stop-", dir=base) as tmp:
        for work in (float(w) for w in args.work_ms.split(",") if w):
            runs: dict[str, list[dict[str, float]]] = {c: [] for c in CADENCES}
            for i in range(args.signals):
                for cadence in rotated(list(CADENCES), i):
                    runs[cadence].append(_one(work, cadence, Path(tmp)))
            for cadence, results in runs.items():
                latency = [r["latency_ms"] for r in results]
                bound = (period_ms if cadence == "default" else 0) + 2 * work
                print(f"| {work:g} | {cadence} | {fmt_spread(latency, 0)} | {fmt_spread([r['late'] for r in results])} "
                      f"| {bound:.0f} |", flush=True)
                key = "default" if cadence == "default" else "every_step"
                figures[f"stop_latency.{work:g}ms.{key}.ms"] = list(median_spread(latency))
    print(f"\n{args.signals} signal(s) per row, cadences rotated; agreement period {period_ms:g} ms. "
          f"Machine: {machine_line(machine())}.")
    emit_figures(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
