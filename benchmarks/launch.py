"""Starting one contender run as a real command, and reading back what it did.

Used by the runner and by the library-level scripts. Each run gets fresh output and report folders,
the same environment (one intra-op thread per process, offline Hugging Face, this checkout first on
``PYTHONPATH``) and a time limit; its output files are counted so that a run that lost or duplicated
examples is reported as failed, never as fast.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import count_output_rows

REPO = Path(__file__).resolve().parents[1]

CONTENDERS = (
    "hand_loop", "tbp", "tbp_dynamic", "tbp_bucket", "pl_trainer", "hf_accelerate", "ray_data", "sentence_transformers",
)
LABELS = {
    "hand_loop": "hand-written loop",
    "tbp": "torch_batch_process",
    "tbp_dynamic": "torch_batch_process, schedule=\"dynamic\"",
    "tbp_bucket": "torch_batch_process, bucket_by (+ dynamic with 2 processes)",
    "pl_trainer": "Lightning Trainer.predict",
    "hf_accelerate": "accelerate",
    "ray_data": "Ray Data",
    "sentence_transformers": "sentence-transformers encode (multi-process pool with 2 processes)",
}
# Contenders whose processes are started by torchrun (the others start their own processes).
TORCHRUN = {"hand_loop", "tbp", "tbp_dynamic", "tbp_bucket", "hf_accelerate"}
# Contenders that run some workloads only (the runner skips the others); the rest run every workload.
WORKLOADS_OF = {"sentence_transformers": ("minilm",)}
# Contenders that write one timing report whatever the number of processes (their workers are not ranks).
ONE_REPORT = {"ray_data", "sentence_transformers"}

RUN_TIMEOUT_S = 900


def worker_env(threads: int = 1) -> dict[str, str]:
    """The environment of every benchmark process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def contender_command(contender: str, nproc: int, args: list[str], rank_wrap: list[str] | None = None) -> list[str]:
    """The command line of one run: torchrun for multi-process torch contenders, else plain python.

    ``rank_wrap``: a command that runs each rank's own command (a profiler: ``py-spy record ... --``); under
    torchrun it is what torchrun starts (``--no-python``)."""
    module = f"benchmarks.contenders.{contender}"
    wrap = rank_wrap or []
    if nproc > 1 and contender in TORCHRUN:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if wrap:
            return [*launcher, "--no-python", *wrap, sys.executable, "-m", module, *args]
        return [*launcher, "-m", module, *args]
    return [*wrap, sys.executable, "-m", module, *args, "--nproc", str(nproc)]


@dataclass
class RunResult:
    """One run of one contender."""

    contender: str
    workload: str
    nproc: int
    round: int
    ok: bool
    examples: int
    job_s: float | None = None
    wall_s: float | None = None
    first_batch_s: float | None = None
    steady_throughput: float | None = None
    rows: int | None = None
    files: int | None = None
    error: str | None = None
    extra: dict[str, Any] | None = None

    @property
    def job_throughput(self) -> float | None:
        return self.examples / self.job_s if self.ok and self.job_s else None

    @property
    def wall_throughput(self) -> float | None:
        return self.examples / self.wall_s if self.ok and self.wall_s else None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["job_throughput"] = self.job_throughput
        data["wall_throughput"] = self.wall_throughput
        return data


