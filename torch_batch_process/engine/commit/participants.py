"""Commit participants (DESIGN §20): every capability that stores something with a commit plugs in here.

A capability (record rows and segments, a table target's files, memory limits, failing examples, the batch-time
histograms, the reducers' summaries; tomorrow a generation engine's state) is a :class:`Participant` of the commit.
The committer and rank 0's record keeper iterate the call's participants (:class:`Participants`) at each moment of
the protocol and hold nothing of their own for any capability:

=================  ============  ==================================================================================
moment             where         what a participant does
=================  ============  ==================================================================================
start              every rank    restores itself from the latest record (its constructor: see each capability)
seal               every rank    makes the stage's data durable before the vote (:meth:`Participant.seal`)
vote               every rank    adds its typed :class:`Payload` to the rank's vote (:meth:`Participant.contribute`)
check, merge       rank 0        refuses the votes, or merges its payloads (:meth:`~Participant.check`,
                                 :meth:`~Participant.merge`; under the keeper's lock, on the thread that merges)
record             rank 0        adds its fields to the commit record and the call's summary
                                 (:meth:`Participant.draft`, under the keeper's lock)
before the write   rank 0        waits until what the record commits is durable (one process: rows a seal handed
                                 to a thread of the rank, :meth:`Participant.before_record`)
durable            rank 0        follows a durable record (a table transaction, :meth:`Participant.after_record`)
share, learn       rank 0, all   rank 0's merge of what every rank must know, sent back by the vote transport
                                 (:meth:`Participant.share`, :meth:`Participant.learn`)
=================  ============  ==================================================================================

A vote carries the payloads in :class:`Payloads`, one typed object per participant; the commit record keeps each
participant's fields under the JSON names it always had (``stats.failed_examples``, ``memory_limits``, ``table``...),
so stored jobs stay readable both ways. A participant's rank-0 methods run on rank 0's merging thread (the main
thread with the static schedule, the vote collector's with the dynamic one) under the keeper's lock; its rank
methods on the rank's main thread: state that both sides touch is kept apart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch_batch_process.engine.commit.call_summary import Summary
from torch_batch_process.engine.commit.payloads import Payload, Payloads
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.work import Part
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.observe.timeline import RankActivity

__all__ = ["Durable", "Participant", "Participants", "Payload", "Payloads", "RecordDraft"]


@dataclass
class RecordDraft:
    """A commit record being prepared by rank 0: the keeper sets the protocol's fields, each participant adds its
    own (:meth:`Participant.draft`)."""

    record: CommitRecord
    """The record (its ``stats`` and the participants' fields still to be filled)."""
    summary: Summary
    """The call's counts as this record will say them (participants add theirs: failed examples, memory...)."""
    last: bool
    """The call's last record (final, or the job stops after it)."""
    activity: RankActivity | None = None
    """The ranks' work since the previous timeline point, when a point goes with this record (the timeline's)."""


@dataclass(frozen=True)
class Durable:
    """A record that has just become durable, for what follows it (:meth:`Participant.after_record`)."""

    record: CommitRecord
    closing: bool
    """The closing commit's record (what follows it is never postponed)."""
    write_started: float = field(default_factory=time.monotonic)
    """When its write started (``time.monotonic()``)."""
    prepared_at: float = 0.0
    """When the oldest commit it makes durable was merged (``time.monotonic()``)."""


class Participant:
    """A capability that stores something with each commit (see the module docstring). Every method does nothing by
    default: a participant overrides the moments it takes part in."""

    # ------------------------------------------------------------------ every rank

    def seal(self, closing: bool) -> None:
        """Before this rank's vote: makes what the stage holds for it durable (``closing``: a closing commit)."""

    def contribute(self, part: Part, closing: bool) -> Payload | None:
        """This rank's payload for its vote (``part``: the work the vote commits), or ``None``: nothing this time."""
        return None

    def learn(self, shared: Payloads) -> None:
        """Every rank: what rank 0 shared (the payloads its participants' :meth:`share` gave)."""

    # ------------------------------------------------------------------ rank 0

    def check(self, votes: Sequence[Vote]) -> None:
        """Before any of ``votes`` is merged: raises to refuse them all (then none of their stages is committed)."""

    def merge(self, vote: Vote) -> None:
        """Adds one vote (its payload: ``vote.payloads.get(...)``) to what the next record says."""

    def draft(self, draft: RecordDraft) -> None:
        """Adds this participant's fields to the record being prepared and its counts to the call's summary."""

    def share(self) -> Payload | None:
        """What every rank must learn of the merged votes, when it changed since the previous call (else ``None``)."""
        return None

    def before_record(self, record: CommitRecord) -> None:
        """Rank 0's record writer, just before ``record`` is written (the commit point): waits until what it commits is
        durable where the rank's seal left that to a thread of its own (one process only: with several, every rank's
        seal is durable before its vote). An error fails the job and the record is not written."""

    def after_record(self, durable: Durable) -> None:
        """Once a record is durable (rank 0's record writer): what follows it. An error fails the job (resumable)."""


class Participants(Sequence[Participant]):
    """The participants of a call, in the order they take part (each moment runs them in this order)."""

    def __init__(self, participants: Sequence[Participant]) -> None:
        self._all = tuple(participants)
        # per moment, the participants that take part in it (override it): a commit of a tiny batch is mostly calls,
        # and most participants keep most moments' default, which does nothing
        self._seal = self._taking("seal")
        self._contribute = self._taking("contribute")
        self._learn = self._taking("learn")
        self._check = self._taking("check")
        self._merge = self._taking("merge")
        self._share = self._taking("share")

    def _taking(self, moment: str) -> tuple[Participant, ...]:
        """The participants whose ``moment`` is not the base class's (which does nothing), in order."""
        default = getattr(Participant, moment)
        return tuple(p for p in self._all if getattr(getattr(p, moment), "__func__", None) is not default)

    def __getitem__(self, index: int) -> Participant:  # type: ignore[override]
        return self._all[index]

    def __len__(self) -> int:
        return len(self._all)

    def seal(self, closing: bool) -> None:
        for participant in self._seal:
            participant.seal(closing)

    def contribute(self, part: Part, closing: bool) -> Payloads:
        """The payloads of this rank's vote."""
        return Payloads([p for p in (each.contribute(part, closing) for each in self._contribute) if p is not None])

    def learn(self, shared: Payloads) -> None:
        for participant in self._learn:
            participant.learn(shared)

    def merge(self, votes: Sequence[Vote]) -> None:
        """Checks every vote with every participant, then merges them (none is merged when one is refused)."""
        for participant in self._check:
            participant.check(votes)
        for vote in votes:
            for participant in self._merge:
                participant.merge(vote)

    def draft(self, draft: RecordDraft) -> None:
        for participant in self._all:
            participant.draft(draft)

    def share(self) -> Payloads:
        """What rank 0 shares with every rank now (empty: nothing new)."""
        return Payloads([p for p in (each.share() for each in self._share) if p is not None])

    def before_record(self, record: CommitRecord) -> None:
        for participant in self._all:
            participant.before_record(record)

    def after_record(self, durable: Durable) -> None:
        for participant in self._all:
            participant.after_record(durable)
