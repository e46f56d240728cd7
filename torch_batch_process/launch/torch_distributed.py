"""``python -m torch_batch_process.launch.torch_distributed [torchrun options] [--] CMD ARGS...``

Runs ``CMD ARGS...`` in every worker of a ``torch.distributed`` job, with torch's own launcher
(``torch.distributed.run``, i.e. ``torchrun``) running in this process as the node's agent. It
accepts every torchrun option and adds what a batch job wants by default:

- ``--nproc-per-node``: the number of GPUs of the machine, else 1;
- ``--standalone`` on one node (a private rendezvous on a free port); with ``--nnodes`` > 1,
  ``--rdzv-endpoint HOST:PORT`` selects the c10d rendezvous (hosted by the agent on ``HOST``);
- started by ``srun`` (one task per node), the step's node count, first node and id give ``--nnodes``,
  ``--rdzv-endpoint FIRST_NODE:29400`` and ``--rdzv-id`` (see :mod:`torch_batch_process.launch.slurm`);
- each line the workers print is prefixed with the worker's global rank (``[rank 1] ...``);
- SIGTERM/SIGINT (preemption, Ctrl-C) are forwarded once to every worker (torchrun does it), which
  commits and stops at the next step boundary; workers still running after ``--shutdown-timeout``
  seconds (torchrun's default: 30) are killed;
- the exit code is the job's: 0, the exit code of the first worker that failed (128 + N for a
  worker killed by signal N), or 128 + N when the launcher itself was stopped by signal N (the job
  was preempted: run the same command again to resume);
- ``OMP_NUM_THREADS``, when the user set none and a node runs several workers: the cores divided among
  them, said in one line (torchrun sets 1 after a three-line banner);
- a worker that dies of a signal is named (rank, its own pid, the signal) by the ranks that survive, in
  one line each instead of a traceback, and by the launcher's last line, which says that the same command
  resumes (see :mod:`torch_batch_process.lost_workers`).

``CMD`` is a command (``python3 script.py --flag``); a first word ``python`` or ``python3`` means
this launcher's interpreter, and a script path ending in ``.py`` is run with it. With ``-m``, CMD is
a module (``-m package.module ARGS``), as with torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from torch_batch_process.environment import LAUNCH_STATE_ENV, read_launch_state
from torch_batch_process.launch.slurm import DEFAULT_RDZV_PORT, slurm_step
from torch_batch_process.lost_workers import lost_workers, notes_path

PROG = "python -m torch_batch_process.launch.torch_distributed"
RANK_PREFIX_SCRIPT = str(Path(__file__).resolve().with_name("rank_prefix.py"))

# Flags of torchrun that this launcher replaces (it always runs the worker command with --no-python).
_COMMAND_FLAGS = {"-m", "--module", "--no-python", "--no_python"}
_OWN_FLAGS = {"--no-rank-prefix"}
_UNSUPPORTED_FLAGS = {"--run-path", "--run_path"}
_SENTINEL = object()  # not a str: argparse would convert a str default with the option's type


class LaunchError(ValueError):
    """A bad launcher command line; the message says what to change."""


@dataclass
class LaunchPlan:
    """What the launcher will run: torchrun's argument vector and the worker command."""

    torchrun_argv: list[str]
    command: list[str]
    nproc_per_node: str
    nnodes: str
    max_restarts: int
    rank_prefix: bool = True
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """The equivalent torchrun command line, for logs."""
        import shlex

        return "torchrun " + shlex.join(self.torchrun_argv)


