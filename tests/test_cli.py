"""The ``tbp`` command: it starts without importing torch, and it exits quietly (code 141, no traceback) when the
program reading its output (``head``, ``less``) goes away."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import REPO, base_env

from torch_batch_process import TorchBatchProcessor, torch_batch_process


class Quick(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        pass


def _finished_job(tmp_path: Path) -> Path:
    storage = tmp_path / "job"
    assert torch_batch_process(Quick, list(range(30)), batch_size=3, storage_path=str(storage), progress=False).finished
    return storage


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        pytest.param(["status"], marks=pytest.mark.slow),  # slow: the subprocess imports torch (see below)
        pytest.param(["status", "--json"], marks=pytest.mark.slow),
    ],
)
def test_tbp_writing_into_a_closed_pipe_exits_quietly_with_141(tmp_path, args):
    if args[0] == "status":
        args = [*args, str(_finished_job(tmp_path))]
    env = base_env()
    env.pop("PYTHONUNBUFFERED")  # a user's shell: stdout is block-buffered when it is a pipe
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (head, less...) is gone before tbp writes
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch_batch_process.launch.cli", *args],
            stdout=write_end, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO), timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == "", "no traceback, no 'Exception ignored' message"


class ManyMetrics(TorchBatchProcessor):
    """Its reduced metrics make ``tbp status --json`` print about 1 MB: more than a pipe holds."""

    def __init__(self, context):
        self.context = context
        context.wrap_reducer(lambda values: {f"metric_{i:05d}": i for i in range(40_000)})

    def process_batch(self, batch, batch_idx):
        pass


@pytest.mark.slow
def test_tbp_status_through_head_prints_the_first_line_and_no_traceback(tmp_path):
    storage = tmp_path / "job"
    result = torch_batch_process(ManyMetrics, list(range(6)), batch_size=3, storage_path=str(storage), progress=False)
    assert result.finished
    env = base_env()
    env.pop("PYTHONUNBUFFERED")
    command = f"set -o pipefail; {sys.executable} -m torch_batch_process.launch.cli status --json {storage} | head -n 1"
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, cwd=str(REPO), timeout=120)
    assert proc.stdout == "{\n"
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr[-2000:])


NO_TORCH_CHECK = textwrap.dedent(
    """
    import json, sys
    from torch_batch_process.launch.cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    sys.stdout.flush()
    heavy = sorted(m for m in ("torch", "numpy", "torch_batch_process.batch_process") if m in sys.modules)
    print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
    """
)


def _imports_of(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH_CHECK, *args],
        capture_output=True, text=True, env=base_env(), cwd=str(REPO), timeout=120,
    )
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["run", "--help"], ["status", "--help"]])
def test_tbp_help_imports_no_torch(args):
    assert _imports_of(*args) == {"code": 0, "heavy": []}


def test_tbp_status_of_a_job_imports_no_torch(tmp_path):
    assert _imports_of("status", str(_finished_job(tmp_path))) == {"code": 0, "heavy": []}


def test_tbp_run_dry_run_imports_no_torch(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("name: dry\nentrypoint: python3 job.py\nhyperparameters: {lr: 0.1}\n")
    assert _imports_of("run", str(config), "--dry-run") == {"code": 0, "heavy": []}


def test_tbp_status_names_the_job_in_quotes_without_the_raw_fingerprint_nor_a_missing_tensorboard_folder(
    tmp_path, capsys, caplog, monkeypatch
):
    """Issue 41 items 1 and 3 (the finished job's line says how to look at it; a job named 'job' logged and showed
    "job job"), issue 48 items 6 and 9 (how to run a finished job again; the fingerprint's dict, and a tensorboard
    folder that a job without the tensorboard package never wrote)."""
    from torch_batch_process.launch import cli
    from torch_batch_process.shell_commands import job_commands

    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="torch_batch_process")
    for _ in range(2):
        torch_batch_process(Quick, list(range(30)), batch_size=3, storage_path="job", progress=False,
                            tensorboard=False, job_name="job")
    logged = [record.getMessage() for record in caplog.records]
    assert [m for m in logged if m.startswith("job 'job' attempt 1: 30 examples in 10 batches")], logged
    (finished,) = [m for m in logged if m.startswith("finished: ")]
    assert finished.endswith("; look at the job: {} and {}".format(*job_commands("job")))
    assert job_commands("job")[0].endswith("status job")
    assert [m for m in logged if "is already finished; nothing to do (to run it again: another storage_path, or "
            "resume=False" in m], logged
    storage = tmp_path / "job"
    capsys.readouterr()
    assert cli.main(["status", str(storage)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(None, 1) == ["job", "'job': processor test_cli.Quick over 30 examples (builtins.list) in "
                                       f"batches of 3; fingerprint {lines[0].rsplit(' ', 1)[1]}"], lines[0]
    assert not [line for line in lines if "{" in line or "dataset_length=" in line or line.startswith("tensorboard")]


class _FailsAt7(Quick):
    def process_batch(self, batch, batch_idx):
        if 7 in batch:
            raise ValueError("example 7")


def test_a_retry_of_the_failed_examples_names_the_job_in_quotes(tmp_path, caplog, monkeypatch):
    """Issue 41 item 3, in the one other log line that names the job: a job named 'job' logged "retry 1 of job job"."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO", logger="torch_batch_process")
    for retry in (False, True):
        torch_batch_process(_FailsAt7, list(range(12)), batch_size=3, storage_path="job", progress=False,
                            tensorboard=False, job_name="job", on_error="skip", retry_failed=retry)
    assert [r for r in caplog.records if r.getMessage().startswith("retry 1 of job 'job': 1 failed example(s)")]


def test_the_commands_printed_for_the_user_run_as_printed_here(tmp_path, monkeypatch):
    """Issue 48 items 2 and 5: a bare ``tbp`` (the README never activates its venv) and an install hint in a form the
    README does not use; the library names this environment's own ``tbp``/``pip`` and this checkout."""
    from torch_batch_process.shell_commands import job_commands, pip_install, shell_path, tbp_command

    bin_dir = Path(sys.executable).parent
    monkeypatch.setenv("PATH", str(tmp_path))  # the venv is not activated
    monkeypatch.chdir(REPO)
    tbp = tbp_command()
    assert tbp == shell_path(bin_dir / "tbp") or tbp.endswith(" -m torch_batch_process.launch.cli"), tbp
    status, report = job_commands("tbp_runs/embed_docstrings")
    assert (status, report) == (f"{tbp} status tbp_runs/embed_docstrings", f"{tbp} report tbp_runs/embed_docstrings")
    pip = pip_install("report")
    assert pip.endswith(' install -e ".[report]"') and pip.split(" install")[0] in (
        shell_path(bin_dir / "pip"), f"{shell_path(sys.executable)} -m pip"), pip
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{tmp_path}")  # activated: the bare names run
    if (bin_dir / "tbp").exists():
        assert tbp_command() == "tbp"
    monkeypatch.chdir(tmp_path)
    assert pip_install("report").endswith(f' install -e "{REPO}[report]"')
