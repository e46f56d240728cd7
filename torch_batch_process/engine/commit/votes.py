"""Votes: the :class:`Vote` that carries what one rank did since its previous commit (its
:class:`~torch_batch_process.engine.work.Part`) to rank 0, and what every rank learns of a commit
(:class:`CommitFlags`, :class:`Arrival`). Votes travel in one of two ways
(:class:`~torch_batch_process.engine.commit.transport.VoteTransport`):

- gathered (``schedule="static"``, :mod:`~torch_batch_process.engine.commit.gathered`): every rank votes at the
  same step, the votes go to rank 0 with one collective, what every rank needs back travels in the commit's
  :class:`CommitFlags`, and rank 0 writes the records on a thread of its own;
- queued (``schedule="dynamic"``, :mod:`~torch_batch_process.engine.commit.queued`): each rank votes on its own
  into a queue in the rendezvous store, and rank 0's collector thread turns the votes into records.

What the commit's participants add (record rows, memory limits, failing examples...: DESIGN §20,
:mod:`~torch_batch_process.engine.commit.participants`) travels in the votes as typed payloads (:attr:`Vote.payloads`);
what rank 0 merged of them and every rank must learn (memory limits) each transport shares back in its own way.

The closing commit is the same for both: every rank's vote is gathered at once
(:meth:`~torch_batch_process.engine.commit.committer.Committer.close`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch_batch_process.engine.commit.payloads import Payloads
from torch_batch_process.engine.rank_failure import FailureInfo
from torch_batch_process.engine.work import PhaseSeconds
from torch_batch_process.metrics_lines import MetricsLine

__all__ = ["Arrival", "CommitFlags", "Vote"]


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
    lines: list[MetricsLine]
    """``report_metrics()`` records and provenance entries."""
    timings: PhaseSeconds
    failure: FailureInfo | None = None
    preempt: bool = False
    durable: int = -1
    """Gathered votes, rank 0: every record up to this number is durable (stages up to it may be published)."""
    queued: int = 0
    """Queued votes, closing vote: how many votes this rank queued before it (rank 0 takes them all first)."""
    outputs: bool = False
    """Its stage holds output files (``outputs/commit_<stage>/`` once published; see ``CommitRecord.output_stages``)."""
    payloads: Payloads = field(default_factory=Payloads)
    """What the call's participants add (:mod:`~torch_batch_process.engine.commit.participants`), one typed object
    each."""


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
    shared: int = 0
    """Rank 0 holds what its participants share (memory limits, ``on_oom="split"``) that the other ranks have not
    been sent: every rank then takes it in one ``broadcast`` at this step boundary (changes are rare: a handful per
    job)."""


@dataclass
class Arrival:
    """A regular commit as this rank receives it, once its votes arrived."""

    votes: list[Vote]
    """Gathered: rank 0 gets every rank's vote, the others their own; queued: this rank's own."""
    flags: CommitFlags