def build_parser(raise_errors: bool = False) -> argparse.ArgumentParser:
    """torchrun's own parser (every torchrun option, ``PET_*`` environment defaults included) plus
    this launcher's ``--no-rank-prefix``; abbreviated option names are refused. With
    ``raise_errors``, a bad command line raises :class:`LaunchError` instead of exiting."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = PROG
    parser.description = (
        "Runs CMD in every worker of a torch.distributed job with torchrun (torch.distributed.run) as the node's "
        "agent. Defaults: --nproc-per-node = number of GPUs, else 1; --standalone on one node; c10d rendezvous when "
        "--rdzv-endpoint is given. Worker output lines are prefixed with the worker's rank; SIGTERM/SIGINT are "
        "forwarded to the workers, which commit and stop; the exit code is the job's."
    )
    parser.allow_abbrev = False
    parser.add_argument(
        "--no-rank-prefix",
        action="store_true",
        help="Do not prefix the lines the workers print with '[rank N] ' (this launcher's option).",
    )
    for action in parser._actions:  # noqa: SLF001 - the positional names of torchrun's parser read oddly here
        if action.dest == "training_script":
            action.metavar = "CMD"
            action.help = "The command each worker runs (python3 script.py ..., a script.py, or a module with -m)."
        elif action.dest == "training_script_args":
            action.metavar = "ARGS"
            action.help = "Arguments of CMD."
    if raise_errors:

        def error(message: str) -> NoReturn:
            if "required: CMD" in message:
                message = "no command to run: give CMD after the options, e.g. '--nproc-per-node 2 python3 job.py'"
            raise LaunchError(message)

        parser.error = error  # type: ignore[method-assign]
    return parser


def given_options(argv: Sequence[str], dests: Sequence[str]) -> set[str]:
    """The options among ``dests`` (argparse names, e.g. ``nproc_per_node``) that ``argv`` sets.

    Raises:
        LaunchError: ``argv`` is not a valid launcher command line.
    """
    parser = build_parser(raise_errors=True)
    parser.set_defaults(**{dest: _SENTINEL for dest in dests})
    args = parser.parse_args(list(argv))
    return {dest for dest in dests if getattr(args, dest) is not _SENTINEL}


def _default_nproc() -> int:
    """The number of GPUs of this machine, else 1."""
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA setup means no GPU to use
        count = 0
    return count or 1


def resolve_command(command: Sequence[str], *, module: bool = False, no_python: bool = False) -> list[str]:
    """The command line a worker runs.

    ``python``/``python3`` as the first word is this interpreter (``sys.executable``), so a job runs
    with the environment of the launcher even when the venv is not activated; a first word ending in
    ``.py`` is a script run with this interpreter; ``module`` runs ``python -m CMD``.
    """
    cmd = list(command)
    if not cmd:
        raise LaunchError("no command to run: give CMD after the options, e.g. '... --nproc-per-node 2 python3 job.py'")
    if module:
        return [sys.executable, "-m", *cmd]
    if no_python:
        return cmd
    first = cmd[0]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if first in ("python", "python3", version):
        return [sys.executable, *cmd[1:]]
    if first.endswith(".py"):
        return [sys.executable, *cmd]
    return cmd


def plan_launch(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Parses the launcher's command line and builds the torchrun invocation.

    Raises:
        LaunchError: no command, an unsupported option, or a multi-node job without a rendezvous.
    """
    from torch.distributed.run import parse_min_max_nnodes

    environ = os.environ if environ is None else environ
    argv = list(argv)
    args = build_parser(raise_errors=True).parse_args(argv)
    command = [args.training_script, *args.training_script_args]
    split = len(argv) - len(command)
    if split < 0 or argv[split:] != command:  # pragma: no cover - argparse keeps the remainder verbatim
        raise LaunchError(f"cannot find the command in {argv!r}")
    options = argv[:split]
    if options and options[-1] == "--":
        options = options[:-1]
    bad = sorted(_UNSUPPORTED_FLAGS.intersection(options))
    if bad:
        raise LaunchError(f"{bad[0]} is not supported by this launcher: each worker runs CMD as a process")
    if command[0] == "--":
        command = command[1:]
    worker_cmd = resolve_command(command, module=args.module, no_python=args.no_python)

    # Options the user set, on the command line or through torchrun's PET_* variables: never overridden.
    # (master_port: torch 2.11 defaults it to 29500, torch 2.14 to None, so only its presence tells)
    defaulted = ["nproc_per_node", "rdzv_backend", "nnodes", "rdzv_id", "master_port"]
    given = given_options(argv, defaulted) | {dest for dest in defaulted if f"PET_{dest.upper()}" in environ}
    notes: list[str] = []
    torchrun_argv = [token for token in options if token not in _COMMAND_FLAGS and token not in _OWN_FLAGS]
    torchrun_argv += _slurm_options(args, given, environ, notes)
    nproc = args.nproc_per_node
    if "nproc_per_node" not in given:
        nproc = str(_default_nproc())
        torchrun_argv += ["--nproc-per-node", nproc]
    _check_nproc(nproc)
    if int(args.max_restarts) < 0:
        raise LaunchError(
            f"--max-restarts must be an int >= 0 (times a failed worker group is restarted), got {args.max_restarts}"
        )
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError) as exc:
        raise LaunchError(f"--nnodes {args.nnodes!r}: {exc}") from exc
    if not 1 <= min_nodes <= max_nodes:
        raise LaunchError(f"--nnodes {args.nnodes!r}: give N >= 1 nodes, or MIN:MAX with 1 <= MIN <= MAX")
    torchrun_argv += _rendezvous_options(args, given, max_nodes, notes)
    if args.no_rank_prefix:
        torchrun_argv += ["--no-python", *worker_cmd]
    else:
        torchrun_argv += ["--no-python", sys.executable, RANK_PREFIX_SCRIPT, *worker_cmd]
    return LaunchPlan(
        torchrun_argv=torchrun_argv,
        command=worker_cmd,
        nproc_per_node=str(nproc),
        nnodes=str(max_nodes) if min_nodes == max_nodes else f"{min_nodes}:{max_nodes}",
        max_restarts=int(args.max_restarts),
        rank_prefix=not args.no_rank_prefix,
        notes=notes,
    )


