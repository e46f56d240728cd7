"""Repro (not a test) of a hang found while testing mesh= kills, in the library without a mesh: 4 plain ranks of
tests/jobs/generic_job.py, checkpoint_interval=1, rank 2 killed with SIGKILL right after the first durable commit.
In about one run of two a surviving rank never exits (60 s, then killed): rank 0 raises WorkerLostError from the
gathered commit's wait while another rank still waits in the same gather's send to rank 0 (or rank 0's flags
all_reduce waits for it), and rank 0's process is alive, blocked in garbage collection (the control group's
destructor joining its worker thread). Run: PYTHONPATH=. python notes/43-mesh-kill-repro.py /tmp/somewhere
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness import GENERIC_JOB, committed_batches, job_spec, spawn_ranks, wait_all, wait_for  # noqa: E402

tmp = Path(sys.argv[1])
tmp.mkdir(parents=True, exist_ok=True)
spec = job_spec(tmp, n=200, batch_size=4, sleep=0.3, attempt=1, checkpoint_interval=1)
procs = spawn_ranks(4, GENERIC_JOB, json.dumps(spec))
wait_for(lambda: committed_batches(spec["storage"]) > 0, 120, "commit")
os.kill(procs[2].pid, signal.SIGKILL)
t = time.monotonic()
out = wait_all(procs, timeout=60)
print("elapsed", time.monotonic() - t, [rc for rc, _, _ in out])
