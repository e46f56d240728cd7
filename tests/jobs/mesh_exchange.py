"""The replica's step messages (engine/mesh/exchange.py) between real processes (tests/test_mesh_exchange.py).

Every rank of the job is a member of one replica (the library's gloo group of all ranks, rank 0 the source), and the
members exchange one message per step, as the loop does between batches. The source sends batch ``k`` at step ``k``
(a small one inline, one over ``INLINE_MAX`` bytes as the broadcast that follows the statuses), a stop mark at step
``MARK_AT``; the last rank reports a failure at step ``FAIL_AT``; after step ``AGREE_AT`` the members agree on an
attempt (statuses only: rank 1's code 1) before the next message. Each rank writes what it received per step to
``<argv[1]>/rank_<r>.json``: ``[failed, code, mark, the next length, the batch's key, its tensor's sum, its text]``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torch_batch_process.engine.mesh.broadcast import pack_message, unpack_message
from torch_batch_process.engine.mesh.exchange import INLINE_MAX, StepMessages

STEPS = 6
MARK_AT, FAIL_AT, LARGE_AT, AGREE_AT = 2, 3, 4, 1


def batch(step: int) -> tuple[int, dict]:
    size = INLINE_MAX // 8 + 1 if step == LARGE_AT else 4 + step  # int64: over INLINE_MAX bytes at LARGE_AT
    return step, {"ids": torch.arange(size, dtype=torch.int64) * (step + 1), "text": f"batch {step}"}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="gloo")
    messages = StepMessages(group, source=0)
    source = rank == 0
    packed = [pack_message(batch(step)) for step in range(STEPS)] if source else None
    empty = torch.empty(0, dtype=torch.uint8)
    first = messages.exchange(False, 0, 0, empty, packed[0].numel() if source else 0)  # announces batch 0's length
    received = [[first.failed, first.code, first.mark, messages.length]]
    for step in range(STEPS):
        mark = 1 if source and step == MARK_AT else 0
        failed = rank == world - 1 and step == FAIL_AT
        following = packed[step + 1].numel() if source and step + 1 < STEPS else 0
        status = messages.exchange(failed, 0, mark, packed[step] if source else None, following)
        key, data = batch(step) if source else unpack_message(status.message)
        received.append([status.failed, status.code, status.mark, messages.length, key, int(data["ids"].sum()),
                         data["text"]])
        if step == AGREE_AT:
            agreed = messages.agree(False, int(rank == 1))
            received.append([agreed.failed, agreed.code, agreed.mark, messages.length])
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank_{rank}.json").write_text(json.dumps(received))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
