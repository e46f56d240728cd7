"""Shared fixtures: a clean environment for in-process jobs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_TBP_VARS = ("TBP_STORAGE_PATH", "TBP_JOB_NAME", "TBP_HPARAMS", "TBP_STORAGE_OPTIONS") + (
    "TBP_PROGRESS",
    "TBP_PROGRESS_INTERVAL",
    "TBP_TENSORBOARD",
    "TBP_PROFILE",
    "TBP_METRICS_INTERVAL",
    "TBP_STRAGGLER_RATIO",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process jobs run as one plain process, whatever the shell exported."""
    for name in _DIST_VARS + _TBP_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
