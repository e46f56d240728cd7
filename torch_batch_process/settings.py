"""The library's environment variables: every ``TBP_*`` variable, read and checked once, into one typed object.

A call of :func:`~torch_batch_process.torch_batch_process` reads the environment at its start (:func:`read_settings`)
and puts the :class:`Settings` in force for its duration (:func:`in_force`); every part of the call takes its values
from :func:`current` (a storage retry, an upload, the lease, the join...), never from ``os.environ``. Outside a call
(the ``tbp`` commands, ``read_outputs``), :func:`current` reads the environment when asked. Nothing else in the
package reads a ``TBP_*`` variable (``tests/test_settings.py`` checks it), and docs/environment.md's table is the one
:data:`VARIABLES` gives (:func:`markdown_table`; the same test compares them).

Every variable is one field of :class:`Settings`, declared with its name, parser, default and meaning
(:func:`variable`): adding a variable is adding one field there. One policy for all of them: unset, empty or blank
means "not set"; any other value parses to a value or to an
:class:`~torch_batch_process.errors.InvalidArgumentError` naming the variable. Two kinds of variables:

- *tuning* variables are always in use: not set, they take their default; a bad value fails the call when it starts,
  before any work (:func:`read_settings` raises it);
- variables that *stand in for an argument* (``TBP_STORAGE_PATH`` for ``storage_path``, ``TBP_PROGRESS`` for
  ``progress``...) are read and checked at the same moment into an :class:`EnvValue`: ``None`` when not set (the
  argument's own default applies), else the value, or the error of a bad value, raised only where it is used: when
  the argument is not given (``TBP_HPARAMS``: by ``context.get_hparams()``; logging the hyperparameters skips a bad
  value with a warning). So each JSON variable is parsed once, with one policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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
    "variable",
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
AGREEMENT_ENV = "TBP_AGREEMENT_S"

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
    """A variable that stands in for an argument: its value (``None``: not set, and only then), or the error of a bad
    value, raised by :meth:`get` (only where the value is used)."""

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
# One policy for every variable: unset, empty or blank means "not set" (a tuning variable's default; a stand-in's
# ``None``, so the argument's own default applies); any other value parses to a value or to an error naming the
# variable.


def _blank(raw: str | None) -> bool:
    return raw is None or not raw.strip()


def _number(
    name: str,
    default: float | None,
    *,
    integer: bool = False,
    minimum: float = 0.0,
    above: bool = False,
    seconds: bool = False,
    why: str = "",
) -> Callable[[str | None], Any]:
    """A number: ``default`` when not set, else an int (``integer``) or a finite float, ``>= minimum`` (``>`` with
    ``above``); the error says what it is (``seconds``), why (``why``) and the default."""

    def parse(raw: str | None) -> Any:
        if _blank(raw):
            return default
        assert raw is not None
        try:
            value: float = int(raw) if integer else float(raw)
        except ValueError:
            value = math.nan
        if not (value > minimum if above else value >= minimum) or not math.isfinite(value):  # NaN fails both
            kind = "an int" if integer else "a number of seconds" if seconds else "a number"
            bound = f"> {minimum:g}" if above else f">= {minimum:g}"
            unset = "" if default is None else f"; unset it for the default ({default:g}{' s' if seconds else ''})"
            raise _invalid(f"environment variable {name} must be {kind} {bound}{why}, got {raw!r}{unset}")
        return value

    return parse


def _shard_bytes(raw: str | None) -> int:
    if _blank(raw):
        return DEFAULT_SHARD_BYTES
    assert raw is not None
    raw = raw.strip()
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(raw[-1].lower(), 1)
    digits = raw[:-1] if scale > 1 else raw
    if not digits.isdigit() or int(digits) * scale <= 0:
        raise _invalid(
            f"{SHARD_BYTES_ENV}={raw!r}: expected a positive number of bytes (e.g. 134217728 or 128M), the size of "
            "rows after which a rank starts a new record shard; unset it for the default (128M)"
        )
    return int(digits) * scale


def _ratio(raw: str | None) -> float:
    if _blank(raw):
        return DEFAULT_STRAGGLER_RATIO
    assert raw is not None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise _invalid(f"environment variable TBP_STRAGGLER_RATIO must be a number in (0, 1), got {raw!r}")
    return value


def _text(raw: str | None) -> str | None:
    return None if _blank(raw) else raw


def _json_object(name: str) -> Callable[[str | None], dict[str, Any] | None]:
    def parse(raw: str | None) -> dict[str, Any] | None:
        if _blank(raw):
            return None
        assert raw is not None
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise _invalid(f"environment variable {name} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise _invalid(f"environment variable {name} must hold a JSON object, got {type(value).__name__}")
        return value

    return parse


def _switch(name: str, *, auto: bool = False) -> Callable[[str | None], bool | None]:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (and ``auto`` with ``auto``: ``None``, as
    unset)."""

    def parse(raw: str | None) -> bool | None:
        if _blank(raw):
            return None
        assert raw is not None
        word = raw.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        if auto and word == "auto":
            return None
        raise _invalid(f"environment variable {name} must be 1, 0{' or auto' if auto else ''}, got {raw!r}")

    return parse


