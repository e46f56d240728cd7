"""What ``tbp run`` (and schedulers) hand a job besides its variables, and the rule for job names: a torch-free module,
so that the ``tbp`` command starts in a fraction of a second. The variables themselves (``TBP_STORAGE_PATH``,
``TBP_STORAGE_OPTIONS``, ``TBP_JOB_NAME``, ``TBP_HPARAMS``, ``TBP_LAUNCH_STATE``...) are read by
:mod:`torch_batch_process.settings`, and nowhere else.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from torch_batch_process import settings
from torch_batch_process.settings import (
    HPARAMS_ENV,
    JOB_NAME_ENV,
    LAUNCH_STATE_ENV,
    STORAGE_ENV,
    STORAGE_OPTIONS_ENV,
)

__all__ = [
    "add_storage_arguments",
    "DEFAULT_ROOT",
    "HPARAMS_ENV",
    "JOB_NAME_ENV",
    "LAUNCH_STATE_ENV",
    "STORAGE_ENV",
    "STORAGE_OPTIONS_ENV",
    "command_storage_options",
    "is_valid_job_name",
    "read_launch_state",
    "write_launch_state",
]

DEFAULT_ROOT = "tbp_runs"
"""Default storage: ``./tbp_runs/<job name>``."""

JOB_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""Matched whole (``fullmatch``: ``$`` would also take a name ending in a newline)."""


def is_valid_job_name(name: Any) -> bool:
    """Whether ``name`` can name a job: 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit."""
    return isinstance(name, str) and bool(JOB_NAME_PATTERN.fullmatch(name))


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every ``tbp`` command that reads a stored job takes: ``STORAGE_PATH`` and ``--storage-options``
    (read by :func:`command_storage_options`)."""
    parser.add_argument(
        "storage_path", metavar="STORAGE_PATH", help="the job's storage path (local path or fsspec URL)"
    )
    parser.add_argument(
        "--storage-options",
        metavar="JSON",
        default=None,
        help="fsspec storage options as a JSON object (default: $TBP_STORAGE_OPTIONS, else the filesystem's own "
        "environment)",
    )


def command_storage_options(given: str | None) -> dict[str, Any] | None:
    """The storage options of a ``tbp`` command: its ``--storage-options`` JSON, else ``$TBP_STORAGE_OPTIONS``,
    else ``None``.

    Raises:
        ValueError: the JSON is invalid or not an object (the message says which, and where it came from).
    """
    if not given:
        return settings.current().storage_options.get()
    options = json.loads(given)
    if not isinstance(options, dict):
        raise ValueError(f"not a JSON object: {given!r}")
    return options


def write_launch_state(state: str) -> None:
    """Writes ``state`` to the launcher's state file (``$TBP_LAUNCH_STATE``; nothing when not under the launcher).
    Best effort: the launcher only uses it to word its last line."""
    path = settings.current().launch_state
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(state)
    except OSError:
        pass


def read_launch_state(path: str) -> str | None:
    """The state the workers last wrote to ``path`` (``None``: none)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None