def _check_nproc(nproc: Any) -> None:
    """``--nproc-per-node``: an int >= 1, or one of torchrun's words (``auto``, ``cpu``, ``gpu``, ``xpu``); torchrun
    itself fails on 0 or a negative number with an empty AssertionError."""
    text = str(nproc).strip()
    if text.lstrip("+-").isdigit():
        if int(text) < 1:
            raise LaunchError(f"--nproc-per-node must be >= 1 (workers on this node), got {text}")
    elif text not in ("auto", "cpu", "gpu", "xpu"):
        raise LaunchError(f"--nproc-per-node must be an int >= 1 or auto, cpu, gpu or xpu, got {text!r}")


def _slurm_options(
    args: argparse.Namespace, given: set[str], environ: Mapping[str, str], notes: list[str]
) -> list[str]:
    """Options from the ``srun`` step the launcher runs in (what the command line gives wins); updates ``args``."""
    step = slurm_step(environ)
    if step is None:
        return []
    if step.tasks != step.nodes:
        raise LaunchError(
            f"srun started {step.tasks} tasks on {step.nodes} node(s): start one launcher per node (srun "
            "--ntasks-per-node=1); it starts the --nproc-per-node workers of its node itself"
        )
    if step.nodes == 1:
        return []
    options: list[str] = []
    if "nnodes" not in given:
        args.nnodes = str(step.nodes)
        options += ["--nnodes", args.nnodes]
    if not args.rdzv_endpoint and args.rdzv_backend == "static" and args.master_addr == "127.0.0.1":
        args.rdzv_endpoint = f"{step.first_node}:{DEFAULT_RDZV_PORT}"
        options += ["--rdzv-endpoint", args.rdzv_endpoint]
        notes.append(f"Slurm step on {step.nodes} nodes: c10d rendezvous on {args.rdzv_endpoint}")
    if "rdzv_id" not in given:
        options += ["--rdzv-id", step.rdzv_id]
    return options


def _rendezvous_options(args: argparse.Namespace, given: set[str], max_nodes: int, notes: list[str]) -> list[str]:
    """``--standalone`` on one node, c10d with an endpoint, ``is_host`` when torch would miss it."""
    options: list[str] = []
    backend = args.rdzv_backend
    if args.rdzv_endpoint and backend == "static" and "rdzv_backend" not in given:
        options += ["--rdzv-backend", "c10d"]
        backend = "c10d"
    static = backend == "static"
    if (
        args.rdzv_endpoint
        and not args.standalone
        and backend == "c10d"
        and _should_host(args.rdzv_endpoint, args.rdzv_conf)
    ):
        options += ["--rdzv-conf", f"{args.rdzv_conf},is_host=1" if args.rdzv_conf else "is_host=1"]
        notes.append(f"this node hosts the c10d rendezvous at {args.rdzv_endpoint} (its address is local)")
    rendezvous_given = args.standalone or args.rdzv_endpoint or not static
    if max_nodes == 1 and not rendezvous_given and "master_port" not in given:
        options.append("--standalone")
    if max_nodes > 1 and not rendezvous_given and args.master_addr == "127.0.0.1":
        raise LaunchError(
            f"--nnodes {args.nnodes}: a job on several nodes needs a rendezvous: give --rdzv-endpoint HOST:PORT "
            "(the same on every node; HOST is the first node, which hosts the c10d rendezvous), or --master-addr "
            "HOST --master-port PORT --node-rank N for torchrun's static rendezvous"
        )
    return options


def _should_host(endpoint: str, rdzv_conf: str) -> bool:
    """Whether this node must host the c10d rendezvous although torch would not guess it.

    torch decides by comparing the endpoint's host with this machine's host name and the addresses
    it resolves to, so an endpoint given as the address of a secondary interface (a second NIC, a
    container or namespace network) is missed and every node waits for a store nobody serves. When
    the endpoint's address belongs to this machine and its port is free, this node hosts it.
    """
    import socket

    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:  # torch's own guess (private; absent from some torch versions)
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:  # pragma: no cover

        def _matches_machine_hostname(host: str) -> bool:
            return False

    if "is_host" in (rdzv_conf or ""):
        return False
    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_RDZV_PORT)
    except ValueError:
        return False  # torchrun reports it
    try:
        if _matches_machine_hostname(host):
            return False  # torch finds it by itself (and falls back to a client when the port is taken)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError:
                continue
            return True
    return False


