"""One line of a job's ``metrics.jsonl``, as a rank makes it (``context.report_metrics()``, provenance) and rank 0
appends it with the commit that covers it."""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["MetricsLine"]


class MetricsLine(TypedDict):
    """A ``metrics.jsonl`` line: ``metrics`` is the user's (JSON values), the rest says whose and when."""

    group: str
    steps_completed: int
    rank: int
    metrics: dict[str, Any]
