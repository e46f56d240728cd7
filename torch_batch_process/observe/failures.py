"""``tbp failures STORAGE_PATH`` and :func:`read_failures`: the examples a job skipped with ``on_error="skip"``.

The failures are read from ``<storage_path>/failures/*.jsonl`` (one JSON object a line; the keys are listed in
:mod:`torch_batch_process.engine.feed.failing_examples`). Only committed failures are there, each exactly once.
Read-only: safe while the job runs. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torch_batch_process.environment import add_storage_arguments, command_storage_options
from torch_batch_process.errors import BatchProcessError, NoJobError
from torch_batch_process.jobstore.layout import FAILURES_DIR, JOB_FILE
from torch_batch_process.jobstore.retries import current_failures_root
from torch_batch_process.observe.visible_text import visible
from torch_batch_process.outputs.failure_records import read_failure_records
from torch_batch_process.outputs.keyed.runs import current_failures, keyed_column
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.registry import open_storage

__all__ = [
    "FIRST_FAILURES",
    "add_failures_parser",
    "current_failure_records",
    "failure_summary",
    "first_line",
    "read_failures",
    "run_failures",
]

FIRST_FAILURES = 5
"""How many failing examples ``tbp status`` shows (``tbp failures`` lists them all)."""


def read_failures(storage_path: str, *, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The current failure records of the job at ``storage_path`` (those of its latest finished
    ``retry_failed`` run, if any: see :mod:`torch_batch_process.jobstore.retries`; a keyed job's: every key whose
    newest event is a failure, over its runs: :func:`~torch_batch_process.outputs.keyed.runs.current_failures`),
    ordered by dataset index.

    Raises:
        NoJobError: no job is stored at ``storage_path`` (as ``tbp status`` says).
    """
    storage = open_storage(storage_path, storage_options)
    try:
        if not storage.exists(JOB_FILE):
            raise NoJobError(f"no job is stored at {storage.url!r} (no {JOB_FILE})")
        return current_failure_records(storage)[1]
    finally:
        storage.close()


def current_failure_records(storage: Storage) -> tuple[str, list[dict[str, Any]]]:
    """The folder (relative to ``storage``) holding the current failure records of the job stored in ``storage``
    (a keyed job's latest finished run's, which holds the newest of them), and those records (see
    :func:`read_failures`)."""
    root = current_failures_root(storage)
    folder = f"{root}/{FAILURES_DIR}" if root else FAILURES_DIR
    if keyed_column(storage) is not None:  # its failures are its keys', over its runs
        return folder, current_failures(storage)
    return folder, read_failure_records(storage, root)


def failure_summary(records: list[dict[str, Any]], first: int = FIRST_FAILURES) -> dict[str, Any]:
    """What ``tbp status`` and ``tbp report`` say about failing examples: ``count``, counts ``by_phase`` and
    ``by_error`` (exception type), and the ``first`` records by dataset index (without tracebacks, the message cut
    to its first line)."""
    by_phase: dict[str, int] = {}
    by_error: dict[str, int] = {}
    for record in records:
        phase, error = str(record.get("phase", "?")), str(record.get("error_type", "?"))
        by_phase[phase] = by_phase.get(phase, 0) + 1
        by_error[error] = by_error.get(error, 0) + 1
    shown = []
    for record in records[:first]:
        fields = ("index", "batch_idx", "attempt", "rank", "phase", "error_type", "time")
        entry = {key: record.get(key) for key in fields}
        entry["message"] = first_line(record.get("message"))
        shown.append(entry)
    return {
        "count": len(records),
        "by_phase": dict(sorted(by_phase.items())),
        "by_error": dict(sorted(by_error.items(), key=lambda item: (-item[1], item[0]))),
        "first": shown,
    }


def first_line(message: Any, limit: int = 300) -> str:
    """The first line of an exception message, at most ``limit`` characters."""
    text = str(message or "").strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def add_failures_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``failures`` to the ``tbp`` command's subparsers."""
    parser = subparsers.add_parser(
        "failures",
        help="list the examples a job skipped because they failed (on_error='skip')",
        description=(
            "Lists the committed failing examples of a job run with on_error='skip' (dataset index, batch, "
            "attempt, rank, phase, exception), read from <storage_path>/failures/. Read-only."
        ),
    )
    add_storage_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the records as JSON lines (with tracebacks)")
    parser.set_defaults(func=run_failures)
    return parser


def run_failures(args: argparse.Namespace) -> int:
    """Runs ``tbp failures``; returns the exit code (0; 1 when no job is stored there or the storage cannot be
    read)."""
    try:
        options = command_storage_options(args.storage_options)
    except ValueError as exc:
        print(f"tbp failures: --storage-options must be a JSON object: {exc}", file=sys.stderr)
        return 2
    try:
        records = read_failures(args.storage_path, storage_options=options)
    except BatchProcessError as exc:
        print(f"tbp failures: {exc}", file=sys.stderr)
        return 1
    if args.json:
        for record in records:
            print(json.dumps(record))
        return 0
    print(f"{len(records)} failed example(s) in {args.storage_path}")
    if records:
        print(f"{'index':>10} {'batch':>7} {'attempt':>7} {'rank':>4}  {'phase':<7} error")
    for r in records:
        message = str(r.get("message", "")).splitlines()[0] if r.get("message") else ""
        error = f"{r.get('error_type')}: {message}"[:100]
        where = f"{r.get('index'):>10} {r.get('batch_idx'):>7} {r.get('attempt'):>7} {r.get('rank'):>4}"
        print(visible(f"{where}  {r.get('phase', ''):<7} {error}"))  # the message's escapes do not act
    return 0
