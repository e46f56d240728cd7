"""A fork server for the job processes the tests start: a process that has imported torch once forks each one.

Why: every job process a test starts is a fresh Python that imports torch, ~1.5-3.5 s of CPU each on the CI's
2-core machines, and the slow tests start well over a thousand of them: most of the suite's time. A process forked
from a server that already imported torch (and nothing of this library) skips that import; what it runs next is what
``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` would run: the library and the job script are imported fresh in
the child, with the child's own environment, working directory, session, standard streams and arguments.

It is still a real process: its own pid and session (the tests kill it and its group with SIGKILL and SIGTERM), real
torch.distributed over gloo, real files; its exit status reaches :class:`ForkedPopen`, a :class:`subprocess.Popen`
whose process was forked by the server instead of executed. What differs from an executed process, and how the
suite keeps it from mattering:

- Variables read while torch is imported (``OMP_*``, ``MKL_*``, ``TORCH_*``, ``PYTORCH_*``, ``CUDA_*``, ``LD_*``,
  ``PYTHON*`` other than ``PYTHONPATH``/``PYTHONUNBUFFERED``) are the server's: a command whose environment differs
  from the server's in any of them is executed instead (:func:`forkable`).
- String hashes take their server's seed (``PYTHONHASHSEED`` cannot change after start): two servers take turns,
  so consecutive processes (a job's ranks) hash differently; ``random`` and numpy's global generator are reseeded
  in every child.
- Signals: every handler is the interpreter's default in the child, and a signal the test process ignores is ignored
  in the child, as it would be across ``exec``.

``TBP_TEST_FORKSERVER=0`` runs every command with a plain ``exec`` (e.g. to rule the server out of a failure).
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Any

__all__ = ["ForkedPopen", "enabled", "forkable", "start"]

_PRELOAD = ("torch", "torch.distributed", "numpy")
_IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_",
                         "LD_", "MALLOC_", "PYTHON")  # fmt: skip
_RUNTIME_PYTHON_VARIABLES = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"})
_PYTHON_IGNORES = frozenset({signal.SIGPIPE, signal.SIGXFSZ})  # what the interpreter itself ignores at start
_STATUS = struct.Struct("!i")
_REAP_WAIT_S = 30.0  # how long an ended process's status may take to come back from its server (it reaps at once)
_LENGTH = struct.Struct("!Q")


def enabled() -> bool:
    """Whether the suite forks its job processes (``TBP_TEST_FORKSERVER=0`` turns it off)."""
    return os.environ.get("TBP_TEST_FORKSERVER", "1") != "0" and hasattr(os, "fork") and sys.platform == "linux"


def _import_time_variables(env: dict[str, str]) -> dict[str, str]:
    return {
        name: value
        for name, value in env.items()
        if name.startswith(_IMPORT_TIME_PREFIXES) and name not in _RUNTIME_PYTHON_VARIABLES
    }


def _server_env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def forkable(command: list[str], env: dict[str, str]) -> bool:
    """Whether ``command`` can be forked: ``python SCRIPT ...`` or ``python -m MODULE ...`` with this interpreter and
    an environment that agrees with the server's on every variable read at import time."""
    if len(command) < 2 or command[0] != sys.executable:
        return False
    if command[1] == "-m":
        if len(command) < 3:
            return False
    elif command[1].startswith("-") or not command[1].endswith(".py"):
        return False
    return _import_time_variables(env) == _import_time_variables(_server_env())