def exit_code_of(exitcode: int) -> int:
    """A worker's exit status as a shell exit code: N, or 128 + N for death by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _say(message: str) -> None:
    print(f"[launcher] {message}", file=sys.stderr, flush=True)


def run_plan(plan: LaunchPlan) -> int:
    """Runs torchrun in this process as the node's agent; returns the job's exit code."""
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # workers' lines appear as they are printed (torchrun uses -u)
    # Since torch 2.5 (pytorch/pytorch#128096), torchrun's c10d rendezvous shares the agent's store with the workers
    # and keeps it across restarts: the restarted workers can read their peers' stale addresses and fail or hang in
    # init_process_group (pytorch/pytorch#135712; torch 2.14 still shares it by default). A store per round (hosted
    # by rank 0) avoids it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = parse_args(plan.torchrun_argv)
    for note in plan.notes:
        _say(note)
    threads = worker_threads(args.nproc_per_node, os.environ)
    if threads is not None:  # before torchrun, which would print its 3-line banner and set 1
        os.environ["OMP_NUM_THREADS"] = str(threads)
        _say(f"OMP_NUM_THREADS={threads} for each worker (the cores / the workers; set OMP_NUM_THREADS to choose)")
    for name, templates in _AGENT_LINES_SAID_AGAIN.items():
        logging.getLogger(name).addFilter(_SaidAgain(templates))
    state_file = os.path.join(tempfile.gettempdir(), f"tbp-launch-{os.getpid()}-{uuid.uuid4().hex[:8]}.state")
    os.environ[LAUNCH_STATE_ENV] = state_file  # the workers' calls say there whether the job is done
    try:
        return _run_agent(run, args, plan, state_file)
    finally:
        for path in (state_file, notes_path(state_file)):
            with contextlib.suppress(OSError):
                os.unlink(path)


# torchrun's agent lines that the launcher's own last line says better (it names the worker, not its wrapper, and
# what to do), by their logger and message template
_AGENT_LINES_SAID_AGAIN = {
    "torch.distributed.elastic.multiprocessing.api": (
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
        "Sending process %s closing signal %s",
    ),
    "torch.distributed.elastic.agent.server.api": ("Received %s death signal, shutting down workers",),
}


class _SaidAgain(logging.Filter):
    def __init__(self, templates: tuple[str, ...]) -> None:
        super().__init__()
        self.templates = templates

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.templates


def worker_threads(nproc_per_node: str, environ: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` for each worker when the user set none and there are several workers on this node: this
    process's cores divided among them (at least 1), as torchrun would set 1 after printing a banner; ``None``: leave
    it (set by the user, or one worker, which may use every core)."""
    from torch.distributed.run import determine_local_world_size

    if "OMP_NUM_THREADS" in environ:
        return None
    workers = determine_local_world_size(nproc_per_node)
    if workers <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


def _run_agent(run: Any, args: Any, plan: LaunchPlan, state_file: str) -> int:
    """Runs torchrun's agent; returns the job's exit code, with one line saying why it stopped."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        restarts = f" (restarts allowed: {plan.max_restarts}, all used)" if plan.max_restarts else ""
        noted = [worker for worker in lost_workers(state_file) if worker.rank == rank]
        pid = noted[0].pid if noted else failure.pid  # the worker's own pid (torchrun knows its wrapper's)
        who = f"rank {rank} (local rank {failure.local_rank}, pid {pid})"
        then = "fix what its output above says, then run" if failure.exitcode > 0 else "run"
        _say(
            f"the job failed: {who} ended with {how}{restarts}; the last commit is intact: {then} the same command "
            "again to resume"
        )
        return exit_code_of(failure.exitcode)
    except SignalException as exc:
        if read_launch_state(state_file) == "finished":  # the job was done: its workers were ending
            _say(
                f"{exc.sigval.name} came after the job had finished: its outputs and result are stored, nothing to "
                "resume (the workers' code after the job was stopped; running the same command again returns the "
                "stored result at once)"
            )
            return 0
        _say(
            f"stopped by {exc.sigval.name}: the workers were asked to commit and stop; run the same command again to "
            "resume"
        )
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        _say("interrupted before the workers started")
        return 130
    except Exception as exc:  # noqa: BLE001 - rendezvous and agent errors: one clear line, no agent traceback
        _say(f"torchrun failed: {type(exc).__name__}: {exc}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_batch_process.launch.torch_distributed``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        plan = plan_launch(argv)
    except LaunchError as exc:
        print(f"usage: {PROG} [torchrun options] [--] CMD [ARGS...]\n{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return run_plan(plan)


if __name__ == "__main__":
    sys.exit(main())