def _flag(name: str) -> Callable[[str | None], bool]:
    """A tuning switch, off unless set to ``1`` (``true``, ``yes``, ``on``)."""
    switch = _switch(name)
    return lambda raw: bool(switch(raw))


def _progress(raw: str | None) -> str | None:
    if _blank(raw):
        return None
    assert raw is not None
    word = raw.strip().lower()
    if word in _TRUE:
        return "auto"
    if word in _FALSE:
        return "off"
    if word in PROGRESS_MODES:
        return word
    raise _invalid(
        f"environment variable TBP_PROGRESS must be None, True, False or one of {list(PROGRESS_MODES)}, got {raw!r}"
    )


def _profile(raw: str | None) -> bool | dict[str, Any] | None:
    if _blank(raw):
        return None
    assert raw is not None
    word = raw.strip()
    if word.lower() in _TRUE:
        return True
    if word.lower() in _FALSE:
        return False
    try:
        value = json.loads(word)
    except ValueError as exc:
        raise _invalid(f"environment variable TBP_PROFILE must be 1, 0 or a JSON object, got {raw!r} ({exc})") from None
    if not isinstance(value, dict):
        raise _invalid(f"environment variable TBP_PROFILE must be 1, 0 or a JSON object, got {raw!r}")
    return value  # its keys are checked with the argument's (observe/options.py)


# ---------------------------------------------------------------------------------------------------- the table

JOIN_TIMEOUT_S = 600.0
HEARTBEAT_SILENCE_S = 15.0
COLLECTIVE_TIMEOUT_S = 1800.0
DEFAULT_SHARD_BYTES = 128 << 20
DEFAULT_PROGRESS_INTERVAL_S = 30.0
DEFAULT_METRICS_INTERVAL_S = 60.0
DEFAULT_STRAGGLER_RATIO = 0.5
DEFAULT_AGREEMENT_S = 0.05


@dataclass(frozen=True)
class Variable:
    """One environment variable of the library: the :class:`Settings` field it fills, its parser, and its docs."""

    name: str
    parse: Callable[[str | None], Any]
    default: str
    """The default as docs/environment.md says it."""
    meaning: str
    stands_in: bool = False
    """It stands in for an argument: a bad value is kept as its error (:class:`EnvValue`) until it is used."""
    field: str = ""
    """The :class:`Settings` field (set from the field that declares it)."""


def variable(
    name: str, parse: Callable[[str | None], Any], default: str, meaning: str, *, stands_in: bool = False
) -> Any:
    """Declares a field of :class:`Settings` as the value of environment variable ``name`` (see :class:`Variable`)."""
    return dataclasses.field(metadata={"variable": Variable(name, parse, default, meaning, stands_in)})


