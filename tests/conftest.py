"""Shared fixtures: a clean environment for in-process jobs, storage on local disk, memory:// and S3 (moto), and the
rule that makes the README's quick lane (``-m "not slow"``) true: a test not marked ``slow`` starts no job process."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import LAUNCHER, REPO  # noqa: E402
from s3 import MotoServer, moto_available  # noqa: E402

from torch_batch_process import settings  # noqa: E402

_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_TBP_VARS = tuple(variable.name for variable in settings.VARIABLES)  # every TBP_* variable the library reads


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


_JOB_SCRIPTS = tuple(str(REPO / folder) + os.sep for folder in ("tests/jobs", "examples", "benchmarks"))


def starts_a_job(args: Any, env: dict[str, str] | None) -> bool:
    """Whether a process started with ``args`` runs a job (several ranks, a launcher, ``tbp run``, a job script):
    what only ``slow`` tests may do. ``tbp status``, ``tbp --help`` and the like are quick commands."""
    if env is not None and env.get("WORLD_SIZE"):
        return True
    argv = [os.fspath(a) for a in args] if isinstance(args, Sequence) and not isinstance(args, (str, bytes)) else []
    if "torch.distributed.run" in argv or LAUNCHER in argv:
        return True
    if any(arg.startswith(_JOB_SCRIPTS) for arg in argv):
        return True
    if "torch_batch_process.launch.cli" in argv:
        rest = argv[argv.index("torch_batch_process.launch.cli") + 1 :]
        return rest[:1] == ["run"] and not {"--dry-run", "--help", "-h"} & set(rest)
    return False


@pytest.fixture(autouse=True)
def _quick_tests_start_no_job(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that is not marked ``slow`` fails when it starts a job process: the quick lane has no multi-process
    test (the README says so, and times it)."""
    if request.node.get_closest_marker("slow") is not None:
        return
    start = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if starts_a_job(args, kwargs.get("env")):
            pytest.fail(f"{request.node.nodeid} starts a job process ({args!r}): mark it @pytest.mark.slow")
        start(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
