"""The job's timeline: what every rank did, sampled at commits into ``metrics.jsonl``, bounded in size.

``tbp report`` and ``tbp dashboard`` plot a job over time (throughput per rank and in total, batch times,
commit latency, failures) from *timeline points*: ``metrics.jsonl`` records of group ``"timeline"`` that rank 0
writes with commit records. A point holds what happened since the previous point of the same attempt, as rank 0
merged it from the ranks' votes (:class:`RankActivity`): per rank, its batches, examples, seconds loading data,
in ``process_batch`` and in commits, its commits, and the histogram of its batches' ``process_batch`` seconds
(:mod:`~torch_batch_process.observe.histogram`); and for the job, the commit records written, their write
seconds and the histogram of commit latencies (per record write, the longest wait of the commits it wrote: from
their votes' merge to the record being durable), with the
counts committed so far::

    {"group": "timeline", "rank": 0, "steps_completed": 1200, "time": 1732200000.0, "commit": 240, "attempt": 1,
     "metrics": {"point": 17, "attempt_started": 1732199000.0, "elapsed_s": 1000.0, "world_size": 2,
                 "batches_committed": 1200, "examples_committed": 38400, "failed_examples": 0, "commits": 12,
                 "last": false, "preempted": false, "finished": false,
                 "ranks": {"batches": [60, 60], "examples": [1920, 1920], "data_s": [0.4, 0.5],
                           "process_s": [5.1, 9.8], "commit_s": [0.2, 0.1], "votes": [12, 12],
                           "batch_times": [[-15, 40, 20], [-12, 60]]},
                 "record_writes": 12, "record_write_s": 0.05, "record_write_max_s": 0.007,
                 "commit_latency": [-24, 10, 2]}}

(Histograms as :func:`~torch_batch_process.observe.histogram.to_json` writes them: the lowest bin, then the
counts; seconds to four significant digits.)

**When.** A point is written at a commit when :meth:`Timeline.interval_s` has passed since the previous one, and
at the last commit of every call (the end, a preemption). The interval starts at :data:`FIRST_INTERVAL_S` and
doubles after every :data:`POINTS_PER_LEVEL` points of the job (the count is kept in the commit records, so it
goes on across resumes): ``120 * (2**k - 1)`` seconds of running take ``120 * k`` points.

**Size bound.** A job that runs ``T`` seconds writes at most ``120 * ceil(log2(T / 120 + 1))`` points plus one
per call (its last): about 1,100 for a day, 1,500 for a week, 1,800 for a month, whatever its number of batches
(10^6 or 10^9). A point takes about ``600 + 100 * W`` bytes for ``W`` ranks (with batch times spread over three
octaves, 12 bins; fewer bins, fewer bytes): for a week on 8 ranks, at most about 2.2 MB; on 64 ranks, about
11 MB. Nothing is stored per batch.

**Cost.** Per batch: one histogram update in :class:`~torch_batch_process.engine.commit.votes.Part` (a binary search and
a dict increment). Per commit: rank 0 adds each vote to :class:`RankActivity` (a few list updates and the vote's
histogram, about ten entries) and compares the clock with the next point's time; per record write, one latency.
Measured (BENCHMARKS.md, ``benchmarks.batch_cost``): about half a microsecond per batch and one or two per commit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from torch_batch_process.observe.histogram import add_seconds, to_json

__all__ = ["FIRST_INTERVAL_S", "POINTS_PER_LEVEL", "RankActivity", "Timeline", "TIMELINE_GROUP"]

TIMELINE_GROUP = "timeline"
"""The ``metrics.jsonl`` group of timeline points."""

FIRST_INTERVAL_S = 1.0
"""Seconds between the job's first points."""

POINTS_PER_LEVEL = 120
"""The interval between points doubles after every this many points of the job."""

def _short(seconds: float) -> float:
    """Seconds to 4 significant digits (a rate read from them is as exact as anyone reads it), a third of the
    bytes of a full float."""
    return float(f"{seconds:.4g}")


