"""A generation job's prompts and tokens per second, for rank 0's progress display (DESIGN §19, issue 44 item 6).

The generation participant adds the counts of each merged vote (the batches a commit covers: prompts answered, their
prompt tokens and answer tokens); the display appends :meth:`TokenRates.text` to its line or bar. Rates count this
attempt's committed work from the observer's start (a batch counts once it is committed, so the rates move at each
commit and lag by at most a commit interval). Per rank, ``tbp status`` and ``tbp report`` show the same counts from
the commit record (:func:`rates_per_rank`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["GENERATION_STATS", "TokenRates", "format_rate", "rates_per_rank"]

GENERATION_STATS = ("generated_prompts", "prompt_tokens", "completion_tokens", "resumed_prompts", "reused_tokens")
"""A generation job's totals over every attempt in a commit record's ``stats``."""


def format_rate(value: float) -> str:
    """``310``, ``1.2k``, ``3.4M`` (tokens per second)."""
    for limit, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.1f}{suffix}"
    return f"{value:.0f}"


class TokenRates:
    """Prompts and tokens committed in this attempt (rank 0); thread-safe (votes merge on a collector thread with the
    dynamic schedule)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self.prompts = self.tokens_in = self.tokens_out = 0

    def add(self, prompts: int, tokens_in: int, tokens_out: int) -> None:
        with self._lock:
            self.prompts += prompts
            self.tokens_in += tokens_in
            self.tokens_out += tokens_out

    def text(self) -> str | None:
        """``"1,234 prompts, in 1.2k tok/s, out 310 tok/s"``; ``None`` before any prompt is committed."""
        if not self.prompts:
            return None
        elapsed = max(self._clock() - self._started, 1e-9)
        return (
            f"{self.prompts:,} prompts, in {format_rate(self.tokens_in / elapsed)} tok/s, "
            f"out {format_rate(self.tokens_out / elapsed)} tok/s"
        )


def rates_per_rank(ranks: Sequence[Sequence[int]], elapsed_s: float | None) -> list[dict[str, Any]]:
    """Each rank's ``[rank, prompts, tokens in, tokens out]`` of an attempt (a record's
    ``stats["generation_ranks"]``) with its tokens per second over the attempt's ``elapsed_s``."""
    rows = []
    for rank, prompts, tokens_in, tokens_out in ranks:
        rows.append({
            "rank": rank, "prompts": prompts, "tokens_in": tokens_in, "tokens_out": tokens_out,
            "tokens_in_per_s": tokens_in / elapsed_s if elapsed_s else None,
            "tokens_out_per_s": tokens_out / elapsed_s if elapsed_s else None,
        })
    return rows
