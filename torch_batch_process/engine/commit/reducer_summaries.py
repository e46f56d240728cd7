"""The reducers' summaries as a commit participant: what a rank's reducers hold goes into its state file at each of
its commits and, at a closing commit, into its vote too, so that rank 0 reduces the job's metrics without reading
state files; the summaries of earlier attempts stay slots of the reduction (``frozen_state_files``).

Always a participant (no option turns it off): a job without wrapped reducers has no slots, and its metrics are
empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch_batch_process.engine.commit.participants import Participant, Payload, RecordDraft
from torch_batch_process.engine.commit.votes import Vote
from torch_batch_process.engine.work import Part
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.reducers import ReducerRegistry

__all__ = ["ReducerSlots", "ReducerSummaries"]


@dataclass(frozen=True)
class ReducerSlots(Payload):
    """A closing vote's reducer summaries (``per_slot_reduce()`` of each wrapped reducer of the rank)."""

    key = "slots"
    slots: list[Any]


class ReducerSummaries(Participant):
    """The reducers' summaries of this rank (state files, closing votes) and, on rank 0, their reduction.

    Args:
        reducers: the processor context's reducers.
        store: the job's stored state (rank 0 reads the ranks' state files for metrics "so far").
        latest: the latest record of earlier attempts: their state files stay slots of the reduction.
    """

    def __init__(
        self, reducers: ReducerRegistry, store: JobStore, latest: CommitRecord | None, counts: bool = True
    ) -> None:
        self._reducers = reducers
        self._counts = counts  # mesh=: a replica's other members than its writer store no summaries (counted once)
        self._store = store
        self.frozen: list[str] = latest.slot_files() if latest is not None else []
        """State files of earlier attempts, whose summaries stay slots of the final reduction."""
        self._slots: list[Any] | None = None  # this rank's, taken for its state file, until its vote
        self._closing: dict[int, list[Any]] = {}  # rank 0: the closing votes' summaries, by rank
        self._closed: list[list[Any]] | None = None  # rank 0: those of the record being prepared

    @property
    def wrapped(self) -> bool:
        """Whether the processor wrapped any reducer."""
        return bool(self._reducers.wrapped)

    def signature(self) -> list[dict[str, Any]]:
        """The reducers' names and types, stored with every record (a resume must wrap the same)."""
        return self._reducers.signature()

    # ------------------------------------------------------------------ every rank

    def take_slots(self) -> list[Any]:
        """This rank's summaries for its state file (computed once per vote: a closing vote carries the same)."""
        self._slots = self._reducers.per_slot_states() if self._counts else None
        return self._slots  # type: ignore[return-value]

    def contribute(self, part: Part, closing: bool) -> ReducerSlots | None:
        slots, self._slots = self._slots, None
        return ReducerSlots(slots) if closing and slots is not None else None

    # ------------------------------------------------------------------ rank 0

    def merge(self, vote: Vote) -> None:
        payload = vote.payloads.get(ReducerSlots)
        if payload is not None:
            self._closing[vote.rank] = payload.slots

    def draft(self, draft: RecordDraft) -> None:
        closing, self._closing = self._closing, {}
        self._closed = [closing[rank] for rank in sorted(closing)] if closing else None

    def metrics(
        self,
        state_files: list[str | None],
        *,
        final: bool,
        preempting: bool,
        interim: Callable[[Callable[[], dict[str, Any]]], dict[str, Any] | None],
    ) -> dict[str, Any] | None:
        """Rank 0, after :meth:`draft`: the reduced metrics that go with the record (``None``: none): always for a
        final or preempting one (``{}`` without reducers), else when ``interim`` says that "metrics so far" are due."""
        closed, self._closed = self._closed, None
        if self.wrapped and (final or preempting):
            return self._reduce(state_files, closed)
        if final:
            return {}
        if self.wrapped:
            return interim(lambda: self._reduce(state_files, None))
        return None

    def _reduce(self, state_files: list[str | None], slots: list[list[Any]] | None) -> dict[str, Any]:
        if slots is not None:
            live = slots
        else:
            live = [self._store.load_state(rel)["reducers"] for rel in state_files if rel]
        frozen = [self._store.load_state(rel)["reducers"] for rel in self.frozen]
        # None: a mesh member that is not its replica's writer (its writer's summaries count its batches)
        return self._reducers.cross_slot_reduce([slots for slots in frozen + live if slots is not None])
