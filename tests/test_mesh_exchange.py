"""The message a replica's members exchange before each step (engine/mesh/exchange.py, ``mesh=``): one collective
carries every member's status, the source's mark and the step's batch, so a stop mark or a member's failure reaches
every member at the step it was raised, and every member runs the same batches (real gloo processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from harness import JOBS, base_env, job_spec, read_reports, run_ranks, spawn_ranks, wait_all

from torch_batch_process import read_outputs
from torch_batch_process.engine.mesh.broadcast import pack_message, unpack_message
from torch_batch_process.engine.mesh.exchange import INLINE_MAX

sys.path.insert(0, str(JOBS))
from mesh_exchange import AGREE_AT, FAIL_AT, LARGE_AT, MARK_AT, STEPS, batch  # noqa: E402


def test_a_packed_message_comes_back_equal_from_an_aligned_offset_of_a_larger_buffer():
    item = (7, {"ids": torch.arange(5), "half": torch.ones(3, dtype=torch.float16), "text": "x"})
    message = pack_message(item)
    received = torch.zeros(32 + message.numel() + 16, dtype=torch.uint8)  # as a chunk of a gathered buffer
    received[32 : 32 + message.numel()] = message
    key, out = unpack_message(received[32 : 32 + message.numel()])
    assert key == 7 and out["text"] == "x"
    assert torch.equal(out["ids"], item[1]["ids"]) and torch.equal(out["half"], item[1]["half"])


@pytest.mark.slow
def test_a_mark_and_a_failure_reach_every_member_at_the_step_they_were_raised(tmp_path):
    """3 members: the source marks a stop at one step, the last member fails at another, the members agree on an
    attempt in between; every member receives the same statuses at the same steps, and the source's batches (one
    larger than INLINE_MAX: sent after the statuses)."""
    done = run_ranks(3, JOBS / "mesh_exchange.py", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    received = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(3)]
    assert received[0] == received[1] == received[2]
    first, *steps = received[0]
    assert first == [False, 0, 0, pack_message(batch(0)).numel()]
    assert steps.pop(AGREE_AT + 1) == [False, 1, 0, pack_message(batch(AGREE_AT + 1)).numel()]  # length unchanged
    for step, (failed, code, mark, following, key, total, text) in enumerate(steps):
        assert failed is (step == FAIL_AT) and code == 0 and mark == (1 if step == MARK_AT else 0), step
        assert following == (pack_message(batch(step + 1)).numel() if step + 1 < STEPS else 0)
        assert [key, total, text] == [step, int(batch(step)[1]["ids"].sum()), f"batch {step}"]
    assert steps[LARGE_AT - 1][3] > INLINE_MAX


@pytest.mark.slow
def test_a_member_preempted_under_the_dynamic_schedule_stops_its_replica_at_one_step_then_resumes_once(tmp_path):
    """1 replica x 2, dynamic schedule: the writer (not the source, which claims) is preempted in its 3rd batch; its
    stop reaches the source's claims and comes back in the replica's message: both members ran the same batches and
    stop together (preempted, no error); the resume, on 2 replicas of one rank (another k), runs the rest: every index
    exactly once, exact metrics."""
    n = 40
    spec = job_spec(tmp_path, n=n, batch_size=4, layers=1, checkpoint_interval=2, schedule="dynamic",
                    mesh={"replica": 1, "tp": 2})
    first = dict(spec, attempt=1, stop_at=[1, 3])
    outcomes = wait_all(spawn_ranks(2, JOBS / "mesh_job.py", json.dumps(first), env=base_env()), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], [err[-3000:] for _, _, err in outcomes]
    reports = read_reports(first, 1)
    assert all(reports[r]["result"]["finished"] is False and reports[r]["result"]["preempted"] for r in range(2))
    ran = [reports[r]["seen"]["batches"] for r in range(2)]
    assert ran[0] == ran[1] and 3 <= len(ran[0]) < n // 4, ran  # the same batches, stopped early
    second = dict(spec, attempt=2, mesh={"replica": -1, "tp": 1})
    done = run_ranks(2, JOBS / "mesh_job.py", json.dumps(second), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = read_reports(spec, 2)
    assert all(reports[r]["result"]["metrics"] == {"examples": n, "index_sum": n * (n - 1) // 2} for r in range(2))
    assert read_outputs(str(Path(spec["storage"]))).column("index").to_pylist() == list(range(n))
