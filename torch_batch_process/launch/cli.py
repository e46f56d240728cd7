"""The ``tbp`` command.

Each subcommand has a ``_add_<name>_parser(subparsers)`` function that declares its options and a
``cmd_<name>(args) -> int`` function that runs it; :func:`build_parser` lists them. To add one, write
the two functions and register the first in :func:`build_parser`.

Start-up: this module and the parsers import neither torch nor the engine, so ``tbp --help`` answers
at once; a subcommand imports what it needs when it runs.

A closed standard output (``tbp status ... | head``) ends the command quietly with exit code 141
(128 + SIGPIPE, what a shell reports for ``cat``, ``seq``... stopped the same way), not with a
``BrokenPipeError`` traceback.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from torch_batch_process import settings
from torch_batch_process.environment import DEFAULT_ROOT, JOB_NAME_ENV, STORAGE_ENV, STORAGE_OPTIONS_ENV

EXIT_STDOUT_CLOSED = 141
"""Exit code when the reader of standard output went away (128 + SIGPIPE, as for tools killed by it)."""


def _say(message: str) -> None:
    print(f"[tbp] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- tbp run


def _add_run_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a job from a YAML job config on this node",
        description=(
            "Runs the job described by a YAML job config (name, entrypoint, resources.slots_per_trial, "
            "resources.nodes, checkpoint_storage, max_restarts, hyperparameters, environment.variables) with "
            "python -m torch_batch_process.launch.torch_distributed, in the directory of the config file. The workers' "
            "context.get_hparams() returns the config's hyperparameters; the storage path and job name reach "
            f"torch_batch_process() through the environment ({STORAGE_ENV}, {STORAGE_OPTIONS_ENV}, {JOB_NAME_ENV}). "
            "On several nodes, run the same command on every node with --rdzv-endpoint."
        ),
        epilog=(
            "Exit code: the job's (0 when it finished; 128+N when stopped by signal N: run the same command again "
            "to resume). Example: tbp run job.yaml --nproc-per-node 2 --storage s3://bucket/runs/job"
        ),
    )
    parser.add_argument("config", metavar="CONFIG.yaml", help="the job config")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="workers on this node (default: resources.slots_per_trial / resources.nodes, else one per GPU, else 1)",
    )
    parser.add_argument(
        "--storage",
        metavar="URL",
        help="storage path or URL of the job, instead of the config's checkpoint_storage",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="several nodes: the c10d rendezvous, hosted by the node named HOST; the same on every node",
    )
    parser.add_argument("--rdzv-id", metavar="ID", help="several nodes: an id shared by the nodes of this job")
    parser.add_argument(
        "--local-addr",
        metavar="ADDR",
        help="several nodes: the address other nodes reach this one at (default: its host name)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the launcher command and the job's environment variables, run nothing",
    )
    parser.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    """``tbp run CONFIG.yaml``: checks the config, sets the job's environment, runs the launcher in this process."""
    from torch_batch_process.launch.config import ConfigError, load_config
    from torch_batch_process.launch.job_launch import job_environment, launcher_argv

    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        _say(f"error: --nproc-per-node must be >= 1, got {args.nproc_per_node}")
        return 2
    extra: list[str] = []
    for option, value in (
        ("--rdzv-endpoint", args.rdzv_endpoint),
        ("--rdzv-id", args.rdzv_id),
        ("--local-addr", args.local_addr),
    ):
        if value is not None:
            extra += [option, value]
    try:
        config = load_config(args.config)
        argv = launcher_argv(config, args.nproc_per_node, extra)
        env, notes = job_environment(config, args.storage)
    except ConfigError as exc:
        _say(f"error: {exc}")
        return 2
    if args.dry_run:
        print(f"cd {shlex.quote(str(config.workdir))}")
        for name, value in sorted(env.items()):
            print(f"export {name}={shlex.quote(value)}")
        print(shlex.join([sys.executable, "-m", "torch_batch_process.launch.torch_distributed", *argv]))
        return 0

    from torch_batch_process.launch.torch_distributed import LaunchError, plan_launch, run_plan

    os.environ.update(env)
    os.chdir(config.workdir)
    try:
        plan = plan_launch(argv)
    except LaunchError as exc:
        _say(f"error: {exc}")
        return 2
    storage = settings.current().storage_path.value or f"the default (./{DEFAULT_ROOT}/<job name>)"
    _say(
        f"job {repr(config.name) if config.name else '(unnamed)'} from {config.path}: "
        f"{plan.nproc_per_node} worker(s) per node on {plan.nnodes} node(s), max_restarts {plan.max_restarts}, "
        f"storage {storage}; runs {shlex.join(plan.command)}"
    )
    for note in notes:
        _say(note)
    return run_plan(plan)


# -------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The ``tbp`` parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="tbp",
        description=(
            "torch_batch_process command line: resumable, exactly-once batch processing with PyTorch. "
            "Run 'tbp COMMAND --help' for the options of a command."
        ),
        epilog=f"Exit code {EXIT_STDOUT_CLOSED} when standard output is closed early (e.g. tbp status ... | head).",
    )
    from torch_batch_process import __version__

    parser.add_argument("--version", action="version", version=f"torch_batch_process {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _add_run_parser(subparsers)
    from torch_batch_process.observe.status import (
        add_status_parser,  # tbp status: torch_batch_process/observe/status.py
    )

    add_status_parser(subparsers)
    from torch_batch_process.observe.failures import add_failures_parser  # tbp failures

    add_failures_parser(subparsers)
    from torch_batch_process.observe.report.commands import (  # tbp report, tbp dashboard
        add_dashboard_parser,
        add_report_parser,
    )

    add_report_parser(subparsers)
    add_dashboard_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tbp`` console command; returns its exit code."""
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, inside the try, not at interpreter exit
    except BrokenPipeError:
        return _stdout_closed()


def _dispatch(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args))


def _stdout_closed() -> int:
    """The reader of stdout is gone: point stdout at ``/dev/null`` (so that the interpreter's own
    flush at exit finds nothing to write and prints no second error) and return 141."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_STDOUT_CLOSED


if __name__ == "__main__":
    sys.exit(main())
