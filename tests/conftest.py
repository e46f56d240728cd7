"""Shared fixtures: a clean environment for in-process jobs, and storage on local disk, memory:// and S3 (moto)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from s3 import MotoServer, moto_available  # noqa: E402

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


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """One moto S3 server for the session; the AWS_* environment points at it (also for spawned workers)."""
    if not moto_available():
        pytest.skip("moto[server] and s3fs are not installed (pip install -e '.[dev]')")
    server = MotoServer()
    saved = {name: os.environ.get(name) for name in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


@pytest.fixture
def s3_url(moto_server: MotoServer) -> str:
    """A job folder in a fresh bucket of the session's moto server."""
    return f"s3://{moto_server.new_bucket()}/job"


@pytest.fixture
def memory_url() -> str:
    return f"memory://tbp-{uuid.uuid4().hex[:12]}/job"


@pytest.fixture(params=["local", "memory", "s3"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The job's storage on each backend: a local folder, memory:// and s3:// (moto)."""
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "memory":
        return request.getfixturevalue("memory_url")
    return request.getfixturevalue("s3_url")
