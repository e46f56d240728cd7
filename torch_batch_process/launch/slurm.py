"""The Slurm step the launcher runs in, from the variables ``srun`` sets, for multi-node defaults.

Started by ``srun`` with one task per node, the launcher needs no rendezvous options: the number of
nodes is the step's, the c10d rendezvous runs on the step's first node, and the rendezvous id is
the job and step id. Anything given on the command line (or in torchrun's ``PET_*`` variables) wins.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True)
class SlurmStep:
    """An ``srun`` step: its nodes, its tasks, and its first node (the rendezvous host)."""

    job_id: str
    step_id: str
    nodes: int
    tasks: int
    first_node: str

    @property
    def rdzv_id(self) -> str:
        return f"slurm-{self.job_id}.{self.step_id}"


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    nodelist = nodelist.strip()
    match = re.match(r"^([^,\[]*)(?:\[([^\]]*)\])?", nodelist)
    if not match or not match.group(1) and not match.group(2):
        raise ValueError(f"cannot read the Slurm host list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = re.split(r"[,-]", ranges, maxsplit=1)[0]
    return prefix + first


def slurm_step(environ: Mapping[str, str]) -> SlurmStep | None:
    """The ``srun`` step described by ``environ``, or ``None`` outside of one."""
    needed = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")
    if not all(environ.get(name) for name in needed):
        return None
    try:
        nodes = int(environ["SLURM_STEP_NUM_NODES"])
        tasks = int(environ["SLURM_STEP_NUM_TASKS"])
        head = first_host(environ["SLURM_STEP_NODELIST"])
    except ValueError:
        return None
    return SlurmStep(environ["SLURM_JOB_ID"], environ["SLURM_STEP_ID"], nodes, tasks, head)
