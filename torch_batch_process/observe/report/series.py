"""The numbers behind the report's plots, computed from the timeline points (no plotting here).

A timeline point holds what happened since the previous point of its attempt (see
:mod:`~torch_batch_process.observe.timeline`); :func:`intervals` turns the points into :class:`Interval` objects
that know when they started, :func:`decimate` merges neighbours (of one attempt) so that no plot gets more than a
few hundred points whatever the job's length, and the other functions derive rates, per-rank totals, stragglers
and attempts from them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from torch_batch_process.observe.histogram import from_json, merge_into, merged, quantile

__all__ = [
    "MAX_INTERVALS",
    "Attempt",
    "Interval",
    "RankTotals",
    "all_batch_times",
    "attempts",
    "decimate",
    "intervals",
    "rank_totals",
    "slowest_ratio",
    "stragglers",
]

MAX_INTERVALS = 600
"""Plots over time show at most about this many intervals (neighbours are merged beyond)."""


@dataclass
class Interval:
    """What the job did between two timeline points of one attempt (or several merged neighbours)."""

    start: float
    """Wall time of the previous point of the attempt, or the attempt's start."""
    end: float
    attempt: int
    world_size: int
    batches_committed: int
    examples_committed: int
    failed_examples: int
    batches: list[int]
    examples: list[int]
    data_s: list[float]
    process_s: list[float]
    commit_s: list[float]
    votes: list[int]
    batch_times: list[dict[int, int]]
    commits: int = 0
    record_writes: int = 0
    record_write_s: float = 0.0
    record_write_max_s: float = 0.0
    commit_latency: dict[int, int] = field(default_factory=dict)
    last: bool = False
    preempted: bool = False
    finished: bool = False

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def examples_total(self) -> int:
        return sum(self.examples)

    def rate(self) -> float | None:
        """Examples committed per second of wall time over the interval."""
        return self.examples_total / self.seconds if self.seconds > 0 else None

    def busy_rate(self, rank: int) -> float | None:
        """Rank ``rank``'s examples per second of its own work (loading and ``process_batch``)."""
        if rank >= len(self.examples) or not self.batches[rank]:
            return None
        busy = self.data_s[rank] + self.process_s[rank]
        return self.examples[rank] / busy if busy > 0 else None

    def commit_s_per_vote(self) -> float | None:
        """Mean seconds a rank spent in one of its commits."""
        votes = sum(self.votes)
        return sum(self.commit_s) / votes if votes else None

    def absorb(self, other: Interval) -> None:
        """Merges the next interval of the same attempt into this one."""
        self.end = other.end
        self.batches_committed, self.examples_committed = other.batches_committed, other.examples_committed
        self.failed_examples = other.failed_examples
        for mine, theirs in (
            (self.batches, other.batches), (self.examples, other.examples), (self.data_s, other.data_s),
            (self.process_s, other.process_s), (self.commit_s, other.commit_s), (self.votes, other.votes),
        ):
            for rank, value in enumerate(theirs[: len(mine)]):
                mine[rank] += value
        for rank, histogram in enumerate(other.batch_times[: len(self.batch_times)]):
            merge_into(self.batch_times[rank], histogram)
        self.commits += other.commits
        self.record_writes += other.record_writes
        self.record_write_s += other.record_write_s
        self.record_write_max_s = max(self.record_write_max_s, other.record_write_max_s)
        merge_into(self.commit_latency, other.commit_latency)
        self.last, self.preempted, self.finished = other.last, other.preempted, other.finished


def intervals(points: list[dict[str, Any]]) -> list[Interval]:
    """The intervals of the timeline points (``metrics.jsonl`` records), in time order; unreadable points are
    skipped."""
    result: list[Interval] = []
    previous: dict[int, float] = {}
    for record in sorted(points, key=lambda r: (float(r.get("time", 0.0)), int(r.get("commit", 0)))):
        try:
            result.append(_interval(record, previous))
        except (KeyError, TypeError, ValueError):
            continue
    return result


def _interval(record: dict[str, Any], previous: dict[int, float]) -> Interval:
    point = record["metrics"]
    attempt = int(record.get("attempt", 0))
    end = float(record["time"])
    start = previous.get(attempt, float(point.get("attempt_started", end)))
    previous[attempt] = end
    ranks = point.get("ranks") or {}
    world = int(point.get("world_size", len(ranks.get("batches", []))))

    def column(name: str, kind: type) -> list[Any]:
        values = list(ranks.get(name) or [])[:world]
        return [kind(value) for value in values] + [kind(0)] * (world - len(values))

    histograms = [from_json(value) for value in (ranks.get("batch_times") or [])[:world]]
    return Interval(
        start=min(start, end),
        end=end,
        attempt=attempt,
        world_size=world,
        batches_committed=int(point.get("batches_committed", 0)),
        examples_committed=int(point.get("examples_committed", 0)),
        failed_examples=int(point.get("failed_examples", 0)),
        batches=column("batches", int),
        examples=column("examples", int),
        data_s=column("data_s", float),
        process_s=column("process_s", float),
        commit_s=column("commit_s", float),
        votes=column("votes", int),
        batch_times=histograms + [{} for _ in range(world - len(histograms))],
        commits=int(point.get("commits", 0)),
        record_writes=int(point.get("record_writes", 0)),
        record_write_s=float(point.get("record_write_s", 0.0)),
        record_write_max_s=float(point.get("record_write_max_s", 0.0)),
        commit_latency=from_json(point.get("commit_latency")),
        last=bool(point.get("last")),
        preempted=bool(point.get("preempted")),
        finished=bool(point.get("finished")),
    )


