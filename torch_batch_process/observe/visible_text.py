"""Text that a job stores but nobody vetted, made safe to show on a terminal, in a log line or on a page.

Exception messages of failing examples (``tbp failures``, ``tbp status``, ``tbp report``), a keyed job's
``version=``, a generation job's model name: the library shows them as they were given, except for the characters
that would act instead of being read. :func:`visible` writes each of those as its Python escape (``\\x1b``,
``\\u202e``, ``\\ud800``):

- control characters (C0 but newline and tab, DEL, C1): an escape sequence would move the cursor, recolour or
  clear the terminal, set its title or its clipboard (OSC 52); a carriage return would overwrite the line shown;
- bidirectional embeddings, overrides and isolates: they reorder what a line seems to say ("Trojan Source"); the
  marks that right-to-left text itself uses (U+200E, U+200F, U+061C) are kept;
- lone surrogates (a ``str`` decoded with ``surrogateescape``, a JSON ``\\ud800``): no UTF-8 holds them, so
  printing or writing them as UTF-8 raised ``UnicodeEncodeError`` and the command showed a traceback instead.

Letters of every script, emoji and HTML stay as they are (a page escapes HTML itself).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["visible"]

_ACTING = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f"  # control characters but \t and \n
    "\u202a-\u202e\u2066-\u2069"  # bidirectional embeddings, overrides and isolates (not the marks RTL text uses)
    "\ud800-\udfff]"  # lone surrogates
)


def visible(text: Any, limit: int | None = None) -> str:
    """``str(text)`` with every character that acts (see the module docstring) written as its escape, cut to
    ``limit`` characters (``...`` at the end) when given."""
    raw = str(text)
    cut = limit is not None and len(raw) > limit
    if limit is not None:
        raw = raw[:limit]  # first: a message of megabytes is not scanned whole to show its start
    shown = _ACTING.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), raw)
    if limit is not None and (cut or len(shown) > limit):
        return shown[: max(0, limit - 3)] + "..."
    return shown
