"""The two bounds a generation job puts on its batches in flight, checked in one place for both ways of setting them
(``generation.Generate(max_in_flight=..., drain_s=...)``, when the class is made, before any work; and
``context.use_generation_engine(engine, max_in_flight=..., drain_s=...)`` in a custom processor's ``__init__``):

- ``max_in_flight``: prompts handed to the engine at most (``None``: the runner's default from the engine's budget);
- ``drain_s``: at a stop, seconds the batches in flight get to finish (``None``: 30). Infinity waits for them all;
  NaN is refused (a deadline that never compares would wait forever without saying so).
"""

from __future__ import annotations

import math
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.integers import is_int

__all__ = ["check_drain_s", "check_max_in_flight"]


def check_max_in_flight(value: Any, caller: str) -> int | None:
    """``value`` if it is ``None`` or an int >= 1; ``caller`` names the call in the error (``"Generate"``).

    Raises:
        InvalidArgumentError: anything else, naming ``max_in_flight`` and what it takes.
    """
    if value is not None and (not is_int(value) or value < 1):
        raise InvalidArgumentError(
            f"{caller}(max_in_flight=...) must be None (the default: 4 x the engine's budget.max_sequences; with "
            f"schedule='dynamic' on several ranks, budget.max_sequences) or an int >= 1 (prompts in flight at most), "
            f"got {value!r}"
        )
    return value


def check_drain_s(value: Any, caller: str) -> float | None:
    """``value`` as a float if it is ``None`` or a number >= 0 (seconds; ``math.inf``: wait for every batch).

    Raises:
        InvalidArgumentError: anything else (NaN, a negative number, a string...), naming ``drain_s``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise InvalidArgumentError(
            f"{caller}(drain_s=...) must be None (the default: 30 s) or a number of seconds >= 0 that the batches in "
            f"flight get to finish at a stop, got {value!r}"
        )
    return float(value)
