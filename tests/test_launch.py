"""The launcher: the torchrun invocation it builds, rank-prefixed output, exit codes, preemption by signal."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from itertools import pairwise
from typing import Any

import pytest
from harness import (
    GENERIC_JOB,
    REPO,
    assert_exactly_once,
    base_env,
    commit_records,
    committed_values,
    job_spec,
    kill_tree,
    launcher_cmd,
    read_pid,
    read_reports,
    run_process,
    start_process,
    wait_for,
)

from torch_batch_process import TorchBatchProcessor, read_outputs, torch_batch_process
from torch_batch_process.launch.rank_prefix import split_lines
from torch_batch_process.launch.slurm import first_host
from torch_batch_process.launch.torch_distributed import RANK_PREFIX_SCRIPT, LaunchError, plan_launch, resolve_command

# ------------------------------------------------------------------ the torchrun invocation


def _value(argv: list[str], option: str) -> str | None:
    """The last value given to ``option`` in ``argv`` (argparse keeps the last)."""
    values = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == option]
    return values[-1] if values else None


def test_one_node_defaults_standalone_one_worker_without_gpu_and_prefix_wrapper():
    plan = plan_launch(["python3", "job.py", "--flag", "1"], environ={})
    argv = plan.torchrun_argv
    assert "--standalone" in argv
    assert _value(argv, "--nproc-per-node") == "1"  # no GPU on the test machine
    assert argv[argv.index("--no-python") + 1 :] == [
        sys.executable,
        RANK_PREFIX_SCRIPT,
        sys.executable,
        "job.py",
        "--flag",
        "1",
    ]
    assert plan.command == [sys.executable, "job.py", "--flag", "1"]
    assert plan.max_restarts == 0


def test_torchrun_options_pass_through_and_multi_node_uses_c10d():
    plan = plan_launch(
        ["--nnodes", "2", "--nproc-per-node", "3", "--max-restarts", "2", "--rdzv-endpoint", "head:29400",
         "--rdzv-id", "job7", "--", "python", "job.py"],
        environ={},
    )  # fmt: skip
    argv = plan.torchrun_argv
    assert _value(argv, "--nnodes") == "2" and _value(argv, "--nproc-per-node") == "3"
    assert _value(argv, "--max-restarts") == "2" and _value(argv, "--rdzv-id") == "job7"
    assert _value(argv, "--rdzv-backend") == "c10d" and _value(argv, "--rdzv-endpoint") == "head:29400"
    assert "--standalone" not in argv and "--" not in argv
    assert plan.command == [sys.executable, "job.py"] and plan.max_restarts == 2


def test_an_explicit_backend_and_torchrun_environment_defaults_are_kept():
    plan = plan_launch(["--nnodes", "2", "--rdzv-backend", "static", "--master-addr", "h", "job.py"], environ={})
    assert _value(plan.torchrun_argv, "--rdzv-backend") == "static"
    plan = plan_launch(["job.py"], environ={"PET_NPROC_PER_NODE": "4"})  # torchrun's own env contract
    assert _value(plan.torchrun_argv, "--nproc-per-node") is None


def test_kubeflow_pytorchjob_environment_is_torchrun_contract(monkeypatch):
    """PyTorchJob sets PET_* variables; torchrun's parser reads them, so the launcher needs no option."""
    for name, value in {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
                        "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    plan = plan_launch(["python3", "job.py"])
    argv = plan.torchrun_argv
    assert "--standalone" not in argv and "--rdzv-backend" not in argv and "--nproc-per-node" not in argv
    assert (plan.nnodes, plan.nproc_per_node) == ("2", "4")


SLURM_STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1",
}  # fmt: skip


