"""Code written for Determined runs after changing only its imports."""

from __future__ import annotations

import json

import pytest
import torch
from harness import JOBS, base_env, run_process, run_ranks, tbp_cmd, torchrun_cmd

pytestmark = pytest.mark.slow


def test_determined_style_script_runs_unchanged_under_torchrun(tmp_path):
    proc = run_process(torchrun_cmd(2, JOBS / "determined_style.py"), base_env(), 240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    storage = tmp_path / "tbp_runs" / "determined_style"  # default storage: ./tbp_runs/<script stem>
    indices = []
    for path in (storage / "outputs").rglob("prediction_output_*"):
        for output in torch.load(path, weights_only=False):
            assert output["predictions"].shape == (len(output["input"][1]), 10)
            indices += output["input"][1].tolist()
    assert sorted(indices) == list(range(1000)), "every image predicted exactly once"
    result = json.loads((storage / "result.json").read_text())
    assert result["metrics"] == {"examples": 1000} and result["finished"]


def test_distributed_context_and_provenance_of_determined_core_code(tmp_path):
    proc = run_ranks(2, JOBS / "determined_core_style.py", timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    storage = tmp_path / "tbp_runs" / "determined_core_style"
    assert json.loads((storage / "result.json").read_text())["metrics"] == {"examples": 100}
    status = run_process(tbp_cmd("status", str(storage), "--json"), base_env(), 120)
    assert status.returncode == 0, status.stderr
    provenance = json.loads(status.stdout)["provenance"]
    assert {"kind": "model_version", "model_id": 12, "model_version": 3, "name": "digits-cnn",
            "checkpoint_uuid": "5d7e8c1a-0000-4000-8000-000000000001"} in provenance
    assert {"kind": "checkpoint", "uuid": "5d7e8c1a-0000-4000-8000-000000000001"} in provenance
    assert len(provenance) == 2, "the same entries reported by both ranks are kept once"
    lines = [json.loads(line) for line in (storage / "metrics.jsonl").read_text().splitlines()]
    assert any(line["group"] == "provenance" for line in lines)


def test_every_distributed_context_method_of_determined_from_the_hooks(tmp_path):
    """``context.distributed`` has Determined's ``DistributedContext`` methods (``get_num_agents`` and the ``_local``
    collectives included), and they agree across ranks when called from ``on_checkpoint_start``/``on_finish``."""
    proc = run_ranks(2, JOBS / "determined_collectives.py", "33", timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = tmp_path / "tbp_runs" / "determined_collectives" / "outputs"
    seen = {r: json.loads(next(outputs.rglob(f"collectives_{r}.json")).read_text()) for r in range(2)}
    for rank, got in seen.items():
        assert got["ranks"] == [rank, 2, rank, 2, 0, 1, 1]
        assert got["allgather"] == [0, 10] and got["broadcast"] == "from 0"
        assert got["gather"] == ([100, 101] if rank == 0 else None)
        assert got["allgather_local"] == [0, 1] and got["broadcast_local"] == "local from 0"
        assert got["gather_local"] == ([0, 1] if rank == 0 else None)
    # 7 batches (33 examples) over 2 ranks: 4 steps, commits after steps 2 and 4; rank 0 has batches 0, 2, 4, 6
    assert seen[0]["checkpoint_counts"] == seen[1]["checkpoint_counts"] == [[10, 10], [18, 15]]


def test_rank_0_sees_every_rank_s_committed_files_in_on_finish_and_once_the_call_returns(tmp_path):
    """Rank 0's ``on_finish`` lists ``outputs/`` and finds every rank's files there, the last commit's included; once
    the call returns, rank 0 finds every rank's ``on_finish`` files. (Each rank published its own files after a
    closing commit without waiting for the others: rank 0 could run ``on_finish``, or return, first and miss another
    rank's last files.)"""
    report, finished = tmp_path / "seen.json", tmp_path / "finished.json"
    proc = run_ranks(2, JOBS / "finish_aggregates.py", "47", str(report), str(finished), timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(report.read_text()) == list(range(47))
    assert json.loads(finished.read_text()) == ["finished_rank0.txt", "finished_rank1.txt"]
