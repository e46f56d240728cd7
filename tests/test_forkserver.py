"""The suite's fork server (tests/forkserver.py) starts processes that behave as executed ones: arguments, folder,
environment, streams, exit codes, signals, sessions, threads and atexit callbacks, and fresh random state."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import forkserver
import pytest
from harness import base_env, start_process

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="the fork server is off (TBP_TEST_FORKSERVER=0)")

PROBE = textwrap.dedent(
    """
    import sys
    torch_preloaded = "torch" in sys.modules  # before this script imports anything that could import it
    import atexit, json, os, random, signal, threading, time
    mode = sys.argv[1]
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "probe": os.environ.get("PROBE"),
        "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "random": random.random(),
        "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "library_imported": "torch_batch_process" in sys.modules,
        "torch_preloaded": torch_preloaded,
    }), flush=True)
    print("to stderr", file=sys.stderr)
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise ValueError("boom")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "sleep":
        time.sleep(60)
    if mode == "thread":
        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread ended", flush=True))).start()
    """
)
RAISE_LINE = PROBE.splitlines().index('    raise ValueError("boom")') + 1


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def _run(probe: Path, *args: str, **env: str) -> tuple[int | None, dict, str, str]:
    proc = start_process([sys.executable, str(probe), *args], base_env(**env))
    assert isinstance(proc, forkserver.ForkedPopen)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, json.loads(out.splitlines()[0]), out, err


def test_a_forked_script_gets_its_arguments_folder_environment_and_streams(probe: Path) -> None:
    code, seen, out, err = _run(probe, "ok", "x y", PROBE="42")
    assert code == 0
    assert seen["argv"] == [str(probe), "ok", "x y"]
    assert seen["path0"] == str(probe.parent)
    assert seen["probe"] == "42"
    assert Path(seen["cwd"]) == Path(__file__).resolve().parents[1]
    assert seen["pid"] == seen["pgid"] == seen["sid"]  # a session of its own, as start_process asks
    assert not seen["library_imported"]  # the server preloads torch only; the library is the child's own import
    assert seen["sigterm_default"]
    assert err == "to stderr\n"


def test_exit_codes_tracebacks_and_interrupts_come_back_as_from_an_executed_process(probe: Path) -> None:
    assert _run(probe, "exit", "3")[0] == 3
    code, _, _, err = _run(probe, "raise")
    assert code == 1
    assert err.splitlines()[1:3] == [
        "Traceback (most recent call last):",
        f'  File "{probe}", line {RAISE_LINE}, in <module>',
    ]
    assert err.rstrip().endswith("ValueError: boom")
    code, _, _, err = _run(probe, "interrupt")
    assert code == -signal.SIGINT
    assert err.rstrip().endswith("KeyboardInterrupt")


def test_non_daemon_threads_and_atexit_callbacks_run_before_the_exit(probe: Path) -> None:
    code, _, out, _ = _run(probe, "thread")
    assert code == 0
    assert out.splitlines()[1:] == ["thread ended", "atexit ran"]


def test_signals_reach_the_process_and_its_status_says_which(probe: Path) -> None:
    for how, expected in ((signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        proc = start_process([sys.executable, str(probe), "sleep"], base_env())
        assert proc.stdout is not None
        proc.stdout.readline()
        assert proc.poll() is None
        with pytest.raises(Exception, match="timed out"):
            proc.wait(timeout=0.2)
        os.killpg(proc.pid, how)
        assert proc.wait(timeout=30) == expected


def test_a_signal_the_test_ignores_is_ignored_in_the_child_as_across_exec(probe: Path) -> None:
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ignored = _run(probe, "ok")[1]["sigint_ignored"]
    finally:
        signal.signal(signal.SIGINT, before)
    assert ignored
    assert not _run(probe, "ok")[1]["sigint_ignored"]


def test_every_child_draws_its_own_random_numbers(probe: Path) -> None:
    assert _run(probe, "ok")[1]["random"] != _run(probe, "ok")[1]["random"]


def test_a_module_runs_as_main_with_the_folder_first_on_its_path() -> None:
    proc = start_process([sys.executable, "-m", "torch_batch_process.launch.cli", "--version"], base_env())
    assert isinstance(proc, forkserver.ForkedPopen)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip()


def test_an_environment_that_torch_reads_at_import_is_executed_not_forked(probe: Path) -> None:
    assert forkserver.forkable([sys.executable, str(probe)], base_env())
    assert not forkserver.forkable([sys.executable, str(probe)], base_env(OMP_NUM_THREADS="2"))
    assert not forkserver.forkable([sys.executable, str(probe)], base_env(TORCH_SHOW_CPP_STACKTRACES="1"))
    assert not forkserver.forkable([sys.executable, "-c", "pass"], base_env())
    assert not forkserver.forkable(["/bin/true"], base_env())
    proc = start_process([sys.executable, str(probe), "ok"], base_env(OMP_NUM_THREADS="2"))
    assert not isinstance(proc, forkserver.ForkedPopen)
    proc.communicate(timeout=120)
    assert proc.returncode == 0


def test_a_forked_process_starts_with_torch_imported(probe: Path) -> None:
    assert _run(probe, "ok")[1]["torch_preloaded"]


def test_consecutive_processes_hash_strings_with_different_seeds(tmp_path: Path) -> None:
    script = tmp_path / "hash.py"
    script.write_text("print(hash('rank'))\n")
    hashes = set()
    for _ in range(2):
        proc = start_process([sys.executable, str(script)], base_env())
        hashes.add(proc.communicate(timeout=120)[0])
    assert len(hashes) == 2


def test_poll_says_a_process_ended_as_soon_as_it_has(probe: Path) -> None:
    proc = start_process([sys.executable, str(probe), "sleep"], base_env())
    assert proc.stdout is not None
    proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not _ended(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert proc.poll() == -signal.SIGKILL  # no window where it has ended but poll() says it runs


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
