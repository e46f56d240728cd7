"""A ``mesh=`` job through the library (tests/test_mesh_jobs.py): the examples' encoder split with tensor parallel
(``parallelize_module`` over ``context.mesh["tp"]``; its embeddings written with ``context.write`` on every member, the
writer's count) or cut into pipeline stages (``torch.distributed.pipelining`` over ``context.mesh["pp"]``, one schedule
per batch shape; the last stage, the writer, holds and writes the embeddings), two exact reducers, and what each rank
saw of its mesh.

argv[1]: a JSON spec: ``storage``, ``report_dir``, ``attempt``, ``mesh`` (a dict: ``tp`` or ``pp`` inner), ``n``,
``batch_size``, ``layers``, ``checkpoint_interval``, and optionally:

- ``schedule``: ``"static"`` (the default) or ``"dynamic"``;
- ``sleep``: seconds per batch;
- ``progress_file``: touched once a rank ran ``progress_after`` batches;
- ``raise_at``: ``[rank, k]``: that rank raises in its ``k``-th batch of the attempt, before its forward, while the
  other members of its replica wait for it in the forward's collectives; ``[rank, k, victim]``: it first SIGKILLs rank
  ``victim`` and waits until it is gone (two faults at once: rank 0 hosts the rendezvous store without torchrun);
- ``oom_above``: ``[rank, size, when]``: that rank raises ``torch.OutOfMemoryError`` for a batch (or part) of more
  than ``size`` examples, ``"before"`` its forward (the other members then wait for it in the forward's collectives)
  or ``"after"`` it;
- ``stop_at``: ``[rank, k]``: that rank sends itself SIGTERM (a preemption) once it ran ``k`` batches of the attempt;
- ``kill_at``: ``[killer, victim, k]``: rank ``killer`` SIGKILLs rank ``victim`` once it ran ``k`` batches of the
  attempt, and goes on once the victim is gone (every rank writes its pid to ``pid_rank<r>`` in ``report_dir``);
- ``linger``: ``[rank, seconds]``: that rank's process lives on that long after its call returned or raised (its
  report written), as a script that goes on after a failed call (a notebook, a retry loop) does;
- ``on_oom``: the call's ``on_oom`` (default ``"split"``);
- ``die_opening``: that rank kills itself (SIGKILL) as the mesh's replica groups are created (the device mesh's are
  connected), so that the others wait for it while they connect;
- ``upload``: ``"same"``: every member saves ``batch_<idx>.pt`` with ``upload_path()``; ``"member_only"``: the members
  that are not writers save ``member_<rank>.txt``, which no writer writes.

Each rank writes ``attempt<a>_rank<r>.json`` with its result or its error. Plain processes or torchrun.
"""

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "mesh"))

import torch  # noqa: E402
from encoder import EncoderConfig, Pipeline, TokenDataset, build_encoder, tensor_parallel_plan  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

from torch_batch_process import TorchBatchProcessor, torch_batch_process  # noqa: E402

faulthandler.register(signal.SIGUSR1)
SPEC = json.loads(sys.argv[1])
CONFIG = EncoderConfig(layers=SPEC.get("layers", 2))
SEEN: dict = {}
"""What each processor saw of its mesh and its batches, by rank (for the report)."""


def rank_of(context) -> int:
    return context.distributed.rank


