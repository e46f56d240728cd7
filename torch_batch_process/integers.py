"""What counts as an integer argument: an ``int`` that is not a ``bool`` (in Python a bool is an int, never a count
or a size), and where values may come from numpy (lengths, sizes computed with it), numpy integers too."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_int", "is_integer"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """:func:`is_int`, or a numpy integer (a numpy bool is not one). Imports no numpy: a value can only be a numpy
    integer once numpy is imported."""
    numpy = sys.modules.get("numpy")
    return is_int(value) or (numpy is not None and isinstance(value, numpy.integer))
