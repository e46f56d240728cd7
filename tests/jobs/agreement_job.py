"""The static schedule's agreement on two real ranks (gloo), without a job around it: for tests/test_agreement.py.

argv[1]: JSON with ``steps``, ``step_s`` (seconds each step sleeps), ``interval`` (a commit every so many steps),
``period_s`` (the agreement period), ``preempt_at`` (the step at whose end rank 1 raises its stop flag, or null),
``report`` (a folder). Each rank writes ``rank_<r>.json``: the decision after each step it ran, and how many
agreements it started.
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.engine.schedule.agreement import Decision, StepAgreement


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    agreement = StepAgreement(Collectives(dist.group.WORLD, rank, world), period_s=spec["period_s"])
    decisions = []
    for step in range(spec["steps"]):
        time.sleep(spec["step_s"] * (1.5 if rank == 0 else 1.0))  # uneven ranks: the agreement keeps them together
        preempt = rank == 1 and spec["preempt_at"] is not None and step >= spec["preempt_at"]
        if (step + 1) % spec["interval"] == 0:
            decision = agreement.at_commit(step, preempt)
        else:
            decision = agreement.boundary(step, preempt, False)
        decisions.append(decision.value)
        if decision in (Decision.STOP, Decision.FAIL):
            break
    agreement.drain()
    Path(spec["report"], f"rank_{rank}.json").write_text(
        json.dumps({"decisions": decisions, "agreements": agreement.agreements})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
