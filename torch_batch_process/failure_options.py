"""The failure options of :func:`~torch_batch_process.torch_batch_process` (DESIGN §11), checked up front.

- ``on_error``: ``"raise"`` (default) fails the job on the first exception; ``"skip"`` splits a failing batch
  down to the examples that fail, records them under ``<storage>/failures/`` and goes on
  (:mod:`torch_batch_process.engine.feed.failing_examples`).
- ``max_failures``: with ``"skip"``, the most examples that may fail: an int count, or a float fraction of
  the job's examples (``0 < f < 1``); ``None``: no limit. Past it the job fails with
  :class:`~torch_batch_process.errors.TooManyFailuresError`.
- ``batch_timeout``: seconds a batch may run (:mod:`torch_batch_process.engine.feed.watchdog`); ``None``: no limit.
- ``retry_failed``: on a finished job, process only its recorded failures
  (:mod:`torch_batch_process.engine.plan.retry`).
- ``on_oom`` (DESIGN §15): ``"split"`` (default) runs a batch that runs out of the device's memory in parts that
  fit and learns what fits, so that later batches are cut before they run
  (:mod:`torch_batch_process.engine.feed.oom`); ``"raise"`` treats an out-of-memory error as any other error
  (``on_error`` decides). The default is ``"split"`` because an out-of-memory error is the most common way a long
  job dies, and a job cannot be resumed with a smaller ``batch_size`` (part of its fingerprint); what it costs a
  job that never runs out of memory is a transaction per batch (the ``on_error="skip"`` one: about a microsecond,
  plus a copy of the state of custom reducers, see :mod:`torch_batch_process.engine.feed.failing_examples`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch_batch_process.errors import InvalidArgumentError

__all__ = ["FailureOptions", "validate_failure_options"]

ON_ERROR = ("raise", "skip")
ON_OOM = ("split", "raise")


@dataclass(frozen=True)
class FailureOptions:
    """Validated failure options of one call."""

    on_error: str = "raise"
    max_failures: int | float | None = None
    batch_timeout: float | None = None
    retry_failed: bool = False
    on_oom: str = "split"

    @property
    def skip(self) -> bool:
        return self.on_error == "skip"

    @property
    def split_on_oom(self) -> bool:
        return self.on_oom == "split"

    def limit(self, num_examples: int) -> int | None:
        """The most examples that may fail in a job of ``num_examples`` examples (``None``: no limit)."""
        if self.max_failures is None:
            return None
        if isinstance(self.max_failures, float):
            return math.floor(self.max_failures * num_examples)
        return self.max_failures


def validate_failure_options(
    on_error: Any, max_failures: Any, batch_timeout: Any, retry_failed: Any = False, on_oom: Any = "split"
) -> FailureOptions:
    """Checks ``on_error``, ``max_failures``, ``batch_timeout``, ``retry_failed`` and ``on_oom``; raises
    :class:`InvalidArgumentError`."""
    if on_oom not in ON_OOM:
        raise InvalidArgumentError(
            f"on_oom must be 'split' (a batch that runs out of the device's memory runs in parts that fit, and the "
            f"job learns what fits; the default) or 'raise' (an out-of-memory error is an error like any other), "
            f"got {on_oom!r}"
        )
    if not isinstance(retry_failed, bool):
        raise InvalidArgumentError(f"retry_failed must be True or False, got {retry_failed!r}")
    if on_error not in ON_ERROR:
        raise InvalidArgumentError(
            f"on_error must be 'raise' (fail the job on the first exception) or 'skip' (record failing examples "
            f"and go on), got {on_error!r}"
        )
    if max_failures is not None:
        if on_error != "skip":
            raise InvalidArgumentError(
                f"max_failures={max_failures!r} needs on_error='skip' (with 'raise' the first failure fails the job)"
            )
        if isinstance(max_failures, bool) or not isinstance(max_failures, (int, float)):
            raise InvalidArgumentError(
                f"max_failures must be an int count (>= 0) or a float fraction of the examples (0 < f < 1), "
                f"got {max_failures!r}"
            )
        if isinstance(max_failures, int) and max_failures < 0:
            raise InvalidArgumentError(f"max_failures must be >= 0 (a count of examples), got {max_failures}")
        if isinstance(max_failures, float) and not 0.0 < max_failures < 1.0:
            raise InvalidArgumentError(
                f"max_failures={max_failures!r}: a float is a fraction of the examples and must be in (0, 1); "
                "pass an int for a count"
            )
    if batch_timeout is not None:
        if isinstance(batch_timeout, bool) or not isinstance(batch_timeout, (int, float)) or not batch_timeout > 0:
            raise InvalidArgumentError(f"batch_timeout must be a number of seconds > 0, or None, got {batch_timeout!r}")
        if not math.isfinite(batch_timeout):
            raise InvalidArgumentError(f"batch_timeout must be finite (or None for no limit), got {batch_timeout!r}")
        batch_timeout = float(batch_timeout)
    return FailureOptions(on_error, max_failures, batch_timeout, retry_failed, on_oom)
