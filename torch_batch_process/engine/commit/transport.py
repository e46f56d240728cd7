"""How votes travel (:class:`VoteTransport`): how a rank's regular votes reach rank 0, how rank 0 makes them durable,
and how each rank learns which of its votes are durable (so that it may publish their stages). Two transports:
gathered (``schedule="static"``, :mod:`~torch_batch_process.engine.commit.gathered`) and queued
(``schedule="dynamic"``, :mod:`~torch_batch_process.engine.commit.queued`); the committer uses either without asking
which.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch_batch_process.engine.commit.call_summary import Summary
from torch_batch_process.engine.commit.keeper import RecordKeeper
from torch_batch_process.engine.commit.payloads import Payloads
from torch_batch_process.engine.commit.votes import Arrival, Vote

if TYPE_CHECKING:
    from torch_batch_process.engine.commit.publisher import Publisher

__all__ = ["VoteTransport"]


class VoteTransport(abc.ABC):
    """How this rank's regular votes reach rank 0, how rank 0 makes them durable, and how the rank learns which
    of its votes are durable (so that it may publish their stages).

    Rank 0's background work (writing records, or collecting votes) fails on its own thread; :meth:`check`
    raises its error on the main thread, so that it travels in the rank's next vote like any other failure.
    """

    every_rank_votes: bool
    """Every rank takes part in each regular vote, a failed one too (its failure travels in it); else a failed rank
    sends no regular vote (the closing exchange makes every rank raise)."""
    keeper: RecordKeeper | None
    """Rank 0's record keeper (``None`` on the other ranks)."""
    first_stage: int
    """The stage this rank's first commit fills."""

    @abc.abstractmethod
    def next_stage(self, stage: int) -> int:
        """The stage this rank's next commit fills, after ``stage``."""

    @abc.abstractmethod
    def stamp(self, vote: Vote) -> None:
        """Adds what the transport tells in a vote (rank 0's newest durable record, the votes queued before)."""

    @abc.abstractmethod
    def send(self, vote: Vote, *, news: bool = False) -> bool:
        """Sends a regular vote; returns whether its commit is complete now (its votes are :meth:`arrived`).
        ``news``: rank 0 holds what its participants share that the other ranks have not seen (gathered votes flag
        it, see :attr:`~torch_batch_process.engine.commit.votes.CommitFlags.shared`)."""

    @property
    @abc.abstractmethod
    def pending(self) -> bool:
        """Whether a regular commit this rank sent waits for its votes (:meth:`arrived` then waits for them)."""

    @abc.abstractmethod
    def arrived(self) -> Arrival | None:
        """The regular commit sent last, once its votes arrived (gathered: waited for), or ``None`` when none is
        pending."""

    def shared(self) -> Payloads | None:
        """What rank 0's participants shared, when the transport shares it apart from the votes and it changed since
        this rank last read it (queued votes; gathered: ``None``, see
        :attr:`~torch_batch_process.engine.commit.votes.CommitFlags.shared`)."""
        return None

    @abc.abstractmethod
    def committed_counts(self, arrival: Arrival) -> tuple[int, int]:
        """The batches and examples committed, as this rank knows them once ``arrival``'s votes were recorded (rank
        0: its keeper's; gathered: what rank 0 told in the flags; queued: this rank's own votes added up)."""

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

    def news(self) -> Payloads | None:
        """Rank 0, after :meth:`record`, when the transport shares at step boundaries (gathered): what the votes it
        merged taught the participants that every rank must learn (``None``: nothing new, or another transport)."""
        return None

    def close_record(
        self, votes: list[Vote], *, final: bool, preempted: bool, settle: Callable[[], None]
    ) -> tuple[dict[str, Any] | None, Summary] | None:
        """Rank 0: every record still owed for regular votes, then the closing record of ``votes`` (written now, after
        ``settle``: this rank's publications); returns its metrics and the call's summary. Other ranks: ``None``."""
        keeper = self.keeper
        if keeper is None:
            return None
        self.drain(votes)
        settle()
        prepared = keeper.prepare(keeper.merge(votes), final=final, preempting=preempted)
        keeper.persist(prepared, closing=True)
        self.written(prepared.record.commit)
        return prepared.metrics, keeper.summary

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
