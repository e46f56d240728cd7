"""A static commit's exchange (engine/commit/gathered.py) on two real ranks (gloo), without a job around it: for
tests/test_commit_exchange.py.

argv[1]: a folder. Each rank sends two votes, as two commits: a small one (rank 1 asks to stop, rank 0 tells its
durable record, committed counts and news), then one whose ``lines`` do not fit the exchange's buffer on rank 1. Each
rank writes ``rank_<r>.json``: per commit, the flags it learned, the ranks (and line counts) of the votes it got, and
how many collectives the commit ran on the library's group (its sequence number before and after).
"""

import dataclasses
import json
import sys
from pathlib import Path

from torch_batch_process.engine.commit.gathered import PendingVotes
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.distributed import DistributedEnv


def _vote(rank: int, lines: int) -> Vote:
    return Vote(
        rank=rank, stage=3, has_files=False, batches=[[rank, rank + 1]], examples=4, state_file=None,
        lines=[{"group": "inference", "steps_completed": i, "rank": rank, "metrics": {"x": i}} for i in range(lines)],
        timings={"data": 0.0, "process": 0.0, "commit": 0.0, "hooks": 0.0}, preempt=rank == 1,
        durable=7 if rank == 0 else -1,
    )


def main() -> None:
    out = Path(sys.argv[1])
    with DistributedEnv() as env:
        rank, group = env.info.rank, env.control_group
        assert group is not None
        report = []
        for lines in (0, 300 if rank == 1 else 0):  # the second: rank 1's vote does not fit the buffer
            counts = (10, 20) if rank == 0 else (0, 0)
            before = group._get_sequence_number_for_group()
            votes, flags = PendingVotes(env.collectives, _vote(rank, lines), counts, shared=rank == 0).wait()
            collectives = group._get_sequence_number_for_group() - before
            report.append({
                "flags": dataclasses.asdict(flags), "votes": [[v.rank, len(v.lines)] for v in votes],
                "collectives": collectives,
            })
        (out / f"rank_{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
