"""The ``tbp report`` and ``tbp dashboard`` subcommands (see :mod:`torch_batch_process.observe.report`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from torch_batch_process.environment import add_storage_arguments, command_storage_options
from torch_batch_process.errors import BatchProcessError
from torch_batch_process.observe.visible_text import visible
from torch_batch_process.shell_commands import pip_install, shell_path

__all__ = [
    "DEFAULT_PORT", "REPORT_SUFFIX", "add_dashboard_parser", "add_report_parser", "default_output", "run_dashboard",
    "run_report",
]

DEFAULT_PORT = 8765
DEFAULT_REFRESH_S = 5.0
REPORT_SUFFIX = "-report.html"
"""The default page of ``tbp report STORAGE``: ``STORAGE-report.html``, next to a local job's folder (see
:func:`default_output`)."""


def _no_plotly() -> str:
    return f"plotly is not installed; install it with: {pip_install('report')}"


def default_output(storage_path: str) -> str:
    """Where ``tbp report`` writes the page without ``-o``: next to a local job's folder and named after it
    (``tbp_runs/job`` -> ``tbp_runs/job-report.html``), so that it belongs to the job (never a ``report.html`` left in
    the working directory, a clone's root for one); for a job on an object store, ``<last part of the URL>``
    + ``-report.html`` in the working directory."""
    path = storage_path.rstrip("/") or storage_path
    if path.startswith("file://"):
        path = path[len("file://"):]
    if "://" in path:
        return path.rsplit("/", 1)[-1].split("://")[-1] + REPORT_SUFFIX
    return path + REPORT_SUFFIX


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``report`` to the ``tbp`` command's subparsers."""
    parser = subparsers.add_parser(
        "report",
        help="write one self-contained HTML page about a job (throughput, batch times, stragglers, commits, "
        "padding, failures)",
        description=(
            "Writes one self-contained HTML page (it opens offline: plotly.js is inside) made from what the job "
            "stores: throughput over time per rank and in total across attempts, batch-time distribution and "
            "stragglers, commit latency, padded vs real tokens with bucket_by, failing examples, ETA and the job's "
            "arguments. Read-only: safe while the job runs."
        ),
    )
    add_storage_arguments(parser)
    parser.add_argument(
        "-o", "--output", metavar="FILE", default=None,
        help=f"the page to write (default: next to the job's folder, named after it: STORAGE_PATH{REPORT_SUFFIX}; "
        f"for a job on an object store, its name{REPORT_SUFFIX} here)",
    )
    parser.set_defaults(func=run_report)
    return parser


def add_dashboard_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``dashboard`` to the ``tbp`` command's subparsers."""
    parser = subparsers.add_parser(
        "dashboard",
        help="serve the report page live on localhost, refreshing while the job runs",
        description=(
            "Serves the page of 'tbp report' on http://127.0.0.1:PORT/ (this machine only; from another one use "
            "ssh -L PORT:127.0.0.1:PORT), updated every --refresh seconds from what the job stores. Read-only. "
            "Ctrl-C stops it."
        ),
    )
    add_storage_arguments(parser)
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port on 127.0.0.1 (default {DEFAULT_PORT}; 0: a free one)"
    )
    parser.add_argument(
        "--refresh",
        type=float,
        default=DEFAULT_REFRESH_S,
        metavar="SECONDS",
        help=f"seconds between updates of the page (default {DEFAULT_REFRESH_S:g}; at least 0.5)",
    )
    parser.set_defaults(func=run_dashboard)
    return parser


def _options(args: argparse.Namespace, command: str) -> tuple[dict[str, Any] | None, int | None]:
    try:
        return command_storage_options(args.storage_options), None
    except ValueError as exc:
        print(f"tbp {command}: --storage-options must be a JSON object: {exc}", file=sys.stderr)
        return None, 2


def run_report(args: argparse.Namespace) -> int:
    """Runs ``tbp report``; returns the exit code (0; 1 when the job cannot be read; 2 for a bad argument or no
    plotly)."""
    options, code = _options(args, "report")
    if code is not None:
        return code
    if importlib.util.find_spec("plotly") is None:
        print(f"tbp report: {_no_plotly()}", file=sys.stderr)
        return 2
    if args.output is None:
        args.output = default_output(args.storage_path)
    if not args.output.strip():
        print("tbp report: --output is empty; give a file name, e.g. report.html", file=sys.stderr)
        return 2
    if os.path.isdir(args.output):
        print(f"tbp report: --output {args.output!r} is a folder; give a file name, e.g. report.html", file=sys.stderr)
        return 2
    from torch_batch_process.observe.report import write_report

    try:
        size = write_report(args.storage_path, args.output, options)
    except BatchProcessError as exc:
        print(f"tbp report: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the page's file: a folder that cannot be made, no permission, a full disk
        print(f"tbp report: cannot write --output {args.output!r}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {shell_path(args.output)} ({size / 1e6:.1f} MB): open it in a browser (it needs no network)")
    return 0


def run_dashboard(args: argparse.Namespace) -> int:
    """Runs ``tbp dashboard`` until Ctrl-C; returns the exit code (0; 2 for a bad argument, no plotly or a port in
    use)."""
    options, code = _options(args, "dashboard")
    if code is not None:
        return code
    if not 0 <= args.port <= 65535:
        print(f"tbp dashboard: --port must be in 0..65535 (0: a free port), got {args.port}", file=sys.stderr)
        return 2
    if not args.refresh >= 0.5:
        print(f"tbp dashboard: --refresh must be at least 0.5 seconds, got {args.refresh:g}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("plotly") is None:
        print(f"tbp dashboard: {_no_plotly()}", file=sys.stderr)
        return 2
    from torch_batch_process.observe.report.dashboard import serve_dashboard

    def ready(url: str) -> None:
        shown = visible(args.storage_path)  # a path decoded with surrogateescape, or escapes: printed inert
        print(f"tbp dashboard: serving {url} for the job at {shown} (updated every {args.refresh:g} s); "
              "Ctrl-C stops it", flush=True)

    try:
        code = serve_dashboard(
            args.storage_path, port=args.port, refresh_s=args.refresh, storage_options=options, ready=ready
        )
    except OSError as exc:
        print(f"tbp dashboard: cannot listen on 127.0.0.1:{args.port} ({exc}); pass another --port (0 picks a free "
              "one)", file=sys.stderr)
        return 2
    print("tbp dashboard: stopped", flush=True)
    return code