def decimate(items: list[Interval], limit: int = MAX_INTERVALS) -> list[Interval]:
    """At most about ``limit`` intervals: runs of neighbours of one attempt merged into one (sums of their work,
    the counts of the last)."""
    if len(items) <= limit:
        return items
    group = -(-len(items) // limit)
    result: list[Interval] = []
    run = 0
    for item in items:
        if result and run < group and result[-1].attempt == item.attempt:
            result[-1].absorb(item)
            run += 1
        else:
            result.append(_copy(item))
            run = 1
    return result


def _copy(item: Interval) -> Interval:
    return Interval(
        **{
            **item.__dict__,
            "batches": list(item.batches), "examples": list(item.examples), "data_s": list(item.data_s),
            "process_s": list(item.process_s), "commit_s": list(item.commit_s), "votes": list(item.votes),
            "batch_times": [dict(h) for h in item.batch_times], "commit_latency": dict(item.commit_latency),
        }
    )


@dataclass
class Attempt:
    """One attempt (a call of the job) as its timeline points show it."""

    attempt: int
    started: float
    ended: float
    world_size: int
    batches: int
    examples: int
    end: str
    """``finished``, ``preempted``, ``running`` (the latest attempt of a running job) or ``stopped`` (its last
    point was not its last commit: it crashed, failed or was killed)."""

    @property
    def seconds(self) -> float:
        return max(self.ended - self.started, 0.0)


def attempts(items: list[Interval], running: bool) -> list[Attempt]:
    """The attempts with timeline points, in order."""
    result: dict[int, Attempt] = {}
    for item in items:
        found = result.get(item.attempt)
        if found is None:
            found = result[item.attempt] = Attempt(item.attempt, item.start, item.end, item.world_size, 0, 0, "")
        found.ended = item.end
        found.batches += sum(item.batches)
        found.examples += item.examples_total
        found.end = "finished" if item.finished else "preempted" if item.preempted else "stopped"
    ordered = [result[key] for key in sorted(result)]
    if running and ordered and ordered[-1].end == "stopped":
        ordered[-1].end = "running"
    return ordered


@dataclass
class RankTotals:
    """One rank's work over every timeline point (of every attempt in which it existed)."""

    rank: int
    batches: int = 0
    examples: int = 0
    data_s: float = 0.0
    process_s: float = 0.0
    commit_s: float = 0.0
    votes: int = 0
    batch_times: dict[int, int] = field(default_factory=dict)

    @property
    def busy_rate(self) -> float | None:
        busy = self.data_s + self.process_s
        return self.examples / busy if busy > 0 and self.batches else None

    def batch_quantile(self, q: float) -> float | None:
        return quantile(self.batch_times, q)


def rank_totals(items: list[Interval]) -> list[RankTotals]:
    """Per-rank totals over the intervals (rank ``r`` of every attempt counts as rank ``r``)."""
    totals: list[RankTotals] = []
    for item in items:
        while len(totals) < item.world_size:
            totals.append(RankTotals(len(totals)))
        for rank in range(item.world_size):
            each = totals[rank]
            each.batches += item.batches[rank]
            each.examples += item.examples[rank]
            each.data_s += item.data_s[rank]
            each.process_s += item.process_s[rank]
            each.commit_s += item.commit_s[rank]
            each.votes += item.votes[rank]
            merge_into(each.batch_times, item.batch_times[rank])
    return totals


def stragglers(totals: list[RankTotals], ratio: float) -> dict[int, float]:
    """Ranks whose busy rate is below ``ratio`` times the median of the other ranks: rank -> its rate over that
    median. Needs at least two ranks that worked."""
    rates = {each.rank: each.busy_rate for each in totals if each.busy_rate is not None}
    found: dict[int, float] = {}
    if len(rates) < 2:
        return found
    for rank, rate in rates.items():
        others = [value for other, value in rates.items() if other != rank]
        median = statistics.median(others)
        if median > 0 and rate is not None and rate < ratio * median:
            found[rank] = rate / median
    return found


def slowest_ratio(totals: list[RankTotals]) -> tuple[int, float] | None:
    """The slowest rank and its busy rate over the median of the others (``None`` with fewer than two ranks)."""
    rates = {each.rank: each.busy_rate for each in totals if each.busy_rate is not None}
    if len(rates) < 2:
        return None
    slowest = min(rates, key=lambda rank: rates[rank] or 0.0)
    median = statistics.median(value for rank, value in rates.items() if rank != slowest)
    return (slowest, (rates[slowest] or 0.0) / median) if median else None


def all_batch_times(totals: list[RankTotals]) -> dict[int, int]:
    """The batch-time histogram of every rank together."""
    return merged(each.batch_times for each in totals)
