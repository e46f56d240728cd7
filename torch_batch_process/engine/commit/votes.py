"""Votes: what one rank did since its previous commit (its :class:`Part`), the :class:`Vote` that carries it to
rank 0, and the interface of the two ways votes travel (:class:`VoteTransport`).

- gathered (``schedule="static"``, :mod:`~torch_batch_process.engine.commit.gathered`): every rank votes at the
  same step, the votes go to rank 0 with one collective, what every rank needs back travels in the commit's
  :class:`CommitFlags`, and rank 0 writes the records on a thread of its own;
- queued (``schedule="dynamic"``, :mod:`~torch_batch_process.engine.commit.queued`): each rank votes on its own
  into a queue in the rendezvous store, and rank 0's collector thread turns the votes into records.

What a rank learned about the device's memory (``on_oom="split"``, DESIGN §15) travels in its votes too
(:attr:`Vote.limits`); each transport shares rank 0's merge of them with every rank in its own way.

The closing commit is the same for both: every rank's vote is gathered at once
(:meth:`~torch_batch_process.engine.commit.committer.Committer.close`).
"""

from __future__ import annotations

import abc
import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch_batch_process.engine.commit.rank_failure import FailureInfo
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.observe.histogram import EDGES, FLOOR_BIN

if TYPE_CHECKING:
    from torch_batch_process.engine.commit.publisher import Publisher

__all__ = ["Arrival", "CommitFlags", "Part", "Vote", "VoteTransport"]

_bisect = bisect.bisect_right


class Part:
    """What this rank did since its previous commit: batches, examples, metrics lines, seconds per phase, and the
    histogram of its batches' ``process_batch`` seconds (see :mod:`torch_batch_process.observe.histogram`)."""

    def __init__(self) -> None:
        self.batches = RangeSet()
        self.examples = 0
        self.failed = 0  # examples skipped as failed (on_error="skip"), recorded in the stage
        self.lines: list[dict[str, Any]] = []
        self.timings = {"data": 0.0, "process": 0.0, "commit": 0.0, "hooks": 0.0}
        self.batch_times: defaultdict[int, int] = defaultdict(int)

    def add_batch(self, batch: int, examples: int, seconds: float | None = None) -> None:
        """A batch done; ``seconds``: its ``process_batch`` time, when it ran whole (counted in ``batch_times``)."""
        self.batches.add(batch)
        self.examples += examples
        if seconds is not None:  # histogram.add_seconds inlined (this runs once per batch): one C call
            self.batch_times[_bisect(EDGES, seconds) + FLOOR_BIN] += 1

    @property
    def num_batches(self) -> int:
        return len(self.batches)


@dataclass
class Vote:
    """One rank's contribution to a commit."""

    rank: int
    stage: int
    """The stage its files and state went into (see :mod:`torch_batch_process.jobstore.layout`)."""
    has_files: bool
    """Its stage holds files (outputs or failure records): it is published."""
    batches: list[list[int]]
    """Global batches completed since its previous commit (ranges)."""
    examples: int
    state_file: str | None
    lines: list[dict[str, Any]]
    """``report_metrics()`` records and provenance entries."""
    timings: dict[str, float]
    failure: FailureInfo | None = None
    preempt: bool = False
    slots: list[Any] | None = None
    """Closing votes: the reducers' summaries (rank 0 reduces without reading state files)."""
    durable: int = -1
    """Gathered votes, rank 0: every record up to this number is durable (stages up to it may be published)."""
    queued: int = 0
    """Queued votes, closing vote: how many votes this rank queued before it (rank 0 takes them all first)."""
    extra: dict[str, Any] = field(default_factory=dict)
    outputs: bool = False
    """Its stage holds output files (``outputs/commit_<stage>/`` once published; see ``CommitRecord.output_stages``)."""
    limits: dict[str, Any] | None = None
    """What the rank learned about the device's memory since its previous vote (the JSON form of
    :class:`~torch_batch_process.jobstore.memory_limits.MemoryLimits`, ``on_oom="split"``), or ``None``."""
    schema: Any = None
    """The rank's record schema (:class:`~torch_batch_process.jobstore.schema.RecordSchema`) when it changed since
    the rank's previous vote (``None``: unchanged, or no rows yet): rank 0 commits no stage whose rows do not
    unify with the job's."""


