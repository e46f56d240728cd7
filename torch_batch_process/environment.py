"""The environment variables through which ``tbp run`` (and schedulers) configure a job, and the rule for
job names: a torch-free module, so that the ``tbp`` command starts in a fraction of a second.

=======================  ==================================================================================
``TBP_STORAGE_PATH``     the job's storage path or URL (when ``storage_path`` is not given)
``TBP_STORAGE_OPTIONS``  JSON: options of the fsspec filesystem (when ``storage_options`` is not given)
``TBP_JOB_NAME``         the job's name (when ``job_name`` is not given)
``TBP_HPARAMS``          JSON: the job config's ``hyperparameters`` (``context.get_hparams()``)
``TBP_LAUNCH_STATE``     set by the library's launcher: a file where each node's local rank 0 writes the state
                         of its latest call (``running``, ``finished``, ``preempted``, ``failed``), so that a
                         signal that comes once the job has finished is not reported as a preemption
=======================  ==================================================================================
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

__all__ = [
    "add_storage_arguments",
    "DEFAULT_ROOT",
    "HPARAMS_ENV",
    "JOB_NAME_ENV",
    "LAUNCH_STATE_ENV",
    "STORAGE_ENV",
    "STORAGE_OPTIONS_ENV",
    "command_storage_options",
    "env_number",
    "is_valid_job_name",
    "read_launch_state",
    "write_launch_state",
]

STORAGE_ENV = "TBP_STORAGE_PATH"
STORAGE_OPTIONS_ENV = "TBP_STORAGE_OPTIONS"
JOB_NAME_ENV = "TBP_JOB_NAME"
HPARAMS_ENV = "TBP_HPARAMS"
LAUNCH_STATE_ENV = "TBP_LAUNCH_STATE"
DEFAULT_ROOT = "tbp_runs"
"""Default storage: ``./tbp_runs/<job name>``."""

JOB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def env_number(name: str, default: float, *, integer: bool = False, minimum: float = 0.0, above: bool = False) -> Any:
    """The number in environment variable ``name`` (``default`` when unset or empty): an int when ``integer``, and
    ``>= minimum`` (``> minimum`` when ``above``), finite.

    Raises:
        InvalidArgumentError: naming the variable, what it means and its default, for anything else; so that a tuning
            variable with a typo is refused when the call starts, not when it is first read (in a retry, in an upload).
    """
    from torch_batch_process.errors import InvalidArgumentError

    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        value = float("nan")
    if not (value > minimum if above else value >= minimum) or value == float("inf"):
        kind = "an int" if integer else "a number"
        bound = f"> {minimum:g}" if above else f">= {minimum:g}"
        raise InvalidArgumentError(
            f"environment variable {name} must be {kind} {bound}, got {raw!r}; unset it for the default ({default:g})"
        )
    return value


def is_valid_job_name(name: Any) -> bool:
    """Whether ``name`` can name a job: 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit."""
    return isinstance(name, str) and bool(JOB_NAME_PATTERN.match(name))


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
        ValueError: the JSON is invalid or not an object (the message says which).
    """
    raw = given or os.environ.get(STORAGE_OPTIONS_ENV)
    if not raw:
        return None
    options = json.loads(raw)
    if not isinstance(options, dict):
        raise ValueError(f"not a JSON object: {raw!r}")
    return options


def write_launch_state(state: str) -> None:
    """Writes ``state`` to the launcher's state file (``$TBP_LAUNCH_STATE``; nothing when not under the launcher).
    Best effort: the launcher only uses it to word its last line."""
    path = os.environ.get(LAUNCH_STATE_ENV)
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