@dataclass(frozen=True)
class Settings:
    """The library's environment variables, one field each, in the order docs/environment.md lists them.

    A field is declared with its variable (:func:`variable`): its name, parser, default and meaning. Adding a
    variable is adding one field here (then ``settings.current().<field>`` where it is used, and the table in
    docs/environment.md, which ``tests/test_settings.py`` prints when it differs).
    """

    storage_path: EnvValue[str] = variable(
        STORAGE_ENV, _text, "`./tbp_runs/<job name>`",
        "storage path when `storage_path` is not given (`tbp run` sets it from `checkpoint_storage`)", stands_in=True,
    )
    storage_options: EnvValue[dict[str, Any]] = variable(
        STORAGE_OPTIONS_ENV, _json_object(STORAGE_OPTIONS_ENV), "none",
        "JSON object of fsspec options when `storage_options` is not given (and of the `tbp` commands without "
        "`--storage-options`)", stands_in=True,
    )
    job_name: EnvValue[str] = variable(
        JOB_NAME_ENV, _text, "the script's stem",
        "the job name when `job_name` is not given (`tbp run`: the config's `name`)", stands_in=True,
    )
    hparams: EnvValue[dict[str, Any]] = variable(
        HPARAMS_ENV, _json_object(HPARAMS_ENV), "`{}`",
        "JSON object: `context.get_hparams()` (`tbp run`: the config's `hyperparameters`); a bad value fails "
        "`get_hparams()` only, and the hyperparameters are then not logged (a warning)", stands_in=True,
    )
    allow_script_change: bool = variable(
        ALLOW_SCRIPT_CHANGE_ENV, _flag(ALLOW_SCRIPT_CHANGE_ENV), "0",
        "`1`: resume a stored job that another script started (a renamed script) instead of refusing it with "
        "`JobMismatchError` (see the README, \"Resume\")",
    )
    progress: EnvValue[str] = variable(
        "TBP_PROGRESS", _progress, "auto", "the `progress` argument (docs/observability.md)", stands_in=True
    )
    progress_interval: EnvValue[float] = variable(
        "TBP_PROGRESS_INTERVAL", _number("TBP_PROGRESS_INTERVAL", None, above=True, seconds=True), "30",
        "the `progress_interval` argument (seconds)", stands_in=True,
    )
    tensorboard: EnvValue[bool] = variable(
        "TBP_TENSORBOARD", _switch("TBP_TENSORBOARD", auto=True), "auto",
        "the `tensorboard` argument (`1`, `0`, `auto`)", stands_in=True,
    )
    profile: EnvValue[Any] = variable(
        "TBP_PROFILE", _profile, "off", "the `profile` argument (`1`, `0` or a JSON object)", stands_in=True
    )
    metrics_interval: float = variable(
        "TBP_METRICS_INTERVAL", _number("TBP_METRICS_INTERVAL", DEFAULT_METRICS_INTERVAL_S, seconds=True), "60",
        "seconds between reduced metrics \"so far\" computed at commits (`0`: only at preemption and at the end)",
    )
    straggler_ratio: float = variable(
        "TBP_STRAGGLER_RATIO", _ratio, "0.5",
        "a rank slower than this fraction of the others' median is logged as a straggler",
    )
    join_timeout_s: float = variable(
        JOIN_TIMEOUT_ENV,
        _number(JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S, above=True, seconds=True,
                why=" (how long ranks wait for each other to join)"),
        "600",
        "seconds the ranks wait for each other to join when the library creates the process group; a rank that has "
        "not joined by then fails the others with `WorkerLostError` naming it, and a rank that cannot reach rank 0's "
        "store by then (rank 0 never started, or `MASTER_ADDR`/`MASTER_PORT` are wrong) fails with a "
        "`WorkerLostError` saying so. 600 s is torchrun's own rendezvous `join_timeout`: the nodes of a cluster may "
        "start minutes apart (an image pull, a slow scheduler). Once every rank has joined, the process groups are "
        "connected within at most 60 s (`torch_batch_process/engine/join.py`)",
    )
    heartbeat_silence_s: float = variable(
        HEARTBEAT_SILENCE_ENV,
        _number(HEARTBEAT_SILENCE_ENV, HEARTBEAT_SILENCE_S, minimum=2 * HEARTBEAT_S, seconds=True,
                why=f" (heartbeats come every {HEARTBEAT_S:g} s)"),
        "15",
        "seconds without a heartbeat after which a rank is lost: while the job opens (every start with plain "
        "processes), and during a `schedule=\"dynamic\"` job (at least 2: heartbeats come every second)",
    )
    collective_timeout_s: float = variable(
        COLLECTIVE_TIMEOUT_ENV, _number(COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S, above=True), "1800",
        "the timeout of the process groups' collectives (torch's own default): the last resort of a rank that waits "
        "on a peer that neither answers nor closes its connection",
    )
    agreement_s: float = variable(
        AGREEMENT_ENV, _number(AGREEMENT_ENV, DEFAULT_AGREEMENT_S, seconds=True), "0.05",
        "seconds the static schedule aims at between two agreements of the ranks (whether to stop, commit or fail): "
        "a preemption or a failure stops every rank within this and a step; `0` agrees at every step boundary (a "
        "collective per step)",
    )
    mesh_grace_s: float = variable(
        "TBP_MESH_GRACE_S", _number("TBP_MESH_GRACE_S", 10.0, seconds=True), "10",
        "with `mesh=`: seconds a rank may stay in its steps once a member of its replica failed (it may be blocked in "
        "a collective with it, which nothing else releases); then it logs its stacks and exits with code 1, so that "
        "every rank stops; also how long a rank waits for the others of its replica after an attempt of a batch "
        "(`on_oom=\"split\"`) before it fails with `MemberOutOfStepError` (docs/mesh.md)",
    )
    storage_retries: int = variable(
        "TBP_STORAGE_RETRIES", _number("TBP_STORAGE_RETRIES", 5, integer=True, minimum=1), "5",
        "attempts of one storage operation on transient errors (docs/storage.md)",
    )
    storage_retry_s: float = variable(
        "TBP_STORAGE_RETRY_S", _number("TBP_STORAGE_RETRY_S", 30.0), "30",
        "no retry starts later than this after the first attempt",
    )
    upload_threads: int = variable(
        "TBP_UPLOAD_THREADS", _number("TBP_UPLOAD_THREADS", 8, integer=True, minimum=1), "8",
        "parallel uploads of `upload_path()` files per rank (object stores)",
    )
    lease_ttl_s: float = variable(
        "TBP_LEASE_TTL_S", _number("TBP_LEASE_TTL_S", 15.0, above=True), "15",
        "lease time-to-live of the job lock on object stores",
    )
    shard_bytes: int = variable(
        SHARD_BYTES_ENV, _shard_bytes, "128M",
        "bytes of rows (Arrow's in-memory size) after which a rank rolls its record shard over at a commit (an int "
        "> 0; suffixes `k`, `M`, `G`)",
    )
    launch_state: str | None = variable(
        LAUNCH_STATE_ENV, _text, "set by the launcher",
        "a file where each node's local rank 0 writes the state of its latest call (`running`, `finished`, "
        "`preempted`, `failed`), so that the launcher does not report a signal that came after the job finished as a "
        "preemption",
    )


VARIABLES: tuple[Variable, ...] = tuple(
    dataclasses.replace(f.metadata["variable"], field=f.name) for f in dataclasses.fields(Settings)
)
"""Every environment variable of the library, in the order of :class:`Settings` (and of docs/environment.md)."""


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
    for each in VARIABLES:
        raw = environ.get(each.name)
        if each.stands_in:
            try:
                values[each.field] = EnvValue(each.name, each.parse(raw))
            except Exception as exc:  # noqa: BLE001 - kept, raised where the value is used
                values[each.field] = EnvValue(each.name, None, str(exc))
            continue
        try:
            values[each.field] = each.parse(raw)
        except Exception:
            if check:
                raise
            values[each.field] = each.parse(None)
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

