"""Helpers to run real multi-process jobs in tests and to check their outputs."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import forkserver

REPO = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).resolve().parent / "jobs"
GENERIC_JOB = JOBS / "generic_job.py"


def base_env(**extra: str) -> dict[str, str]:
    """Environment for worker processes: this checkout first on the path, one thread, quiet."""
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, script: Path | str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]


def run_torchrun(
    nproc: int, script: Path | str, *args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` under torchrun with ``nproc`` local workers; returns the finished process."""
    return run_process(torchrun_cmd(nproc, script, *args), env or base_env(), timeout)


def run_process(
    command: list[str], env: dict[str, str], timeout: float, cwd: Path | str = REPO
) -> subprocess.CompletedProcess[str]:
    """:func:`subprocess.run` of ``command`` from ``cwd`` with its output captured as text, forked by
    the suite's fork server where it can be (:func:`start_process`); on ``timeout`` the process is killed and
    :class:`subprocess.TimeoutExpired` raised, as ``subprocess.run`` does."""
    popen = _popen_class(command, env)
    with popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(cwd)) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            proc.kill()
            expired.output, expired.stderr = proc.communicate()
            raise
        return subprocess.CompletedProcess(command, proc.returncode, out, err)


def spawn_ranks(
    world_size: int, script: Path | str, *args: str, env: dict[str, str] | None = None, cwd: Path | str = REPO
) -> list[subprocess.Popen[str]]:
    """Starts ``world_size`` plain processes with the env contract (no torchrun agent), from ``cwd``."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(env or base_env())
        rank_env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(start_process([sys.executable, str(script), *args], rank_env, cwd))
    return procs


def run_ranks(
    world_size: int,
    script: Path | str,
    *args: str,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    cwd: Path | str = REPO,
) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` as ``world_size`` plain processes with the env contract (:func:`spawn_ranks`: forked by the
    suite's fork server, no torchrun agent, no fresh ``import torch`` per rank) and returns one outcome as
    :func:`run_torchrun` does: status 0 when every rank exits 0, else the first rank's non-zero status; the ranks'
    outputs one after the other. For a test whose claim is the job's, not torchrun's; on ``timeout`` the ranks are
    stopped and :class:`subprocess.TimeoutExpired` raised."""
    command = [sys.executable, str(script), *args]
    outcomes = wait_all(spawn_ranks(world_size, script, *args, env=env, cwd=cwd), timeout)
    out, err = "".join(o for _, o, _ in outcomes), "".join(e for _, _, e in outcomes)
    if any(rc is None for rc, _, _ in outcomes):
        raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err)
    returncode = next((rc for rc, _, _ in outcomes if rc != 0), 0)
    return subprocess.CompletedProcess(command, returncode, out, err)


def _popen_class(command: list[str], env: dict[str, str]) -> type[subprocess.Popen[str]]:
    """``forkserver.ForkedPopen`` for a command the suite's fork server can start, else ``subprocess.Popen``."""
    if forkserver.enabled() and forkserver.forkable(command, env):
        return forkserver.ForkedPopen
    return subprocess.Popen


def start_process(command: list[str], env: dict[str, str], cwd: Path | str = REPO) -> subprocess.Popen[str]:
    """Starts ``command`` from ``cwd`` (the repository root by default) in a session of its own (so that a test can
    kill its whole tree), with its output captured as text. A ``python SCRIPT``/``python -m MODULE`` command is forked
    by the suite's fork server (torch already imported: :mod:`forkserver`) unless ``TBP_TEST_FORKSERVER=0``."""
    popen = _popen_class(command, env)
    return popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(cwd),
        start_new_session=True,
    )


def wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int | None, str, str]]:
    """Waits for every process up to ``timeout`` seconds in total; kills the ones still running."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        remaining = max(0.1, deadline - time.monotonic())
        try:
            out, err = proc.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            out, err = stop_with_stacks(proc)
            results.append((None, out, err))
            continue
        results.append((proc.returncode, out, err))
    return results


def stop_with_stacks(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Kills a process that overran, after asking it for the stacks of its threads (the test jobs dump them
    on SIGUSR1 with :mod:`faulthandler`), so that a hang shows where it hung; returns its output."""
    out, err = "", ""
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        out, err = proc.communicate(timeout=5)  # the dump comes at once; a process without the handler exits
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its whole session: children too (torchrun's workers, loaders)
    except ProcessLookupError:
        pass
    if proc.returncode is None:
        more_out, more_err = proc.communicate()
        out, err = out + more_out, err + more_err
    return out, err


def job_spec(tmp_path: Path, **spec: Any) -> dict[str, Any]:
    """A spec for ``jobs/generic_job.py`` with storage and reports under ``tmp_path``."""
    spec.setdefault("storage", str(tmp_path / "storage"))
    spec.setdefault("report_dir", str(tmp_path / "reports"))
    return spec


def read_reports(spec: dict[str, Any], attempt: int = 1) -> dict[int, dict[str, Any]]:
    """Reports of one attempt, by rank."""
    reports = {}
    for path in Path(spec["report_dir"]).glob(f"attempt{attempt}_rank*.json"):
        report = json.loads(path.read_text())
        reports[report["rank"]] = report
    return reports


def storage_fs(url: str | Path) -> tuple[Any, str]:
    """The fsspec filesystem and root path of a storage path or URL, never serving stale listings."""
    import fsspec

    url = str(url)
    if url.startswith(("s3://", "gs://")):
        return fsspec.core.url_to_fs(url, use_listings_cache=False, skip_instance_cache=True)
    return fsspec.core.url_to_fs(url)


def read_outputs(url: str | Path, pattern: str = "*") -> dict[str, bytes]:
    """Committed output files below ``<url>/outputs``, by path relative to it, read through fsspec."""
    fs, root = storage_fs(url)
    base = f"{root.rstrip('/')}/outputs"
    if not fs.exists(base):
        return {}
    files = {}
    for full in sorted(fs.find(base, withdirs=False)):
        rel = full[len(base) :].lstrip("/") if full.startswith(base) else full.split("/outputs/", 1)[1]
        if fnmatch.fnmatch(rel.rsplit("/", 1)[-1], pattern):
            files[rel] = fs.cat_file(full)
    return files


def tree_digest(url: str | Path) -> dict[str, str]:
    """Every file below ``url`` with the sha256 of its content (to show that nothing changed)."""
    fs, root = storage_fs(url)
    if not fs.exists(root):
        return {}
    base = root.rstrip("/")
    files = sorted(fs.find(base, withdirs=False))
    return {full[len(base) :]: hashlib.sha256(fs.cat_file(full)).hexdigest() for full in files}


def _values(storage: str | Path, pattern: str) -> Counter[int]:
    counts: Counter[int] = Counter()
    for data in read_outputs(storage, pattern).values():
        counts.update(json.loads(data))
    return counts


def committed_values(storage: str | Path) -> Counter[int]:
    """Every example value found in committed output files (per-batch and buffered files)."""
    return _values(storage, "*.json")


def per_batch_values(storage: str | Path) -> Counter[int]:
    return _values(storage, "batch_*.json")


def buffered_values(storage: str | Path) -> Counter[int]:
    return _values(storage, "buffer_*.json")


def assert_exactly_once(counts: Counter[int], n: int) -> None:
    duplicates = sorted(v for v, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    extra = sorted(set(counts) - set(range(n)))
    assert not duplicates and not missing and not extra, (
        f"duplicates={duplicates[:20]} ({len(duplicates)}), missing={missing[:20]} ({len(missing)}), extra={extra[:20]}"
    )


def run_generic(
    spec: dict[str, Any], nproc: int = 2, *, attempt: int = 1, timeout: float = 180, launcher: str = "torchrun"
) -> tuple[subprocess.CompletedProcess[str] | list[tuple[int | None, str, str]], dict[int, dict[str, Any]]]:
    """Runs ``jobs/generic_job.py`` with ``spec``; returns the process outcome and the reports. ``launcher``:
    ``torchrun``, ``ranks`` (plain processes, one outcome as torchrun's: :func:`run_ranks`) or ``plain`` (a list of
    the ranks' outcomes)."""
    spec = dict(spec, attempt=attempt)
    if launcher == "torchrun":
        proc = run_torchrun(nproc, GENERIC_JOB, json.dumps(spec), timeout=timeout)
        return proc, read_reports(spec, attempt)
    if launcher == "ranks":
        return run_ranks(nproc, GENERIC_JOB, json.dumps(spec), timeout=timeout), read_reports(spec, attempt)
    if launcher == "plain" and nproc == 1:
        proc = run_process([sys.executable, str(GENERIC_JOB), json.dumps(spec)], base_env(), timeout)
        return proc, read_reports(spec, attempt)
    procs = spawn_ranks(nproc, GENERIC_JOB, json.dumps(spec))
    return wait_all(procs, timeout), read_reports(spec, attempt)


LAUNCHER = "torch_batch_process.launch.torch_distributed"


def launcher_cmd(*args: str) -> list[str]:
    """``python -m torch_batch_process.launch.torch_distributed ARGS...``."""
    return [sys.executable, "-m", LAUNCHER, *args]


def tbp_cmd(*args: str) -> list[str]:
    """The ``tbp`` console command of this checkout (``python -m torch_batch_process.launch.cli``)."""
    return [sys.executable, "-m", "torch_batch_process.launch.cli", *args]


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    """Polls ``predicate()`` until it is true; fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_for_progress(progress: Path, procs: list[subprocess.Popen[str]], timeout: float = 90) -> None:
    """Waits until a job's ranks touch ``progress`` (they are processing batches); fails the test at once if a
    rank exits before that (with its output), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not progress.exists():
        assert time.monotonic() < deadline, "the job never started processing"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.02)


def latest_commit_record(storage: str | Path) -> dict[str, Any] | None:
    """The latest durable commit record of the job at ``storage``, or ``None`` before the first one (a kill may
    come after the stages' rows were written but before rank 0's first record, or ``_tbp/commits`` was ever made)."""
    fs, root = storage_fs(storage)
    try:
        names = sorted(p for p in fs.ls(f"{root}/_tbp/commits", detail=False) if p.endswith(".json"))
    except FileNotFoundError:
        return None
    for name in reversed(names):
        try:
            return json.loads(fs.cat_file(name))
        except (FileNotFoundError, ValueError):  # superseded and deleted meanwhile, or being replaced
            continue
    return None


def committed_batches(storage: str) -> int:
    """Batches the latest durable commit record of the job at ``storage`` lists (0 without one)."""
    record = latest_commit_record(storage)
    return sum(b - a for a, b in record["committed"]) if record else 0


def commit_records(storage: Path) -> list[Path]:
    """The commit records currently in ``storage`` (the engine keeps the latest)."""
    return sorted((storage / "_tbp" / "commits").glob("*.json"))


def read_pid(pid_dir: Path, rank: int, restart: int = 0) -> int | None:
    """The pid ``jobs/generic_job.py`` wrote for ``rank`` at torchrun restart ``restart``, if written yet."""
    path = pid_dir / f"rank{rank}_restart{restart}.pid"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return int(text) if text.strip() else None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``); torchrun puts its workers in sessions of their own."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """Kills ``proc`` and every process below it with SIGKILL (test cleanup), then reaps ``proc``."""
    if proc.poll() is not None:
        return  # ended and reaped: its pid may belong to another process by now
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.communicate(timeout=30)
    except (ValueError, subprocess.TimeoutExpired):  # already read, or stuck: nothing more to do
        pass