def run_contender(
    contender: str,
    workload: str,
    nproc: int,
    num_examples: int,
    batch_size: int,
    workers: int,
    work_dir: Path,
    log_path: Path,
    round_index: int = 0,
    cache_dir: Path | None = None,
    extra_args: list[str] | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
    rank_wrap: list[str] | None = None,
) -> RunResult:
    """Runs one contender once, checks its outputs, deletes them, returns its timings (``rank_wrap``: see
    :func:`contender_command`)."""
    out, report = work_dir / "out", work_dir / "report"
    shutil.rmtree(work_dir, ignore_errors=True)
    report.mkdir(parents=True)
    args = [
        "--workload", workload, "--num-examples", str(num_examples), "--batch-size", str(batch_size),
        "--out", str(out), "--report", str(report), "--workers", str(workers), "--threads", "1",
    ]
    if cache_dir is not None:
        args += ["--cache", str(cache_dir)]
    args += extra_args or []
    command = contender_command(contender, nproc, args, rank_wrap)
    result = RunResult(contender, workload, nproc, round_index, ok=False, examples=num_examples)
    started = time.time()
    code = run_logged(command, log_path, timeout_s)
    result.wall_s = time.time() - started
    if code != 0:
        result.error = f"exit code {code}" if code is not None else f"timed out after {timeout_s:.0f} s"
        return result
    reports = [json.loads(p.read_text()) for p in sorted(report.glob("rank_*.json"))]
    expected = 1 if contender in ONE_REPORT else nproc
    if len(reports) != expected:
        result.error = f"{len(reports)} timing reports, expected {expected}"
        return result
    start = max(r["start"] for r in reports)
    result.job_s = max(r["end"] for r in reports) - start
    firsts = [r["first_batch"] for r in reports if r.get("first_batch")]
    result.first_batch_s = (min(firsts) - start) if firsts else None
    result.steady_throughput = steady_throughput(reports)
    result.extra = {k: v for r in reports[:1] for k, v in r.items() if k in ("commits", "timings")}
    result.extra["pids"] = [r.get("pid") for r in sorted(reports, key=lambda r: r["rank"])]
    by_rank = sorted(reports, key=lambda r: r["rank"])
    result.extra["cpu"] = [r.get("cpu") for r in by_rank]  # per rank, within the job clock
    result.extra["batches"] = [r.get("batches") for r in by_rank]  # process_batch calls per rank
    if any("checkpoint_starts" in r for r in by_rank):
        result.extra["checkpoint_starts"] = [r.get("checkpoint_starts") for r in by_rank]
    result.files, result.rows = count_output_rows(out) if out.exists() else (0, 0)
    if result.rows != num_examples:
        result.error = f"outputs hold {result.rows} rows, expected {num_examples}"
    else:
        result.ok = True
    shutil.rmtree(work_dir, ignore_errors=True)
    return result


def run_logged(command: list[str], log_path: Path, timeout_s: float) -> int | None:
    """Runs ``command`` in a session of its own, its output going to ``log_path`` (after the command
    line); returns its exit code, or None when it ran past ``timeout_s`` and was killed. Whatever the
    command left running in its session is killed too."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            command, cwd=str(REPO), env=worker_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    _reap_group(proc.pid)
    return code


def run_synthetic(
    job_args: list[str], nproc: int, report: Path, log_path: Path, timeout_s: float = RUN_TIMEOUT_S
) -> tuple[list[dict[str, Any]], float]:
    """Runs ``benchmarks.synthetic_job`` (under torchrun when ``nproc > 1``); returns its reports and wall time.

    Raises:
        RuntimeError: the job failed or timed out (its log is named).
    """
    shutil.rmtree(report, ignore_errors=True)
    module = ["-m", "benchmarks.synthetic_job"]
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    started = time.time()
    command = [*launcher, *module, *job_args, "--report", str(report), "--launched", repr(started)]
    code = run_logged(command, log_path, timeout_s)
    wall = time.time() - started
    if code != 0:
        raise RuntimeError(f"synthetic job failed ({'timeout' if code is None else f'exit code {code}'}); see {log_path}")
    reports = [json.loads(p.read_text()) for p in sorted(report.glob("rank_*.json"))]
    if len(reports) != nproc:
        raise RuntimeError(f"synthetic job wrote {len(reports)} reports, expected {nproc}; see {log_path}")
    return reports, wall


def steady_throughput(reports: list[dict[str, Any]]) -> float | None:
    """Examples per second between each process's first and last batch, summed over the processes:
    the per-batch cost alone, without start-up and finishing work. ``None`` without batch timestamps."""
    total = 0.0
    for r in reports:
        first, last, batches, examples = r.get("first_batch"), r.get("last_batch"), r.get("batches", 0), r.get("examples", 0)
        if not first or not last or batches < 2 or last <= first or not examples:
            return None
        total += examples * (batches - 1) / batches / (last - first)
    return total or None


def _reap_group(pgid: int) -> None:
    """Kills what a run left behind in its session (e.g. Ray's daemons), so it cannot slow the next run."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
