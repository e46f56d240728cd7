"""Per-step cost of the preemption/failure agreement between ranks (2 processes, gloo).

Every step boundary, the ranks combine their stop/failure flags with an asynchronous all_reduce that is
started at the end of a step and read at the end of the next one (torch_batch_process.engine.schedule.agreement).
This measures what that costs per step, against the same loop without any agreement, for steps of
different lengths (0 ms shows the raw collective; longer steps show how much of it overlaps with work).
Rounds are interleaved and the median per-step overhead is reported.

    python benchmarks/agreement.py [--steps 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

WORK_MS = [0.0, 1.0, 5.0, 20.0]


def busy(ms: float) -> None:
    """Simulated step work (busy wait, like compute; sleep would free the core for the collective)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def worker(steps: int, rounds: int) -> None:
    import torch.distributed as dist

    from torch_batch_process.engine.distributed import Collectives
    from torch_batch_process.engine.schedule.agreement import StepAgreement

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    coll = Collectives(None, rank, dist.get_world_size())
    results: dict[str, list[float]] = {}
    chunk = 50
    for _ in range(rounds):
        for ms in WORK_MS:
            n = int(steps if ms < 5 else max(chunk * 2, steps // (ms * 4)))
            base_total, agreed_total, done = 0.0, 0.0, 0
            while done < n:  # alternate short chunks so both sides see the same machine speed
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(chunk):
                    busy(ms)
                base_total += time.perf_counter() - t0
                dist.barrier()
                agreement = StepAgreement(coll)
                t0 = time.perf_counter()
                for _ in range(chunk):
                    busy(ms)
                    agreement.boundary(False, False)
                agreement.drain()
                agreed_total += time.perf_counter() - t0
                done += chunk
            results.setdefault(str(ms), []).append((agreed_total - base_total) / done * 1e6)
    if rank == 0:
        print(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.rounds)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--rounds", str(args.rounds)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=1800)[0] for p in procs]
    results = json.loads(out[0].strip().splitlines()[-1])
    print("| step work | agreement cost per step (median of rounds) | spread (min..max) | share of the step |")
    print("|---|---|---|---|")
    for ms in WORK_MS:
        costs = results[str(ms)]
        median = statistics.median(costs)
        share = f"{median / (ms * 1000) * 100:.2f}%" if ms else "n/a"
        print(f"| {ms:g} ms | {median:.0f} us | {min(costs):.0f}..{max(costs):.0f} us | {share} |")


if __name__ == "__main__":
    main()