class RankActivity:
    """What every rank of this call did since the previous timeline point, as rank 0 merged it from the votes,
    and rank 0's record writes since then. Rank 0's record keeper updates it under its lock."""

    __slots__ = (
        "batch_times", "batches", "commit_latency", "commit_s", "data_s", "examples", "process_s", "record_write_max_s",
        "record_write_s", "record_writes", "votes",
    )

    def __init__(self, world_size: int) -> None:
        self.batches = [0] * world_size
        self.examples = [0] * world_size
        self.data_s = [0.0] * world_size
        self.process_s = [0.0] * world_size
        self.commit_s = [0.0] * world_size
        self.votes = [0] * world_size
        self.batch_times: list[dict[int, int]] = [{} for _ in range(world_size)]
        self.record_writes = 0
        self.record_write_s = 0.0
        self.record_write_max_s = 0.0
        self.commit_latency: dict[int, int] = {}

    def add_vote(
        self, rank: int, batches: int, examples: int, timings: Mapping[str, float], batch_times: Mapping[int, int] | None
    ) -> None:
        """One vote of ``rank``: its batches, examples, seconds per phase (``data``, ``process``, ``commit``: a
        vote's timings always hold them) and batch-time histogram. Runs at every commit: no call it can avoid."""
        self.batches[rank] += batches
        self.examples[rank] += examples
        self.data_s[rank] += timings["data"]
        self.process_s[rank] += timings["process"]
        self.commit_s[rank] += timings["commit"]
        self.votes[rank] += 1
        if batch_times:
            mine = self.batch_times[rank]
            for key, count in batch_times.items():
                mine[key] = mine.get(key, 0) + count

    def add_record_write(self, seconds: float, latency: float) -> None:
        """One record write (a group commit) that took ``seconds`` and made its oldest commit durable ``latency``
        seconds after that commit's votes were merged (the longest wait of the commits it wrote)."""
        self.record_writes += 1
        self.record_write_s += seconds
        self.record_write_max_s = max(self.record_write_max_s, seconds)
        add_seconds(self.commit_latency, latency)

    def to_json(self) -> dict[str, Any]:
        """The point's per-rank and record-write fields."""
        return {
            "ranks": {
                "batches": self.batches,
                "examples": self.examples,
                "data_s": [_short(value) for value in self.data_s],
                "process_s": [_short(value) for value in self.process_s],
                "commit_s": [_short(value) for value in self.commit_s],
                "votes": self.votes,
                "batch_times": [to_json(histogram) for histogram in self.batch_times],
            },
            "record_writes": self.record_writes,
            "record_write_s": _short(self.record_write_s),
            "record_write_max_s": _short(self.record_write_max_s),
            "commit_latency": to_json(self.commit_latency),
        }


class Timeline:
    """When rank 0 writes timeline points, and what they say (see the module docstring).

    Args:
        points_before: points the job wrote in earlier calls (from the latest commit record's ``stats``).
        first_interval_s: seconds between the job's first points.
        per_level: the interval doubles after every this many points.
    """

    def __init__(
        self, points_before: int = 0, *, first_interval_s: float = FIRST_INTERVAL_S, per_level: int = POINTS_PER_LEVEL
    ) -> None:
        self.points = points_before
        self._first = first_interval_s
        self._per_level = per_level
        self.records = 0
        """Commit records prepared since the latest point (the observer counts them)."""
        self.next_at = time.monotonic() + self.interval_s()
        """``time.monotonic()`` from which the next point is due."""

    def interval_s(self) -> float:
        """Seconds from the latest point to the next one."""
        return self._first * 2.0 ** (self.points // self._per_level)

    def due(self, last: bool) -> bool:
        """Whether the record being prepared carries a point (``last``: the call's last record always does)."""
        return last or time.monotonic() >= self.next_at

    def point(
        self,
        activity: RankActivity,
        *,
        attempt_started: float,
        elapsed_s: float,
        batches_committed: int,
        examples_committed: int,
        failed_examples: int,
        preempted: bool,
        finished: bool,
        last: bool,
    ) -> dict[str, Any]:
        """The ``metrics.jsonl`` record of a point over ``activity`` (what happened since the previous point)."""
        point = {
            "point": self.points,
            "attempt_started": round(attempt_started, 3),
            "elapsed_s": round(elapsed_s, 3),
            "world_size": len(activity.batches),
            "batches_committed": batches_committed,
            "examples_committed": examples_committed,
            "failed_examples": failed_examples,
            "commits": self.records,
            "last": last,
            "preempted": preempted,
            "finished": finished,
            **activity.to_json(),
        }
        self.points += 1
        self.records = 0
        self.next_at = time.monotonic() + self.interval_s()
        return {
            "group": TIMELINE_GROUP,
            "steps_completed": batches_committed,
            "rank": 0,
            "time": round(time.time(), 3),
            "metrics": point,
        }

    def count_record(self) -> None:
        """A commit record was prepared (counted in the next point's ``commits``)."""
        self.records += 1
