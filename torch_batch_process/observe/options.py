"""Options of the job's observability (progress display, TensorBoard, profiler, interim metrics).

Each option is a keyword argument of :func:`torch_batch_process` and an environment variable (which
``tbp run`` sets from the job config, read by :mod:`torch_batch_process.settings`); an argument given explicitly wins
over the variable. Every value is checked before any work, and a bad one raises :class:`InvalidArgumentError` naming
the argument or the variable.

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
import math
from dataclasses import dataclass
from typing import Any

from torch_batch_process import settings
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.settings import (
    DEFAULT_METRICS_INTERVAL_S,
    DEFAULT_PROGRESS_INTERVAL_S,
    DEFAULT_STRAGGLER_RATIO,
    PROGRESS_MODES,
)
from torch_batch_process.shell_commands import pip_install

__all__ = [
    "DEFAULT_METRICS_INTERVAL_S", "DEFAULT_PROGRESS_INTERVAL_S", "DEFAULT_STRAGGLER_RATIO", "ObserveOptions",
    "ProfileOptions", "resolve_observe_options", "tensorboard_installed",
]

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
    """Checks the arguments, falls back on the environment variables (the call's settings), and returns the options."""
    env = settings.current()
    return ObserveOptions(
        progress=_progress_mode(progress, env),
        progress_interval=_seconds("progress_interval", progress_interval, env),
        tensorboard=_tensorboard(tensorboard, env),
        profile=_profile(profile, env),
        metrics_interval=env.metrics_interval,
        straggler_ratio=env.straggler_ratio,
    )


def _progress_mode(value: Any, env: settings.Settings) -> str:
    if value is None:
        return env.progress.get() or "auto"
    if value is True:
        return "auto"
    if value is False:
        return "off"
    if isinstance(value, str) and value.lower() in PROGRESS_MODES:
        return value.lower()
    raise InvalidArgumentError(
        f"progress must be None, True, False or one of {list(PROGRESS_MODES)}, got {value!r}"
    )


def _seconds(name: str, value: Any, env: settings.Settings) -> float:
    if value is None:
        given = env.progress_interval.get()
        return given if given is not None else DEFAULT_PROGRESS_INTERVAL_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a number of seconds, got {value!r}")
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be > 0 seconds, got {value!r}")
    return float(value)


def _tensorboard(value: Any, env: settings.Settings) -> bool:
    name = "tensorboard"
    if value is None:
        given = env.tensorboard.get()
        if given is None:
            return tensorboard_installed()
        name, value = env.tensorboard.where, given
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be None, True or False, got {value!r}")
    if value and not tensorboard_installed():
        raise InvalidArgumentError(
            f"{name}=True needs the tensorboard package: {pip_install('tensorboard')} "
            "(or pass tensorboard=None to write event files only when it is installed)"
        )
    return value


def _profile(value: Any, env: settings.Settings) -> ProfileOptions | None:
    name = "profile"
    if value is None:
        given = env.profile.get()
        if given is None:
            return None
        name, value = env.profile.where, given
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


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
