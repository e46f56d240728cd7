"""The library's environment variables: every ``TBP_*`` variable, read and checked once, into one typed object.

A call of :func:`~torch_batch_process.torch_batch_process` reads the environment at its start (:func:`read_settings`)
and puts the :class:`Settings` in force for its duration (:func:`in_force`); every part of the call takes its values
from :func:`current` (a storage retry, an upload, the lease, the join...), never from ``os.environ``. Outside a call
(the ``tbp`` commands, ``read_outputs``), :func:`current` reads the environment when asked. Nothing else in the
package reads a ``TBP_*`` variable (``tests/test_settings.py`` checks it), and docs/environment.md's table is the one
:data:`VARIABLES` gives (:func:`markdown_table`; the same test compares them).

Two kinds of variables:

- *tuning* variables are always in use: a bad value is an
  :class:`~torch_batch_process.errors.InvalidArgumentError` naming the variable when the call starts, before any
  work (:func:`read_settings` raises it);
- variables that *stand in for an argument* (``TBP_STORAGE_PATH`` for ``storage_path``, ``TBP_PROGRESS`` for
  ``progress``...) are read and checked at the same moment, but a bad value is kept as its error
  (:class:`EnvValue`) and raised only where it is used: when the argument is not given (``TBP_HPARAMS``: by
  ``context.get_hparams()``; logging the hyperparameters skips a bad value with a warning). One policy for each
  JSON variable, parsed once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

__all__ = [
    "ALLOW_SCRIPT_CHANGE_ENV",
    "COLLECTIVE_TIMEOUT_ENV",
    "EnvValue",
    "HEARTBEAT_SILENCE_ENV",
    "HPARAMS_ENV",
    "JOB_NAME_ENV",
    "JOIN_TIMEOUT_ENV",
    "LAUNCH_STATE_ENV",
    "SHARD_BYTES_ENV",
    "STORAGE_ENV",
    "STORAGE_OPTIONS_ENV",
    "Settings",
    "VARIABLES",
    "Variable",
    "current",
    "in_force",
    "markdown_table",
    "read_settings",
]

T = TypeVar("T")

STORAGE_ENV = "TBP_STORAGE_PATH"
STORAGE_OPTIONS_ENV = "TBP_STORAGE_OPTIONS"
JOB_NAME_ENV = "TBP_JOB_NAME"
HPARAMS_ENV = "TBP_HPARAMS"
LAUNCH_STATE_ENV = "TBP_LAUNCH_STATE"
ALLOW_SCRIPT_CHANGE_ENV = "TBP_ALLOW_SCRIPT_CHANGE"
JOIN_TIMEOUT_ENV = "TBP_JOIN_TIMEOUT_S"
HEARTBEAT_SILENCE_ENV = "TBP_HEARTBEAT_SILENCE_S"
COLLECTIVE_TIMEOUT_ENV = "TBP_COLLECTIVE_TIMEOUT_S"
SHARD_BYTES_ENV = "TBP_SHARD_BYTES"

HEARTBEAT_S = 1.0
"""Seconds between two heartbeats of a rank (the silence that loses a rank is at least two of them)."""

PROGRESS_MODES = ("auto", "bar", "log", "off")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _invalid(message: str) -> Exception:
    from torch_batch_process.errors import InvalidArgumentError

    return InvalidArgumentError(message)


@dataclass(frozen=True)
class EnvValue(Generic[T]):
    """A variable that stands in for an argument: its value (``None``: unset), or the error of a bad value, raised by
    :meth:`get` (only where the value is used)."""

    name: str
    value: T | None = None
    error: str | None = None

    def get(self) -> T | None:
        """The value (``None``: unset); raises :class:`~torch_batch_process.errors.InvalidArgumentError` naming the
        variable for a bad one."""
        if self.error is not None:
            raise _invalid(self.error)
        return self.value

    @property
    def where(self) -> str:
        """The variable as error messages name it."""
        return f"environment variable {self.name}"


# ---------------------------------------------------------------------------------------------------- parsers


def _number(name: str, default: float, *, integer: bool = False, minimum: float = 0.0, above: bool = False) -> Any:
    """A tuning number: ``default`` when unset or empty, else an int (``integer``) or float ``>= minimum`` (``>``
    with ``above``), finite."""

    def parse(raw: str | None) -> Any:
        if raw is None or not raw.strip():
            return default
        try:
            value: float = int(raw) if integer else float(raw)
        except ValueError:
            value = float("nan")
        if not (value > minimum if above else value >= minimum) or value == float("inf"):
            kind = "an int" if integer else "a number"
            bound = f"> {minimum:g}" if above else f">= {minimum:g}"
            raise _invalid(
                f"environment variable {name} must be {kind} {bound}, got {raw!r}; unset it for the default "
                f"({default:g})"
            )
        return value

    return parse


def _join_timeout(raw: str | None) -> float:
    if raw is None or raw == "":
        return JOIN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise _invalid(
            f"{JOIN_TIMEOUT_ENV} must be a number of seconds > 0 (how long ranks wait for each other to join), got "
            f"{raw!r}; unset it for the default ({JOIN_TIMEOUT_S:g} s)"
        )
    return value


def _heartbeat_silence(raw: str | None) -> float:
    if raw is None:
        return HEARTBEAT_SILENCE_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 2 * HEARTBEAT_S:  # also NaN
        raise _invalid(
            f"{HEARTBEAT_SILENCE_ENV} must be a number of seconds >= {2 * HEARTBEAT_S:g} (heartbeats come every "
            f"{HEARTBEAT_S:g} s), got {raw!r}; unset it for the default ({HEARTBEAT_SILENCE_S:g} s)"
        )
    return value


def _shard_bytes(raw: str | None) -> int:
    raw = (raw or "").strip()
    if not raw:
        return DEFAULT_SHARD_BYTES
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(raw[-1].lower(), 1)
    digits = raw[:-1] if scale > 1 else raw
    if not digits.isdigit() or int(digits) * scale <= 0:
        raise _invalid(
            f"{SHARD_BYTES_ENV}={raw!r}: expected a positive number of bytes (e.g. 134217728 or 128M), the size of "
            "rows after which a rank starts a new record shard; unset it for the default (128M)"
        )
    return int(digits) * scale


def _seconds(name: str, default: float | None, *, allow_zero: bool) -> Callable[[str | None], float | None]:
    def parse(raw: str | None) -> float | None:
        raw = (raw or "").strip()
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise _invalid(f"environment variable {name} must be a number of seconds, got {raw!r}") from None
        if not math.isfinite(value):
            raise _invalid(f"environment variable {name} must be a number of seconds, got {value!r}")
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise _invalid(f"environment variable {name} must be {bound} seconds, got {value!r}")
        return value

    return parse


def _ratio(raw: str | None) -> float:
    raw = (raw or "").strip()
    if not raw:
        return DEFAULT_STRAGGLER_RATIO
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise _invalid(f"environment variable TBP_STRAGGLER_RATIO must be a number in (0, 1), got {raw!r}")
    return value


def _text(raw: str | None) -> str | None:
    return raw or None


def _json_object(name: str) -> Callable[[str | None], dict[str, Any] | None]:
    def parse(raw: str | None) -> dict[str, Any] | None:
        if not raw:
            return None
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise _invalid(f"environment variable {name} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise _invalid(f"environment variable {name} must hold a JSON object, got {type(value).__name__}")
        return value

    return parse


def _progress(raw: str | None) -> str | None:
    raw = (raw or "").strip().lower()
    if not raw:
        return None
    if raw in _TRUE:
        return "auto"
    if raw in _FALSE:
        return "off"
    if raw in PROGRESS_MODES:
        return raw
    raise _invalid(
        f"environment variable TBP_PROGRESS must be None, True, False or one of {list(PROGRESS_MODES)}, got {raw!r}"
    )


def _tensorboard(raw: str | None) -> bool | None:
    raw = (raw or "").strip().lower()
    if not raw or raw == "auto":
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise _invalid(f"environment variable TBP_TENSORBOARD must be 1, 0 or auto, got {raw!r}")


def _profile(raw: str | None) -> bool | dict[str, Any] | None:
    raw = (raw or "").strip()
    if not raw:
        return None
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise _invalid(f"environment variable TBP_PROFILE must be 1, 0 or a JSON object, got {raw!r} ({exc})") from None
    return value  # its keys are checked with the argument's (observe/options.py)


def _flag(raw: str | None) -> bool:
    return raw == "1"


# ---------------------------------------------------------------------------------------------------- the table

JOIN_TIMEOUT_S = 600.0
HEARTBEAT_SILENCE_S = 15.0
COLLECTIVE_TIMEOUT_S = 1800.0
DEFAULT_SHARD_BYTES = 128 << 20
DEFAULT_PROGRESS_INTERVAL_S = 30.0
DEFAULT_METRICS_INTERVAL_S = 60.0
DEFAULT_STRAGGLER_RATIO = 0.5


@dataclass(frozen=True)
class Variable:
    """One environment variable of the library: the :class:`Settings` field it fills, its parser, and its docs."""

    name: str
    field: str
    parse: Callable[[str | None], Any]
    default: str
    meaning: str
    stands_in: bool = False
    """It stands in for an argument: a bad value is kept as its error (:class:`EnvValue`) until it is used."""


VARIABLES: tuple[Variable, ...] = (
    Variable(
        STORAGE_ENV, "storage_path", _text, "`./tbp_runs/<job name>`",
        "storage path when `storage_path` is not given (`tbp run` sets it from `checkpoint_storage`)", True,
    ),
    Variable(
        STORAGE_OPTIONS_ENV, "storage_options", _json_object(STORAGE_OPTIONS_ENV), "none",
        "JSON object of fsspec options when `storage_options` is not given (and of the `tbp` commands without "
        "`--storage-options`)", True,
    ),
    Variable(
        JOB_NAME_ENV, "job_name", _text, "the script's stem",
        "the job name when `job_name` is not given (`tbp run`: the config's `name`)", True,
    ),
    Variable(
        HPARAMS_ENV, "hparams", _json_object(HPARAMS_ENV), "`{}`",
        "JSON object: `context.get_hparams()` (`tbp run`: the config's `hyperparameters`); a bad value fails "
        "`get_hparams()` only, and the hyperparameters are then not logged (a warning)", True,
    ),
    Variable(
        ALLOW_SCRIPT_CHANGE_ENV, "allow_script_change", _flag, "unset",
        "`1`: resume a stored job that another script started (a renamed script) instead of refusing it with "
        "`JobMismatchError` (see the README, \"Resume\")",
    ),
    Variable("TBP_PROGRESS", "progress", _progress, "auto", "the `progress` argument (docs/observability.md)", True),
    Variable(
        "TBP_PROGRESS_INTERVAL", "progress_interval", _seconds("TBP_PROGRESS_INTERVAL", None, allow_zero=False), "30",
        "the `progress_interval` argument (seconds)", True,
    ),
    Variable(
        "TBP_TENSORBOARD", "tensorboard", _tensorboard, "auto", "the `tensorboard` argument (`1`, `0`, `auto`)", True
    ),
    Variable("TBP_PROFILE", "profile", _profile, "off", "the `profile` argument (`1`, `0` or a JSON object)", True),
    Variable(
        "TBP_METRICS_INTERVAL", "metrics_interval",
        _seconds("TBP_METRICS_INTERVAL", DEFAULT_METRICS_INTERVAL_S, allow_zero=True), "60",
        "seconds between reduced metrics \"so far\" computed at commits (`0`: only at preemption and at the end)",
    ),
    Variable(
        "TBP_STRAGGLER_RATIO", "straggler_ratio", _ratio, "0.5",
        "a rank slower than this fraction of the others' median is logged as a straggler",
    ),
    Variable(
        JOIN_TIMEOUT_ENV, "join_timeout_s", _join_timeout, "600",
        "seconds the ranks wait for each other to join when the library creates the process group; a rank that has "
        "not joined by then fails the others with `WorkerLostError` naming it, and a rank that cannot reach rank 0's "
        "store by then (rank 0 never started, or `MASTER_ADDR`/`MASTER_PORT` are wrong) fails with a "
        "`WorkerLostError` saying so. 600 s is torchrun's own rendezvous `join_timeout`: the nodes of a cluster may "
        "start minutes apart (an image pull, a slow scheduler). Once every rank has joined, the process groups are "
        "connected within at most 60 s (`torch_batch_process/engine/join.py`)",
    ),
    Variable(
        HEARTBEAT_SILENCE_ENV, "heartbeat_silence_s", _heartbeat_silence, "15",
        "seconds without a heartbeat after which a rank is lost: while the job opens (every start with plain "
        "processes), and during a `schedule=\"dynamic\"` job (at least 2: heartbeats come every second)",
    ),
    Variable(
        COLLECTIVE_TIMEOUT_ENV, "collective_timeout_s",
        _number(COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S, above=True), "1800",
        "the timeout of the process groups' collectives (torch's own default): the last resort of a rank that waits "
        "on a peer that neither answers nor closes its connection",
    ),
    Variable(
        "TBP_STORAGE_RETRIES", "storage_retries", _number("TBP_STORAGE_RETRIES", 5, integer=True, minimum=1), "5",
        "attempts of one storage operation on transient errors (docs/storage.md)",
    ),
    Variable(
        "TBP_STORAGE_RETRY_S", "storage_retry_s", _number("TBP_STORAGE_RETRY_S", 30.0), "30",
        "no retry starts later than this after the first attempt",
    ),
    Variable(
        "TBP_UPLOAD_THREADS", "upload_threads", _number("TBP_UPLOAD_THREADS", 8, integer=True, minimum=1), "8",
        "parallel uploads of `upload_path()` files per rank (object stores)",
    ),
    Variable(
        "TBP_LEASE_TTL_S", "lease_ttl_s", _number("TBP_LEASE_TTL_S", 15.0, above=True), "15",
        "lease time-to-live of the job lock on object stores",
    ),
    Variable(
        SHARD_BYTES_ENV, "shard_bytes", _shard_bytes, "128M",
        "bytes of rows (Arrow's in-memory size) after which a rank rolls its record shard over at a commit (an int "
        "> 0; suffixes `k`, `M`, `G`)",
    ),
    Variable(
        LAUNCH_STATE_ENV, "launch_state", _text, "set by the launcher",
        "a file where each node's local rank 0 writes the state of its latest call (`running`, `finished`, "
        "`preempted`, `failed`), so that the launcher does not report a signal that came after the job finished as a "
        "preemption",
    ),
)
"""Every environment variable of the library, in the order docs/environment.md lists them."""


@dataclass(frozen=True)
class Settings:
    """The values of :data:`VARIABLES` (their docs are there)."""

    storage_path: EnvValue[str]
    storage_options: EnvValue[dict[str, Any]]
    job_name: EnvValue[str]
    hparams: EnvValue[dict[str, Any]]
    allow_script_change: bool
    progress: EnvValue[str]
    progress_interval: EnvValue[float]
    tensorboard: EnvValue[bool]
    profile: EnvValue[Any]
    metrics_interval: float
    straggler_ratio: float
    join_timeout_s: float
    heartbeat_silence_s: float
    collective_timeout_s: float
    storage_retries: int
    storage_retry_s: float
    upload_threads: int
    lease_ttl_s: float
    shard_bytes: int
    launch_state: str | None


def read_settings(environ: Mapping[str, str] | None = None, *, check: bool = True) -> Settings:
    """Reads and checks every variable of :data:`VARIABLES` in ``environ`` (default: this process's environment).

    Args:
        environ: the variables.
        check: raise for a tuning variable's bad value (``False``: its default stands in, for ``tbp run``, which only
            passes the variables on to the job, whose call refuses them).

    Raises:
        InvalidArgumentError: a tuning variable holds a bad value (naming it, what it means and its default).
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for variable in VARIABLES:
        raw = environ.get(variable.name)
        if not variable.stands_in:
            try:
                values[variable.field] = variable.parse(raw)
            except Exception:
                if check:
                    raise
                values[variable.field] = variable.parse(None)
            continue
        try:
            values[variable.field] = EnvValue(variable.name, variable.parse(raw))
        except Exception as exc:  # noqa: BLE001 - kept, raised where the value is used
            values[variable.field] = EnvValue(variable.name, None, str(exc))
    return Settings(**values)


_in_force: list[Settings] = []


@contextlib.contextmanager
def in_force(settings: Settings) -> Iterator[Settings]:
    """Puts ``settings`` in force for the duration of a call (every part of it, on any thread, reads them)."""
    _in_force.append(settings)
    try:
        yield settings
    finally:
        _in_force.remove(settings)


def current() -> Settings:
    """The settings of the call in progress, or, outside a call, the environment's now."""
    return _in_force[-1] if _in_force else read_settings()


def markdown_table() -> str:
    """The table of the library's own variables in docs/environment.md (made from :data:`VARIABLES`)."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{v.name}` | {v.default} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(lines)


assert {v.field for v in VARIABLES} == {f.name for f in fields(Settings)}, "every field has its variable"