class TensorParallelJob(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        model = build_encoder(CONFIG).to(context.device)
        if "pp" in context.mesh.mesh_dim_names:
            self.model = Pipeline(model, context.mesh["pp"].get_group(), context.device, microbatches=2)
        else:
            self.model = parallelize_module(model, context.mesh["tp"], tensor_parallel_plan(CONFIG))
        self.examples = context.wrap_reducer(sum, name="examples")
        self.index_sum = context.wrap_reducer(sum, name="index_sum")
        self.seen = SEEN[rank_of(context)] = {
            "replica_rank": context.replica_rank,
            "num_replicas": context.num_replicas,
            "is_writer": context.is_writer,
            "mesh_names": list(context.mesh.mesh_dim_names),
            "coordinate": list(context.mesh.get_coordinate()),
            "batches": [],
        }

    @staticmethod
    def out_of_memory(oom: list, rank: int, size: int) -> None:
        if oom[0] == rank and size > oom[1]:
            raise torch.OutOfMemoryError(f"simulated: rank {rank} holds at most {oom[1]} examples")

    def process_batch(self, batch, batch_idx):
        rank = self.context.distributed.rank
        raise_at = SPEC.get("raise_at")
        if raise_at is not None and raise_at[:2] == [rank, len(self.seen["batches"])]:
            if len(raise_at) > 2:
                kill_and_wait(raise_at[2])
            raise ValueError(f"rank {rank} fails in batch {batch_idx}")
        self.seen.setdefault("sizes", []).append(len(batch))
        oom = SPEC.get("oom_above")
        if oom is not None and oom[2] == "before":
            self.out_of_memory(oom, rank, len(batch))
        embeddings = self.model(self.context.to_device(batch))  # pipeline: None but on the last stage
        if oom is not None and oom[2] == "after":
            self.out_of_memory(oom, rank, len(batch))
        if embeddings is not None:
            self.context.write({"embedding": embeddings})
        upload = SPEC.get("upload")
        if upload == "same" or (upload == "member_only" and not self.context.is_writer):
            with self.context.upload_path() as folder:
                if upload == "same":
                    torch.save(list(self.context.batch_indices), folder / f"batch_{batch_idx}.pt")
                else:
                    (folder / f"member_{rank}.txt").write_text(str(batch_idx))
        self.examples.update(len(self.context.batch_indices))
        self.index_sum.update(sum(self.context.batch_indices))
        self.seen["batches"].append(batch_idx)
        if SPEC.get("stop_at") == [rank, len(self.seen["batches"])]:
            os.kill(os.getpid(), signal.SIGTERM)
        if SPEC.get("kill_at") is not None and SPEC["kill_at"][::2] == [rank, len(self.seen["batches"])]:
            kill_and_wait(SPEC["kill_at"][1])
        if SPEC.get("sleep"):
            time.sleep(SPEC["sleep"])
        if SPEC.get("progress_file") and len(self.seen["batches"]) >= SPEC.get("progress_after", 2):
            Path(SPEC["progress_file"]).touch()


def pid_file(rank: int) -> Path:
    return Path(SPEC["report_dir"]) / f"pid_rank{rank}"


def kill_and_wait(victim: int) -> None:
    """SIGKILLs rank ``victim`` and waits (10 s at most) until its process is gone, its connections closed."""
    pid = int(pid_file(victim).read_text())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.01)


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    if SPEC.get("kill_at") is not None or len(SPEC.get("raise_at") or ()) > 2:
        pid_file(rank).parent.mkdir(parents=True, exist_ok=True)
        pid_file(rank).write_text(str(os.getpid()))
    if SPEC.get("die_opening") == rank:
        torch.distributed.new_subgroups_by_enumeration = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    report = {"rank": rank}
    try:
        result = torch_batch_process(
            TensorParallelJob,
            TokenDataset(SPEC["n"], CONFIG),
            batch_size=SPEC["batch_size"],
            checkpoint_interval=SPEC.get("checkpoint_interval", 2),
            mesh=SPEC["mesh"],
            schedule=SPEC.get("schedule", "static"),
            on_oom=SPEC.get("on_oom", "split"),
            storage_path=SPEC["storage"],
            progress=False,
            tensorboard=False,
        )
        report["result"] = {"finished": result.finished, "preempted": result.preempted, "metrics": result.metrics}
    except BaseException as exc:  # noqa: BLE001 - reported for the test
        report["error"] = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
    report["seen"] = SEEN.get(rank)
    folder = Path(SPEC["report_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"attempt{SPEC['attempt']}_rank{rank}.json").write_text(json.dumps(report))
    if SPEC.get("linger") is not None and SPEC["linger"][0] == rank:
        time.sleep(SPEC["linger"][1])
    sys.exit(1 if "error" in report else 0)


if __name__ == "__main__":
    main()