@dataclass
class CommitFlags:
    """What every rank learns of a regular commit (gathered votes: the MAX over the ranks' contributions)."""

    preempt: bool
    """Some rank asked to stop."""
    failed: bool
    """Some rank's vote carries a failure (the failures themselves are then gathered by every rank)."""
    overflow: bool
    """Some rank's vote did not fit the gather's buffer (the votes are then gathered again)."""
    durable: int
    """Rank 0's newest durable record (stages up to it may be published)."""
    batches_committed: int
    """Batches committed as rank 0 knew when it voted (the commit before this one), for progress."""
    examples_committed: int
    limits: int = 0
    """Rank 0 holds memory limits (``on_oom="split"``) that the other ranks have not been sent: every rank then
    takes them in one ``broadcast`` at this step boundary (changes are rare: a handful per job)."""


@dataclass
class Arrival:
    """A regular commit as this rank receives it, once its votes arrived."""

    votes: list[Vote]
    """Gathered: rank 0 gets every rank's vote, the others their own; queued: this rank's own."""
    flags: CommitFlags
    counts: tuple[int, int] | None = None
    """The committed batches and examples rank 0 told (``None``: this rank counts its own votes)."""


class VoteTransport(abc.ABC):
    """How this rank's regular votes reach rank 0, how rank 0 makes them durable, and how the rank learns which
    of its votes are durable (so that it may publish their stages).

    Rank 0's background work (writing records, or collecting votes) fails on its own thread; :meth:`check`
    raises its error on the main thread, so that it travels in the rank's next vote like any other failure.
    """

    every_rank_votes: bool
    """Every rank takes part in each regular vote, a failed one too (its failure travels in it); else a failed rank
    sends no regular vote (the closing exchange makes every rank raise)."""

    @abc.abstractmethod
    def next_stage(self, stage: int) -> int:
        """The stage this rank's next commit fills, after ``stage``."""

    @abc.abstractmethod
    def stamp(self, vote: Vote) -> None:
        """Adds what the transport tells in a vote (rank 0's newest durable record, the votes queued before)."""

    @abc.abstractmethod
    def send(self, vote: Vote, *, limits_news: bool = False) -> bool:
        """Sends a regular vote; returns whether its commit is complete now (its votes are :meth:`arrived`).
        ``limits_news``: rank 0 holds memory limits the other ranks have not seen (gathered votes flag them, see
        :attr:`CommitFlags.limits`)."""

    @property
    @abc.abstractmethod
    def pending(self) -> bool:
        """Whether a regular commit this rank sent waits for its votes (:meth:`arrived` then waits for them)."""

    @abc.abstractmethod
    def arrived(self) -> Arrival | None:
        """The regular commit sent last, once its votes arrived (gathered: waited for), or ``None`` when none is
        pending."""

    def shared_limits(self) -> dict[str, Any] | None:
        """The job's memory limits as rank 0 merged them, when the transport shares them apart from the votes and
        they changed since this rank last read them (queued votes; gathered: ``None``, see
        :attr:`CommitFlags.limits`)."""
        return None

    @abc.abstractmethod
    def durable_votes(self, newest_durable: int, published: Publisher) -> int:
        """How many of this rank's votes durable records cover (their stages may be published); ``newest_durable``
        is rank 0's newest durable record as its last gathered vote said."""

    def record(self, votes: list[Vote]) -> dict[str, Any] | None:
        """Rank 0, after the votes of a regular commit arrived: starts making their record durable; returns the
        metrics computed for it, if any. Raises ``SchemaConflictError`` when their record outputs do not unify with
        the job's (nothing of them is committed)."""
        return None

    @abc.abstractmethod
    def drain(self, votes: list[Vote]) -> None:
        """Rank 0, before the closing record: makes durable every record still owed for regular votes (``votes``:
        the closing votes, which tell how many votes each rank queued)."""

    def written(self, number: int) -> None:  # noqa: B027 - only transports that track records need it
        """Rank 0: record ``number`` was written (the closing one)."""

    @abc.abstractmethod
    def stop_for_failure(self, failed_here: bool) -> None:
        """When a rank failed: ends rank 0's background work without raising its error (``failed_here``: this rank's
        own failure is what it raises)."""

    def newest_durable(self) -> int:
        """Rank 0: the newest record known durable (``-1`` where the transport does not track records)."""
        return -1

    @abc.abstractmethod
    def check(self) -> None:
        """Raises the error of rank 0's background work, if it failed (never waits)."""

    @abc.abstractmethod
    def close(self) -> None:
        """When the call ends: lets background work finish or stops it, logging errors (the next start repairs)."""
