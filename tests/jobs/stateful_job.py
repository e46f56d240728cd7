"""A job whose processor keeps a per-rank counter as state, merged on a resume with another world size.

Spec (JSON in argv[1]): n, batch_size, storage, report_dir, attempt, and optionally ``sigterm_at`` (a global
batch index: the rank that processes it sends itself SIGTERM, so the job commits and stops).
"""

import json
import os
import signal
import sys
from pathlib import Path

from report_file import write_report

from torch_batch_process import TorchBatchProcessor, torch_batch_process

SPEC = json.loads(sys.argv[1])
INSTANCES = []


class Counting(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.count = 0
        self.loaded = None
        INSTANCES.append(self)

    def process_batch(self, batch, batch_idx):
        self.count += 1
        if batch_idx == SPEC.get("sigterm_at"):
            os.kill(os.getpid(), signal.SIGTERM)

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.loaded = state
        if self.context.get_distributed_rank() == 0:  # the merged total lives on rank 0
            self.count = state["count"]

    @classmethod
    def merge_state_dicts(cls, states):
        return {"count": sum(state["count"] for state in states if state), "merged_from": len(states)}


def main():
    rank = int(os.environ.get("RANK", "0"))
    result = torch_batch_process(
        Counting, list(range(SPEC["n"])), batch_size=SPEC["batch_size"], checkpoint_interval=2,
        storage_path=SPEC["storage"], progress=False, tensorboard=False,
    )
    report = {"result": result.to_json()}
    processor = INSTANCES[0]
    report.update(count=processor.count, loaded=processor.loaded)
    Path(SPEC["report_dir"]).mkdir(parents=True, exist_ok=True)
    write_report(Path(SPEC["report_dir"], f"attempt{SPEC['attempt']}_rank{rank}.json"), report)


if __name__ == "__main__":
    main()
