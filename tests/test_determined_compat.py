"""Code written for Determined runs after changing only its imports."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from harness import JOBS, base_env, torchrun_cmd

pytestmark = pytest.mark.slow


def test_determined_style_script_runs_unchanged_under_torchrun(tmp_path):
    proc = subprocess.run(
        torchrun_cmd(2, JOBS / "determined_style.py"), cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=240
    )
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
