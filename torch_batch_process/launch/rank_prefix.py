"""Runs one worker's command and prefixes each line of its output with the worker's rank.

The launcher runs this file (by path, so that it imports nothing but the standard library) as each
torchrun worker: ``python rank_prefix.py CMD ARGS...``. It starts ``CMD`` with pipes for stdout and
stderr and copies every *complete* line to its own stdout/stderr as ``[rank R] line`` (one write
per line, so lines of different workers never mix on a pipe or a terminal). torchrun's own
``--tee`` prefixing cuts lines that the worker writes in pieces (block-buffered output, ``print``'s
separate newline), which this avoids.

torch's ``init_process_group`` installs an exception hook that prefixes each line of a traceback with
``[rank<R>]: ``; under this prefix that doubled it (``[rank 1] [rank1]: Traceback ...``), so that prefix, when
it names this worker's rank, is dropped from the start of a line.

Signals: torchrun stops a worker with ``killpg`` on the worker's process group, which holds this
process and ``CMD``; so this process does not forward signals (``CMD`` would get them twice) and
ignores the catchable ones while ``CMD`` runs. Its exit status is ``CMD``'s: the same exit code, or
death by the same signal, so torchrun sees what the command did. If the agent itself dies (``kill
-9`` of the launcher), torchrun's workers would run on as orphans: this process notices that its
parent is gone and sends ``CMD`` SIGTERM, so the job commits and stops.

A ``CMD`` that dies of a signal is noted (rank, pid, signal) next to the launcher's state file before this
process exits, so that the ranks that survive and the launcher name that worker (see
:mod:`torch_batch_process.lost_workers`).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO

# Signals torchrun may send to the worker's process group (its --signals-to-handle and shutdown).
_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)
_READ_SIZE = 65536
_MAX_PENDING = 1 << 20  # a "line" longer than this is written in pieces
_DRAIN_TIMEOUT_S = 2.0  # after CMD exits, its children may hold the pipes open; stop copying after this
_PARENT_POLL_S = 1.0
_ATOMIC_WRITE = getattr(select, "PIPE_BUF", 512)  # POSIX: writes up to this size to a pipe are not interleaved
# A line: anything up to \n, \r\n, or a lone \r (progress bars redraw their line with it).
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")
# Where a worker that dies of a signal is noted (torch_batch_process.environment.LAUNCH_STATE_ENV and
# torch_batch_process.lost_workers.LOST_SUFFIX: this file imports nothing of the package; tests check they agree)
_LAUNCH_STATE_ENV = "TBP_LAUNCH_STATE"
_LOST_SUFFIX = ".lost"


def _ignore(signum: int, frame: object) -> None:
    """A Python-level no-op handler: unlike SIG_IGN, it is not inherited by the command."""


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            written = os.write(fd, data)
        except BrokenPipeError:
            return  # nobody reads our output any more: keep draining the command so that it never blocks
        data = data[written:]


def split_lines(pending: bytes, chunk: bytes) -> tuple[list[bytes], bytes]:
    """Splits ``pending + chunk`` into complete lines (ending in ``\\n``, ``\\r\\n`` or a lone ``\\r``)
    and the unfinished rest. A ``\\r`` at the very end is kept pending: it may start a ``\\r\\n``."""
    data = pending + chunk
    # The complete part ends at the last terminator (a final \r waits for the next chunk); matching only there
    # keeps the scan linear: every position of it starts a line.
    end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    if end == len(data) and data.endswith(b"\r"):
        end = max(data.rfind(b"\n", 0, end - 1), data.rfind(b"\r", 0, end - 1)) + 1
    lines = _LINE.findall(data, 0, end)
    rest = data[end:]
    if len(rest) > _MAX_PENDING:
        lines.append(rest)
        rest = b""
    return lines, rest


def _copy(source: BinaryIO, fd: int, prefix: bytes, torch_prefix: bytes = b"") -> None:
    pending = b""
    cut = len(torch_prefix)
    raw = source.fileno()
    while True:
        try:
            chunk = os.read(raw, _READ_SIZE)
        except OSError:
            chunk = b""
        if not chunk:
            break
        lines, pending = split_lines(pending, chunk)
        batch = bytearray()
        for line in lines:  # whole lines, at most PIPE_BUF bytes a write: atomic, so never mixed with other ranks'
            piece = prefix + (line[cut:] if cut and line.startswith(torch_prefix) else line)
            if batch and len(batch) + len(piece) > _ATOMIC_WRITE:
                _write_all(fd, bytes(batch))
                batch.clear()
            batch += piece
        if batch:
            _write_all(fd, bytes(batch))
    if pending:
        _write_all(fd, prefix + pending + (b"" if pending.endswith((b"\n", b"\r")) else b"\n"))


def _watch_parent(proc: subprocess.Popen[bytes], parent: int) -> None:
    """Sends SIGTERM to ``proc`` once, when the agent that started this process is gone."""
    while proc.poll() is None:
        if os.getppid() != parent:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            return
        time.sleep(_PARENT_POLL_S)


def _note_lost(rank: str, pid: int, signum: int) -> None:
    """Appends this worker's death to the launcher's notes (``$TBP_LAUNCH_STATE`` + ``.lost``; the format of
    :mod:`torch_batch_process.lost_workers`, which reads it), so that the ranks that survive and the launcher name the
    worker (rank, pid, signal), not this wrapper. One ``write`` of one short line: appends never interleave."""
    state_file = os.environ.get(_LAUNCH_STATE_ENV)
    if not state_file or not rank.isdigit():
        return
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    note = {"rank": int(rank), "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0), "pid": pid, "signal": name}
    try:
        fd = os.open(state_file + _LOST_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (json.dumps(note) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # best effort: the launcher then names the wrapper's pid


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: rank_prefix.py CMD [ARGS...]", file=sys.stderr)
        return 2
    rank = os.environ.get("RANK", "?")
    prefix = f"[rank {rank}] ".encode()
    torch_prefix = f"[rank{rank}]: ".encode()  # torch's exception hook's, made redundant by ours
    for signum in _SIGNALS:
        signal.signal(signum, _ignore)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        _write_all(2, prefix + f"cannot run {argv[0]!r}: {exc}\n".encode())
        return 127 if isinstance(exc, FileNotFoundError) else 126
    assert proc.stdout is not None and proc.stderr is not None
    threads = [
        threading.Thread(target=_copy, args=(proc.stdout, 1, prefix, torch_prefix), daemon=True),
        threading.Thread(target=_copy, args=(proc.stderr, 2, prefix, torch_prefix), daemon=True),
    ]
    threading.Thread(target=_watch_parent, args=(proc, os.getppid()), daemon=True).start()
    for thread in threads:
        thread.start()
    code = proc.wait()
    if code < 0:  # killed by a signal: note who died of what (before the agent can see it; see _note_lost)
        _note_lost(rank, proc.pid, -code)
    for thread in threads:
        thread.join(_DRAIN_TIMEOUT_S)
    if code < 0:  # die of the same signal
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP cannot be caught: nothing to reset
            pass
        os.kill(os.getpid(), -code)
        return 128 - code  # only reached for a signal whose default action does not end the process
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
