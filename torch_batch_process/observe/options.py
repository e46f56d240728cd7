"""Options of the job's observability (progress display, TensorBoard, profiler, interim metrics).

Each option is a keyword argument of :func:`torch_batch_process` and an environment variable (which
``tbp run`` sets from the job config); an argument given explicitly wins over the variable. Every
value is checked before any work, and a bad one raises :class:`InvalidArgumentError` naming the
argument or the variable.

=========================  ===========================  ===================================================
argument                   environment variable         meaning
=========================  ===========================  ===================================================
``progress``               ``TBP_PROGRESS``             ``None``/``"auto"``: rank 0 shows a tqdm bar on a
                                                        terminal, plain log lines otherwise; ``"bar"``,
                                                        ``"log"``: force one; ``False``/``"off"``: nothing
``progress_interval``      ``TBP_PROGRESS_INTERVAL``    seconds between plain progress lines (default 30)
``tensorboard``            ``TBP_TENSORBOARD``          ``None``: event files when ``tensorboard`` is
                                                        installed; ``True``: required; ``False``: none
``profile``                ``TBP_PROFILE``              ``torch.profiler`` over a few steps (see below)
(none)                     ``TBP_METRICS_INTERVAL``     seconds between reduced metrics "so far" computed
                                                        at commits (default 60; ``0``: only at preemption
                                                        and at the end)
(none)                     ``TBP_STRAGGLER_RATIO``      a rank slower than this fraction of the median of
                                                        the others is logged as a straggler (default 0.5)
=========================  ===========================  ===================================================

``profile``: ``True`` profiles rank 0 with the default schedule; a dict may set ``ranks`` (list of
ranks, or ``"all"``), ``wait`` (steps skipped first, default 2), ``warmup`` (default 1), ``active``
(steps recorded, default 3), ``record_shapes``, ``profile_memory``, ``with_stack`` (default False).
``TBP_PROFILE`` takes ``1``/``true`` or the same dict as JSON.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.shell_commands import pip_install

PROGRESS_ENV = "TBP_PROGRESS"
PROGRESS_INTERVAL_ENV = "TBP_PROGRESS_INTERVAL"
TENSORBOARD_ENV = "TBP_TENSORBOARD"
PROFILE_ENV = "TBP_PROFILE"
METRICS_INTERVAL_ENV = "TBP_METRICS_INTERVAL"
STRAGGLER_RATIO_ENV = "TBP_STRAGGLER_RATIO"

ENV_VARS = (
    PROGRESS_ENV,
    PROGRESS_INTERVAL_ENV,
    TENSORBOARD_ENV,
    PROFILE_ENV,
    METRICS_INTERVAL_ENV,
    STRAGGLER_RATIO_ENV,
)

PROGRESS_MODES = ("auto", "bar", "log", "off")
DEFAULT_PROGRESS_INTERVAL_S = 30.0
DEFAULT_METRICS_INTERVAL_S = 60.0
DEFAULT_STRAGGLER_RATIO = 0.5

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_PROFILE_KEYS = ("ranks", "wait", "warmup", "active", "record_shapes", "profile_memory", "with_stack")


@dataclass(frozen=True)
class ProfileOptions:
    """Which ranks run ``torch.profiler``, and over which steps (a ``torch.profiler.schedule``)."""

    ranks: tuple[int, ...] | None = (0,)
    """Ranks to profile; ``None`` means every rank."""
    wait: int = 2
    warmup: int = 1
    active: int = 3
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False

    def covers(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


@dataclass(frozen=True)
class ObserveOptions:
    """Resolved observability options of one call (see the module docstring)."""

    progress: str = "auto"
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL_S
    tensorboard: bool = False
    profile: ProfileOptions | None = None
    metrics_interval: float = DEFAULT_METRICS_INTERVAL_S
    straggler_ratio: float = DEFAULT_STRAGGLER_RATIO


def tensorboard_installed() -> bool:
    """Whether the ``tensorboard`` package (whose protocol buffer classes the event files are written with) can be
    imported."""
    return importlib.util.find_spec("tensorboard") is not None


def resolve_observe_options(
    progress: Any = None,
    progress_interval: Any = None,
    tensorboard: Any = None,
    profile: Any = None,
) -> ObserveOptions:
    """Checks the arguments, falls back on the environment variables, and returns the options."""
    return ObserveOptions(
        progress=_progress_mode(progress),
        progress_interval=_seconds(
            "progress_interval", progress_interval, PROGRESS_INTERVAL_ENV, DEFAULT_PROGRESS_INTERVAL_S, allow_zero=False
        ),
        tensorboard=_tensorboard(tensorboard),
        profile=_profile(profile),
        metrics_interval=_seconds("", None, METRICS_INTERVAL_ENV, DEFAULT_METRICS_INTERVAL_S, allow_zero=True),
        straggler_ratio=_ratio(),
    )


def _progress_mode(value: Any) -> str:
    name = "progress"
    if value is None:
        raw = os.environ.get(PROGRESS_ENV, "").strip().lower()
        if not raw:
            return "auto"
        name, value = f"environment variable {PROGRESS_ENV}", raw
        if raw in _TRUE:
            return "auto"
        if raw in _FALSE:
            return "off"
    if value is True:
        return "auto"
    if value is False:
        return "off"
    if isinstance(value, str) and value.lower() in PROGRESS_MODES:
        return value.lower()
    raise InvalidArgumentError(
        f"{name} must be None, True, False or one of {list(PROGRESS_MODES)}, got {value!r}"
    )


def _seconds(name: str, value: Any, env: str, default: float, *, allow_zero: bool) -> float:
    where = name
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return default
        where = f"environment variable {env}"
        try:
            value = float(raw)
        except ValueError:
            raise InvalidArgumentError(f"{where} must be a number of seconds, got {raw!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{where} must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgumentError(f"{where} must be {bound} seconds, got {value!r}")
    return float(value)


def _tensorboard(value: Any) -> bool:
    name = "tensorboard"
    if value is None:
        raw = os.environ.get(TENSORBOARD_ENV, "").strip().lower()
        if not raw or raw == "auto":
            return tensorboard_installed()
        name = f"environment variable {TENSORBOARD_ENV}"
        if raw in _TRUE:
            value = True
        elif raw in _FALSE:
            value = False
        else:
            raise InvalidArgumentError(f"{name} must be 1, 0 or auto, got {raw!r}")
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be None, True or False, got {value!r}")
    if value and not tensorboard_installed():
        raise InvalidArgumentError(
            f"{name}=True needs the tensorboard package: {pip_install('tensorboard')} "
            "(or pass tensorboard=None to write event files only when it is installed)"
        )
    return value


def _profile(value: Any) -> ProfileOptions | None:
    name = "profile"
    if value is None:
        raw = os.environ.get(PROFILE_ENV, "").strip()
        if not raw:
            return None
        name = f"environment variable {PROFILE_ENV}"
        if raw.lower() in _TRUE:
            value = True
        elif raw.lower() in _FALSE:
            return None
        else:
            try:
                value = json.loads(raw)
            except ValueError as exc:
                raise InvalidArgumentError(f"{name} must be 1, 0 or a JSON object, got {raw!r} ({exc})") from None
    if value is False:
        return None
    if value is True:
        return ProfileOptions()
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{name} must be None, True, False or a dict, got {value!r}")
    unknown = sorted(set(map(str, value)) - set(_PROFILE_KEYS))
    if unknown:
        raise InvalidArgumentError(f"{name} has unknown key(s) {unknown}; known keys: {list(_PROFILE_KEYS)}")
    ranks: tuple[int, ...] | None = (0,)
    if "ranks" in value:
        raw_ranks = value["ranks"]
        if raw_ranks == "all":
            ranks = None
        elif isinstance(raw_ranks, (list, tuple)) and raw_ranks and all(_nonneg_int(r) for r in raw_ranks):
            ranks = tuple(sorted(set(raw_ranks)))
        else:
            raise InvalidArgumentError(f"{name}['ranks'] must be a non-empty list of ranks (ints >= 0) or 'all'")
    steps = {}
    for key, default, low in (("wait", 2, 0), ("warmup", 1, 0), ("active", 3, 1)):
        step = value.get(key, default)
        if not _nonneg_int(step) or step < low:
            raise InvalidArgumentError(f"{name}[{key!r}] must be an int >= {low}, got {step!r}")
        steps[key] = step
    flags = {}
    for key in ("record_shapes", "profile_memory", "with_stack"):
        flag = value.get(key, False)
        if not isinstance(flag, bool):
            raise InvalidArgumentError(f"{name}[{key!r}] must be True or False, got {flag!r}")
        flags[key] = flag
    return ProfileOptions(ranks=ranks, **steps, **flags)


def _ratio() -> float:
    raw = os.environ.get(STRAGGLER_RATIO_ENV, "").strip()
    if not raw:
        return DEFAULT_STRAGGLER_RATIO
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise InvalidArgumentError(f"environment variable {STRAGGLER_RATIO_ENV} must be a number in (0, 1), got {raw!r}")
    return value


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