class _Server:
    """The test process's end of one fork server: starts it, asks it for processes, stops it at exit."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket = ours
        self._lock = threading.Lock()
        self._log = tempfile.TemporaryFile()  # the server's own stderr (its children have their own streams)
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=_server_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,  # a file, not a pipe: a pipe nobody reads would block the server once full
            start_new_session=True,
        )
        theirs.close()
        ours.settimeout(180)
        try:
            ready = ours.recv(1)
        except OSError:
            ready = b""
        if ready != b"R":
            self._process.kill()
            self._process.wait(timeout=30)
            self._log.seek(0)
            err = self._log.read().decode(errors="replace")
            raise RuntimeError(f"the tests' fork server did not start: {err[-2000:]}")
        ours.settimeout(60)
        atexit.register(self.stop)

    def spawn(self, request: dict[str, Any], fds: list[int]) -> int:
        """Sends ``request`` and the child's stdin, stdout, stderr and status pipe; returns the child's pid."""
        payload = pickle.dumps(request)
        with self._lock:
            self._socket.sendmsg(
                [_LENGTH.pack(len(payload)), payload],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))],
            )
            reply = _receive_exactly(self._socket, _LENGTH.size)
            answer = pickle.loads(_receive_exactly(self._socket, _LENGTH.unpack(reply)[0]))
        if isinstance(answer, str):
            raise OSError(f"the tests' fork server could not start {request['argv']!r}: {answer}")
        return int(answer)

    def alive(self) -> bool:
        return self._process.poll() is None

    def stop(self) -> None:
        self._socket.close()  # the server exits when it reads the end of its socket
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


_SERVERS = 2  # processes started one after the other (a job's ranks) alternate between them: see start()
_servers: list[_Server | None] = [None] * _SERVERS
_turn = 0
_server_lock = threading.Lock()


def start() -> _Server:
    """The next of the session's fork servers, started on first use. Two servers with their own string-hash seeds
    take turns, so that a job's ranks do not all share one seed: with executed processes every rank has its own, and
    a rank that orders a set of strings differently from its peers must still be caught."""
    global _turn
    with _server_lock:
        index = _turn % _SERVERS
        _turn += 1
        server = _servers[index]
        if server is None or not server.alive():
            server = _servers[index] = _Server()
        return server


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise ConnectionError("the tests' fork server closed its socket")
        data += part
    return bytes(data)


class ForkedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """A :class:`subprocess.Popen` whose process the fork server forked; its exit status comes back over a pipe
    (the server reaps the process: it is the server's child, not ours)."""

    _status_fd: int = -1

    def _execute_child(  # type: ignore[override]
        self, args: list[str], executable: Any, preexec_fn: Any, close_fds: bool, pass_fds: Any, cwd: Any,
        env: dict[str, str], startupinfo: Any, creationflags: int, shell: bool, p2cread: int, p2cwrite: int,
        c2pread: int, c2pwrite: int, errread: int, errwrite: int, restore_signals: bool, gid: Any, gids: Any,
        uid: Any, umask: int, start_new_session: bool, process_group: int,
    ) -> None:  # fmt: skip
        if preexec_fn is not None or pass_fds or shell or gid is not None or gids is not None or uid is not None:
            raise ValueError("ForkedPopen takes a plain command: no preexec_fn, pass_fds, shell or ids")
        status_read, status_write = os.pipe()
        ignored = [int(sig) for sig in signal.valid_signals() if _ignored_here(sig)]
        request = {
            "argv": list(args),
            "env": dict(env if env is not None else os.environ),
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "new_session": bool(start_new_session),
            "ignored": ignored,
        }
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        try:
            self.pid = start().spawn(request, [*fds, status_write])
            self._child_created = True
        except BaseException:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._status_fd = status_read

    def _status(self, block: bool) -> int | None:
        if self._status_fd < 0:
            return None
        if not block and not select.select([self._status_fd], [], [], 0)[0]:
            if not _has_exited(self.pid):
                return None
            # It has exited and the server is reaping it: its status is on the way. waitpid() on a child of ours
            # would say so at once; so does this, so that a test's poll() never calls an ended process running.
            if not select.select([self._status_fd], [], [], _REAP_WAIT_S)[0]:
                return None
        data = b""
        while len(data) < _STATUS.size:
            part = os.read(self._status_fd, _STATUS.size - len(data))
            if not part:
                break
            data += part
        os.close(self._status_fd)
        self._status_fd = -1
        if len(data) < _STATUS.size:  # the server died before it reaped the process: say so, as a failure
            return 255 << 8
        return int(_STATUS.unpack(data)[0])

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        status = self._status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(  # noqa: N803 (Popen's own parameter names)
        self, _deadstate: Any = None, _waitpid: Any = None, _WNOHANG: Any = None, _ECHILD: Any = None
    ) -> int | None:
        if self.returncode is None:
            if not self._waitpid_lock.acquire(False):
                return None
            try:
                if self.returncode is None:
                    status = self._status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _has_exited(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped by its server, or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False


def _ignored_here(sig: signal.Signals) -> bool:
    if sig in _PYTHON_IGNORES or sig in (signal.SIGKILL, signal.SIGSTOP):
        return False
    try:
        return signal.getsignal(sig) == signal.SIG_IGN
    except (OSError, ValueError):
        return False


# ---- the server process ------------------------------------------------------------------------------------------


def _serve(fd: int) -> None:
    """The server's loop: one request at a time over the socket ``fd``; reaps its children and sends each exit
    status down the child's status pipe; exits when the test process closes the socket."""
    for name in _PRELOAD:
        __import__(name)
    base_path = list(sys.path[1:])  # the interpreter's own path, without this file's folder
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"  # the locale's, as a new interpreter would take
    conn = socket.socket(fileno=fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status_fds: dict[int, int] = {}
    conn.sendall(b"R")
    while True:
        try:
            readable = select.select([conn, wake_read], [], [])[0]
        except InterruptedError:
            continue
        if wake_read in readable:
            os.read(wake_read, 4096)
        _reap(status_fds)
        if conn in readable:
            try:
                request, fds = _receive_request(conn)
            except ConnectionError:
                break
            try:
                pid = os.fork()
            except OSError as error:
                for received in fds:
                    os.close(received)
                _reply(conn, f"fork failed: {error}")
                continue
            if pid == 0:
                _become(request, fds, base_path, encoding, [conn.fileno(), wake_read, wake_write, *status_fds.values()])
            for received in fds[:3]:
                os.close(received)
            status_fds[pid] = fds[3]
            _reply(conn, pid)
            _reap(status_fds)
    for status_fd in status_fds.values():
        os.close(status_fd)


def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    header, ancillary, _, _ = conn.recvmsg(_LENGTH.size, socket.CMSG_SPACE(4 * struct.calcsize("i")))
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    if not header:
        raise ConnectionError("closed")
    if len(header) < _LENGTH.size:
        header += _receive_exactly(conn, _LENGTH.size - len(header))
    request = pickle.loads(_receive_exactly(conn, _LENGTH.unpack(header)[0]))
    if len(fds) != 4:
        raise ConnectionError(f"expected 4 descriptors with a request, got {len(fds)}")
    return request, fds


def _reply(conn: socket.socket, answer: int | str) -> None:
    payload = pickle.dumps(answer)
    conn.sendall(_LENGTH.pack(len(payload)) + payload)


def _reap(status_fds: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status_fd = status_fds.pop(pid, None)
        if status_fd is not None:
            try:
                os.write(status_fd, _STATUS.pack(status))
            except OSError:
                pass  # the test process no longer listens (it closed its end)
            os.close(status_fd)


def _become(
    request: dict[str, Any], fds: list[int], base_path: list[str], encoding: str, server_fds: list[int]
) -> None:
    """In the forked child: take the request's streams, session, signals, environment, folder and arguments, then run
    the script or module as ``__main__`` and exit the way the interpreter does. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                if sig in request["ignored"] or sig in _PYTHON_IGNORES:
                    signal.signal(sig, signal.SIG_IGN)
                elif sig == signal.SIGINT:
                    signal.signal(sig, signal.default_int_handler)
                else:
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        if request["new_session"]:
            os.setsid()
        for target, received in enumerate(fds[:3]):
            os.dup2(received, target)
        for stale in {*fds, *server_fds}:
            if stale > 2:
                try:
                    os.close(stale)
                except OSError:
                    pass
        os.chdir(request["cwd"])
        env: dict[str, str] = request["env"]
        os.environ.clear()
        os.environ.update(env)
        _reopen_streams(bool(env.get("PYTHONUNBUFFERED")), encoding)
        argv: list[str] = request["argv"][1:]
        python_path = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
        _reseed()
        import importlib
        import runpy

        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file first
            sys.path[:] = [os.getcwd(), *python_path, *base_path]
            importlib.invalidate_caches()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[:] = [os.path.dirname(script), *python_path, *base_path]
            importlib.invalidate_caches()
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop)
    except KeyboardInterrupt:
        _print_exception()
        _shut_down()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as the interpreter does: die of the signal
    except BaseException:
        _print_exception()
        code = 1
    os._exit(_shut_down(code))


def _print_exception() -> None:
    """The uncaught exception's traceback as the interpreter prints it: from the script's first frame (this file's
    and runpy's frames, which an executed process does not have, left out)."""
    kind, error, trace = sys.exc_info()
    while trace is not None and (
        trace.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
        or trace.tb_frame.f_code.co_filename.endswith(f"{os.sep}runpy.py")
    ):
        trace = trace.tb_next
    if error is not None:
        error.__traceback__ = trace
    sys.excepthook(kind, error, trace)  # type: ignore[arg-type]


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    try:
        print(stop.code, file=sys.stderr)
    except Exception:
        pass
    return 1


def _shut_down(code: int = 1) -> int:
    """What the interpreter does at exit: join non-daemon threads, run atexit callbacks, flush the streams; returns
    the exit code (a ``SystemExit`` raised meanwhile replaces ``code``)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException as error:  # noqa: BLE001
        if isinstance(error, SystemExit):
            code = _exit_code(error)
    import atexit as _atexit

    _atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def _reopen_streams(unbuffered: bool, encoding: str) -> None:
    import io

    def writer(fd: int, line_buffering: bool, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            binary, encoding=encoding, errors=errors, line_buffering=line_buffering, write_through=unbuffered
        )

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    sys.stdout = sys.__stdout__ = writer(1, False, "strict")
    sys.stderr = sys.__stderr__ = writer(2, True, "backslashreplace")


def _reseed() -> None:
    import random

    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