def test_started_by_srun_on_two_nodes_the_step_gives_the_rendezvous():
    plan = plan_launch(["--nproc-per-node", "4", "python3", "job.py"], environ=SLURM_STEP)
    argv = plan.torchrun_argv
    assert _value(argv, "--nnodes") == "2" and plan.nnodes == "2"
    assert _value(argv, "--rdzv-endpoint") == "gpu07:29400" and _value(argv, "--rdzv-backend") == "c10d"
    assert _value(argv, "--rdzv-id") == "slurm-4242.0" and "--standalone" not in argv
    explicit = plan_launch(["--rdzv-endpoint", "head:1234", "--rdzv-id", "x", "job.py"], environ=SLURM_STEP)
    assert _value(explicit.torchrun_argv, "--rdzv-endpoint") == "head:1234"  # the command line wins
    assert _value(explicit.torchrun_argv, "--rdzv-id") == "x"
    with pytest.raises(LaunchError, match="start one launcher per node"):
        plan_launch(["job.py"], environ=dict(SLURM_STEP, SLURM_STEP_NUM_TASKS="8"))
    one_node = plan_launch(["job.py"], environ=dict(SLURM_STEP, SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1"))
    assert "--standalone" in one_node.torchrun_argv


@pytest.mark.parametrize(
    "nodelist,first",
    [("gpu[07-09,12],cpu1", "gpu07"), ("node1,node2", "node1"), ("a-b[3,5]", "a-b3"), ("solo", "solo")],
)
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


def test_commands_modules_and_no_prefix():
    assert resolve_command(["python3", "-u", "x.py"]) == [sys.executable, "-u", "x.py"]
    assert resolve_command(["x.py", "a"]) == [sys.executable, "x.py", "a"]
    assert resolve_command(["/usr/bin/env", "bash", "-c", "true"]) == ["/usr/bin/env", "bash", "-c", "true"]
    plan = plan_launch(["-m", "pkg.mod", "arg"], environ={})
    assert plan.command == [sys.executable, "-m", "pkg.mod", "arg"] and "-m" not in plan.torchrun_argv[:-4]
    plan = plan_launch(["--no-rank-prefix", "python3", "x.py"], environ={})
    assert "--no-rank-prefix" not in plan.torchrun_argv
    assert plan.torchrun_argv[plan.torchrun_argv.index("--no-python") + 1 :] == [sys.executable, "x.py"]


def test_omp_num_threads_is_set_for_several_workers_only_where_the_user_set_none(monkeypatch):
    """Issue 41 item 2: torchrun prints a three-line ``*****`` banner and sets 1 when several workers run and
    ``OMP_NUM_THREADS`` is unset; the launcher sets it first (the cores divided among the workers), and leaves the
    user's value and a single worker alone (a slow test below checks the banner is gone from a real launch)."""
    from torch_batch_process.launch.torch_distributed import worker_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert worker_threads("2", {}) == 4 and worker_threads("3", {}) == 2 and worker_threads("16", {}) == 1
    assert worker_threads("2", {"OMP_NUM_THREADS": "3"}) is None  # the user's choice
    assert worker_threads("1", {}) is None  # one worker may use every core; torchrun prints nothing then


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nproc-per-node", "2"], "no command to run"),
        (["--nnodes", "2", "job.py"], "--rdzv-endpoint HOST:PORT"),
        (["--run-path", "job.py"], "--run-path is not supported"),
        (["--nproc", "2", "job.py"], "unrecognized arguments"),  # no abbreviations: typos are not guessed
        # torchrun fails on these with an AssertionError (an empty one for --nproc-per-node 0), once it runs
        (["--nproc-per-node", "0", "job.py"], "--nproc-per-node must be >= 1 (workers on this node), got 0"),
        (["--nproc-per-node", "-2", "job.py"], "--nproc-per-node must be >= 1"),
        (["--nproc-per-node", "two", "job.py"], "--nproc-per-node must be an int >= 1 or auto, cpu, gpu or xpu"),
        (["--max-restarts", "-1", "job.py"], "--max-restarts must be an int >= 0"),
        (["--nnodes", "0", "job.py"], "--nnodes '0': give N >= 1 nodes"),
        (["--nnodes", "3:2", "job.py"], "--nnodes '3:2': give N >= 1 nodes, or MIN:MAX with 1 <= MIN <= MAX"),
    ],
)
def test_bad_launcher_command_lines(argv, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        plan_launch(argv, environ={})


def test_split_lines_keeps_whole_lines_only():
    assert split_lines(b"", b"a\nb") == ([b"a\n"], b"b")
    assert split_lines(b"b", b"c\r\nd\re\r") == ([b"bc\r\n", b"d\r"], b"e\r")  # a final \r may start \r\n
    assert split_lines(b"e\r", b"\n") == ([b"e\r\n"], b"")
    assert split_lines(b"", b"a\r\rb") == ([b"a\r", b"\r"], b"b")
    lines, rest = split_lines(b"", b"x" * (2 << 20))  # no newline in 2 MiB: written in one piece, not held
    assert lines == [b"x" * (2 << 20)] and rest == b""


def test_split_lines_over_random_chunks_loses_and_splits_nothing():
    rng = random.Random(7)
    for _ in range(3000):
        data = bytes(rng.choice(b"ab\r\n") for _ in range(rng.randint(0, 40)))
        pending, lines, i = b"", [], 0
        while i < len(data):
            size = rng.randint(1, 6)
            new, pending = split_lines(pending, data[i : i + size])
            lines += new
            i += size
        assert b"".join(lines) + pending == data
        assert all(line.endswith((b"\n", b"\r")) for line in lines)
        assert not any(a.endswith(b"\r") and b.startswith(b"\n") for a, b in pairwise(lines))  # \r\n kept


def test_torchs_own_rank_prefix_is_not_doubled():
    """Issue 26 item 9: torch's exception hook prefixes traceback lines with ``[rank1]: ``, and the launcher's
    prefix came on top (``[rank 1] [rank1]: Traceback``)."""
    from torch_batch_process.launch.rank_prefix import _copy

    read_end, write_end = os.pipe()
    out_read, out_write = os.pipe()
    os.write(
        write_end, b"[rank1]: Traceback (most recent call last):\n[rank1]:   File x\n[rank0]: other\nplain [rank1]: \n"
    )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as source:
        _copy(source, out_write, b"[rank 1] ", b"[rank1]: ")
    os.close(out_write)
    with os.fdopen(out_read, "rb") as result:
        assert result.read().decode().splitlines() == [
            "[rank 1] Traceback (most recent call last):",
            "[rank 1]   File x",
            "[rank 1] [rank0]: other",  # another rank's prefix is not this worker's: kept
            "[rank 1] plain [rank1]: ",
        ]


_FAILING_WORKER = textwrap.dedent(
    """
    import sys
    from torch_batch_process import TorchBatchProcessor, torch_batch_process

    class P(TorchBatchProcessor):
        def __init__(self, context):
            self.rank = context.get_distributed_rank()

        def process_batch(self, batch, batch_idx):
            if self.rank == 1:
                raise ValueError("bad batch")

    torch_batch_process(P, list(range(8)), batch_size=2, storage_path=sys.argv[1], progress=False)
    """
)


@pytest.mark.slow
def test_a_traceback_under_the_launcher_carries_one_rank_prefix(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(_FAILING_WORKER)
    proc = subprocess.run(
        launcher_cmd("--nproc-per-node", "2", "python3", str(script), str(tmp_path / "storage")),
        env=base_env(), capture_output=True, text=True, timeout=180, cwd=str(REPO),
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[rank 1] Traceback (most recent call last):" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "[rank1]:" not in proc.stderr and "[rank0]:" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].endswith("the last commit is intact: fix what its output above says, then run "
                                                 "the same command again to resume"), proc.stderr[-3000:]


_LOSABLE_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from torch_batch_process import TorchBatchProcessor, torch_batch_process

    class P(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context
            Path(sys.argv[1], f"pid{context.get_distributed_rank()}").write_text(str(os.getpid()))

        def process_batch(self, batch, batch_idx):
            time.sleep(float(sys.argv[3]))
            self.context.write({"value": [int(v) for v in batch]})

    torch_batch_process(P, list(range(200)), batch_size=2, checkpoint_interval=2, storage_path=sys.argv[2],
                        progress=False)
    """
)


@pytest.mark.slow
def test_a_worker_killed_under_the_launcher_is_named_in_one_line_per_rank_and_the_same_command_resumes(tmp_path):
    """Issue 48 item 7: the surviving rank claimed a SIGTERM nobody sent, printed a 35-line traceback for the lost
    peer, and the launcher named the pid of the worker's wrapper; issue 41 item 2: torchrun's OMP_NUM_THREADS banner.
    The survivor hears of the loss from its next exchange with the peer, or first from the agent's SIGTERM (then it
    says so: see test_a_sigterm_from_the_agent_after_a_worker_died_is_worded_so)."""
    script, storage = tmp_path / "job.py", tmp_path / "storage"
    script.write_text(_LOSABLE_WORKER)
    env = base_env()
    env.pop("OMP_NUM_THREADS")  # the user set none
    command = launcher_cmd("--nproc-per-node", "2", "python3", str(script), str(tmp_path), str(storage))
    proc = start_process([*command, "0.05"], env)
    try:
        wait_for(lambda: commit_records(storage) or proc.poll() is not None, 120, "the first commit")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        victim = int((tmp_path / "pid1").read_text())
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
    finally:
        kill_tree(proc)
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    lines = err.splitlines()
    assert "*****" not in err and "[launcher] OMP_NUM_THREADS=" in lines[0], err[-3000:]
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    assert [line for line in lines if line.startswith("[rank 0] WorkerLostError:")] == [
        f"[rank 0] WorkerLostError: rank 0 stopped: rank 1 (pid {victim}) died of SIGKILL. The last commit is intact: "
        "run the same command again to resume from it"
    ], err[-3000:]
    told = [line for line in lines if "SIGTERM" in line]
    assert all(f"SIGTERM from the launcher's agent, after rank 1 (pid {victim}) died of SIGKILL" in t for t in told)
    assert lines[-1] == (
        f"[launcher] the job failed: rank 1 (local rank 1, pid {victim}) ended with signal SIGKILL; the last commit is "
        "intact: run the same command again to resume"
    ), err[-3000:]
    assert len(lines) <= 5, err  # the OMP line, rank 0's start, SIGTERM and lost-peer lines, the launcher's
    again = subprocess.run([*command, "0"], env=env, capture_output=True, text=True, timeout=180, cwd=str(REPO))
    assert again.returncode == 0, again.stderr[-3000:]
    from torch_batch_process import read_outputs

    assert read_outputs(str(storage)).column("value").to_pylist() == list(range(200))


# ------------------------------------------------------------------ real launches

_WORKER = textwrap.dedent(
    """
    import os, sys, time
    rank = int(os.environ["RANK"])
    sys.stdout.write(f"hello from {rank}")  # a line written in three pieces
    sys.stdout.flush()
    time.sleep(0.3)
    sys.stdout.write(" and")
    sys.stdout.flush()
    time.sleep(0.3)
    sys.stdout.write(" goodbye\\n")
    for i in range(300):
        print(f"line {i} of rank {rank} " + "x" * 60)
    print(f"to stderr from {rank}", file=sys.stderr)
    sys.stdout.write(f"unfinished last line of {rank}")
    if rank == 1 and sys.argv[1] == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), 9)
    sys.exit(int(sys.argv[1]) if rank == 1 else 0)
    """
)


def _launch(tmp_path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    return run_process(launcher_cmd("--nproc-per-node", "2", "python3", str(script), *args), base_env(), timeout)


@pytest.mark.slow
def test_two_workers_output_lines_carry_their_rank_and_success_exits_0(tmp_path):
    proc = _launch(tmp_path, "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    pattern = re.compile(
        r"^\[rank ([01])\] (hello from \1 and goodbye|line \d+ of rank \1 x{60}|unfinished last line of \1)$"
    )
    broken = [line for line in lines if not pattern.match(line)]
    assert not broken, broken[:5]
    for rank in (0, 1):
        assert sum(line.startswith(f"[rank {rank}] line ") for line in lines) == 300
        assert f"[rank {rank}] hello from {rank} and goodbye" in lines
        assert f"[rank {rank}] to stderr from {rank}" in proc.stderr.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("how,expected", [("3", 3), ("kill", 128 + signal.SIGKILL)])
def test_a_failing_job_exit_code_passes_through(tmp_path, how, expected):
    proc = _launch(tmp_path, how)
    assert proc.returncode == expected, proc.stderr[-3000:]
    reason = "exit code 3" if how == "3" else "signal SIGKILL"
    assert re.search(rf"\[launcher\] the job failed: rank 1 .* ended with {reason}", proc.stderr), proc.stderr[-3000:]
    assert "[rank 1] unfinished last line of 1" in proc.stdout.splitlines()


def _start_generic(spec: dict, *extra: str) -> subprocess.Popen[str]:
    return start_process(
        launcher_cmd("--nproc-per-node", "2", *extra, "python3", str(GENERIC_JOB), json.dumps(spec)), base_env()
    )


def _preempted_run(
    tmp_path, launcher_signal: int = signal.SIGTERM, also_signal_workers: bool = False
) -> tuple[dict, subprocess.Popen[str], str, float]:
    """Starts a 2-worker job, signals it once it committed; returns (spec, process, stderr, seconds to stop)."""
    spec = job_spec(
        tmp_path, n=400, batch_size=2, checkpoint_interval=3, sleep=0.05, pid_dir=str(tmp_path / "pids"), attempt=1
    )
    storage = tmp_path / "storage"
    proc = _start_generic(spec)
    workers: list[int] = []
    try:
        wait_for(lambda: commit_records(storage) or proc.poll() is not None, 120, "the first commit")
        assert proc.poll() is None, "the job ended before it could be preempted"
        workers = [pid for pid in (read_pid(tmp_path / "pids", rank) for rank in (0, 1)) if pid]
        started = time.monotonic()
        os.kill(proc.pid, launcher_signal)
        if also_signal_workers:  # as Slurm does: every process of the job step gets the signal
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # returns once the workers' output pipes are closed
        return spec, proc, err, time.monotonic() - started
    finally:
        kill_tree(proc)
        for pid in workers:  # workers outlive a killed launcher if something went wrong
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_ctrl_c_after_the_job_finished_is_not_reported_as_a_preemption(tmp_path):
    """Issue 26 item 8: SIGINT reached the launcher while the workers ran their own code after a finished job;
    it said "stopped by SIGINT ... run the same command again to resume" and exited 130."""
    spec = job_spec(tmp_path, n=20, batch_size=2, sleep_after=60, attempt=1)
    proc = _start_generic(spec)
    try:
        # both workers in their own code: a worker still in the call (its last steps) would take the SIGINT as a
        # preemption, go on into its sleep, and be killed only at torchrun's --shutdown-timeout (30 s)
        returned = [tmp_path / "reports" / f"returned_rank{rank}" for rank in (0, 1)]
        wait_for(lambda: all(p.exists() for p in returned) or proc.poll() is not None, 120, "the end of the job")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "[launcher] SIGINT came after the job had finished: its outputs and result are stored" in err, err[-3000:]
    assert "run the same command again to resume" not in err


@pytest.mark.slow
def test_sigterm_to_the_launcher_commits_stops_and_the_same_command_resumes_exactly_once(tmp_path):
    spec, proc, err, seconds = _preempted_run(tmp_path)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "[launcher] stopped by SIGTERM" in err and "death signal" not in err  # torchrun's agent's line left out
    reports = read_reports(spec, 1)
    assert sorted(reports) == [0, 1]
    assert all(r["result"]["preempted"] for r in reports.values()), err[-3000:]  # returned, not killed
    first = committed_values(tmp_path / "storage")
    assert max(first.values()) == 1 and 0 < len(first) < 400
    assert seconds < 20, f"the job took {seconds:.1f}s to stop"  # a commit, not torchrun's kill after 30s

    spec2 = dict(spec, attempt=2, sleep=0)
    proc2 = run_process(
        launcher_cmd("--nproc-per-node", "2", "python3", str(GENERIC_JOB), json.dumps(spec2)), base_env(), 180
    )
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert_exactly_once(committed_values(tmp_path / "storage"), 400)
    result = read_reports(spec2, 2)[0]["result"]
    assert result["finished"] and result["batches_skipped"] == len(first) // 2
    assert re.search(r"\[rank 0\] .*attempt 2: resuming at batch \d+", proc2.stderr), proc2.stderr[-3000:]


@pytest.mark.slow
def test_a_signal_sent_to_the_workers_and_to_the_launcher_still_commits(tmp_path):
    """Slurm signals every process of a step: the workers get SIGTERM directly and again from torchrun."""
    spec, proc, err, _ = _preempted_run(tmp_path, also_signal_workers=True)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    reports = read_reports(spec, 1)
    assert all(r["result"]["preempted"] for r in reports.values()), err[-3000:]
    assert "stopping now without a commit" not in err
    counts = committed_values(tmp_path / "storage")
    assert max(counts.values()) == 1 and set(counts) <= set(range(400))


@pytest.mark.slow
def test_workers_of_a_killed_launcher_commit_and_stop_instead_of_running_on(tmp_path):
    """torchrun's workers run in sessions of their own: without the launcher's wrapper they would outlive it."""
    spec, proc, err, seconds = _preempted_run(tmp_path, launcher_signal=signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    reports = read_reports(spec, 1)
    assert all(r["result"]["preempted"] for r in reports.values()), err[-3000:]
    counts = committed_values(tmp_path / "storage")
    assert max(counts.values()) == 1 and 0 < len(counts) < 400
    assert seconds < 20, f"the workers took {seconds:.1f}s to stop"


# ------------------------------------------------------------------ one request per signal burst


def test_a_repeated_signal_is_one_request_unless_it_comes_later(monkeypatch):
    """A worker gets SIGTERM from the scheduler and again from torchrun: one request. Later, it means "now"."""
    from torch_batch_process.engine.schedule import preemption

    monkeypatch.setattr(preemption, "REPEAT_WINDOW_S", 0.5)
    # Python's own Ctrl-C handler, whatever started pytest (a shell's background job starts with SIGINT ignored)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with preemption.SignalWatcher() as watcher:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # the same request, delivered twice
            assert watcher.requested == "SIGINT"
            time.sleep(0.6)
            with pytest.raises(KeyboardInterrupt):  # an impatient second Ctrl-C: stop at once
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


def test_a_sigterm_from_the_agent_after_a_worker_died_is_worded_so(tmp_path, monkeypatch):
    """What the rank wrapper notes when its command dies of a signal, read by a surviving rank: the SIGTERM that
    torchrun's agent then sends is not the user's, and the lost peer is named (issue 48 item 7)."""
    from torch_batch_process.environment import LAUNCH_STATE_ENV
    from torch_batch_process.errors import WorkerLostError
    from torch_batch_process.launch import rank_prefix
    from torch_batch_process.lost_workers import LOST_SUFFIX, lost_peer_line, signal_origin

    assert (rank_prefix._LAUNCH_STATE_ENV, rank_prefix._LOST_SUFFIX) == (LAUNCH_STATE_ENV, LOST_SUFFIX)
    monkeypatch.setenv(LAUNCH_STATE_ENV, str(tmp_path / "state"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("torch_batch_process.lost_workers.NOTE_WAIT_S", 0.1)
    try:
        raise WorkerLostError("rank 0: another rank stopped answering (Connection reset by peer)") from OSError(
            "Connection reset by peer"
        )
    except WorkerLostError as exc:
        error = exc
    assert signal_origin("SIGTERM") == "SIGTERM received"
    assert lost_peer_line(error) == "rank 0: another rank stopped answering"  # the transport's report left out
    monkeypatch.setenv("RANK", "1")
    rank_prefix._note_lost("1", 4242, signal.SIGKILL)
    monkeypatch.setenv("RANK", "0")
    assert signal_origin("SIGTERM") == "SIGTERM from the launcher's agent, after rank 1 (pid 4242) died of SIGKILL"
    assert signal_origin("SIGINT") == "SIGINT received"
    assert lost_peer_line(error) == (
        "rank 0 stopped: rank 1 (pid 4242) died of SIGKILL. The last commit is intact: run the same command again to "
        "resume from it"
    )


class _HangsUpAtItsThirdBatch(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        self.context.write({"i": [int(i) for i in self.context.batch_indices]})
        if batch_idx == 2 and not HANGUPS:
            signal.raise_signal(signal.SIGHUP)


HANGUPS: list[int] = []
"""SIGHUPs that reached the handler installed before the job (the script's own, or the default: death)."""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_a_hangup_is_a_preemption_and_the_scripts_own_handler_is_put_back(tmp_path):
    """SIGHUP (a terminal's hangup, which torchrun and the launcher forward to the workers) killed a rank without a
    commit, while the launcher said the workers were asked to commit and stop."""
    outer = signal.signal(signal.SIGHUP, lambda signum, frame: HANGUPS.append(signum))
    try:
        options = {"batch_size": 2, "storage_path": str(tmp_path / "s"), "checkpoint_interval": 1, "progress": False}
        first = torch_batch_process(_HangsUpAtItsThirdBatch, list(range(12)), **options)
        assert first.preempted and not first.finished and HANGUPS == []
        signal.raise_signal(signal.SIGHUP)  # after the call: the script's own handler again
        assert HANGUPS == [signal.SIGHUP]
        second = torch_batch_process(_HangsUpAtItsThirdBatch, list(range(12)), **options)
        assert second.finished and sorted(read_outputs(str(tmp_path / "s")).to_pydict()["i"]) == list(range(12))
        HANGUPS.clear()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # `nohup`: a hangup is ignored, the job runs to its end
        options["storage_path"] = str(tmp_path / "nohup")
        third = torch_batch_process(_HangsUpAtItsThirdBatch, list(range(12)), **options)
        assert third.finished and not third.preempted
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, outer)
