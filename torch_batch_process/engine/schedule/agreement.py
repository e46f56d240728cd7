"""Agreement (static schedule): all ranks take the same decision at the same step boundary.

Ranks never leave the loop on their own. A rank whose hook raised, or that received SIGTERM, keeps
stepping (idle) and raises a flag; the flags of all ranks are combined at agreed step boundaries so that
every rank decides, at the same boundary, to continue, to commit and stop (preemption), or to fail.
Because every rank then runs the same collectives in the same order, nothing hangs, and every rank
exits promptly with an error when one rank fails, even when no torchrun agent is there to kill the
others.

**On a time cadence, not every step.** An agreement is an asynchronous MAX of three integers over the ranks (the
stop and failure flags, and how many steps each rank proposes until the next agreement), started at an agreed
boundary ``a`` and read at the next boundary, ``a + 1``, so its latency overlaps with a step of work. Every rank
proposes enough steps to make the next agreement come at least :func:`agreement_period_s` later (default
:data:`AGREEMENT_S`, 50 ms, from the steps' durations it measured) and the ranks take the smallest proposal, so
the next agreement's step is the same on every rank, and a rank never waits in it for longer than a step. With
steps shorter than the period, the collective (about 0.35 ms of CPU per rank with gloo, a lockstep point on top)
no longer runs every step; with steps longer than the period, it runs every step, as it always did. A commit is
an agreement too (its votes carry the flags, where the decision is immediate): the in-flight agreement is read
there and the next one counts from it.

So a signal or failure during a step reaches every rank within one agreement period plus one step: it joins
the next agreement (at most one period away) and is read one step later.
"""

from __future__ import annotations

import enum
import math
import time

from torch_batch_process import settings
from torch_batch_process.engine.distributed import Collectives, PendingMax

__all__ = ["AGREEMENT_ENV", "AGREEMENT_S", "Decision", "StepAgreement", "agreement_period_s"]

AGREEMENT_S = settings.DEFAULT_AGREEMENT_S
"""Seconds the static schedule aims at between two agreements of the ranks (default of ``TBP_AGREEMENT_S``)."""

AGREEMENT_ENV = settings.AGREEMENT_ENV

MAX_GAP = 1 << 12
"""The most steps between two agreements, whatever the steps' durations (a bound on the stop latency in steps)."""


def agreement_period_s() -> float:
    """Seconds between two agreements of the static schedule: ``$TBP_AGREEMENT_S``, default :data:`AGREEMENT_S`.

    ``0`` agrees at every step boundary (the lowest stop latency; a collective per step). Raises
    :class:`~torch_batch_process.errors.InvalidArgumentError` for a value that is not a number of seconds >= 0
    (checked with the other settings when the call starts, before any work)."""
    return float(settings.current().agreement_s)


class Decision(enum.Enum):
    """What every rank does after a step (the loop acts on it)."""

    CONTINUE = "continue"
    COMMIT = "commit"
    """Commit this rank's part, then continue."""
    STOP = "stop"
    """A rank asked to stop (SIGTERM/SIGINT): the closing commit, then return ``preempted=True``."""
    FAIL = "fail"
    """A rank failed: the closing exchange, where every rank raises."""
    DONE = "done"
    """No batch left for this rank: the closing commit."""


class StepAgreement:
    """Combines the preempt/failure flags of all ranks on a time cadence, each agreement overlapped with a step.

    Args:
        collectives: the library's collectives.
        period_s: seconds aimed at between two agreements (``None``: :func:`agreement_period_s`).
    """

    PREEMPT, FAIL, GAP = 0, 1, 2

    def __init__(self, collectives: Collectives, period_s: float | None = None) -> None:
        self._collectives = collectives
        self._period = agreement_period_s() if period_s is None else period_s
        self._pending: PendingMax | None = None
        self._started = -1  # the step whose boundary started the agreement in flight
        self._next = 0  # the step whose boundary starts the next agreement (the same on every rank)
        self._gap = 1  # steps between two agreements, as last agreed (the same on every rank)
        self._since = time.monotonic()  # when this rank's last agreement started (its steps' durations)
        self._since_step = -1
        self.agreements = 0
        """Agreements started so far (their collectives)."""

    def boundary(self, step: int, preempt: bool, failed: bool) -> Decision:
        """Called by every rank at every non-commit step boundary; returns the common decision."""
        if self._collectives.world_size == 1:
            return Decision.FAIL if failed else Decision.STOP if preempt else Decision.CONTINUE
        if self._pending is not None and step > self._started:
            agreed = self._settle()
            if agreed is not None:
                return agreed
        if step >= self._next and self._pending is None:
            self._start(step, preempt, failed)
        return Decision.CONTINUE

    def at_commit(self, step: int, preempt: bool) -> Decision:
        """Called by every rank at a commit step's boundary instead of :meth:`boundary`: completes the agreement
        in flight and returns STOP or FAIL when it carried a rank's request, else COMMIT (the commit's votes
        then carry fresh flags, see :class:`~torch_batch_process.engine.commit.votes.Vote`); the next agreement
        counts from this step. A single process stops at once on its own request."""
        if self._collectives.world_size == 1:
            return Decision.STOP if preempt else Decision.COMMIT
        agreed = self._settle()
        self._next = step + self._gap
        return Decision.COMMIT if agreed is None else agreed

    def drain(self) -> None:
        """Completes the agreement in flight (when the steps end)."""
        self._settle()

    def _start(self, step: int, preempt: bool, failed: bool) -> None:
        """Starts an agreement at ``step``'s boundary with this rank's flags and its proposal for the next one."""
        now = time.monotonic()
        per_step = (now - self._since) / max(1, step - self._since_step)
        proposal = 1 if self._period <= 0 else min(MAX_GAP, max(1, math.ceil(self._period / max(per_step, 1e-6))))
        self._since, self._since_step = now, step
        self._pending = self._collectives.start_max([int(preempt), int(failed), MAX_GAP - proposal])
        self._started = step
        self.agreements += 1

    def _settle(self) -> Decision | None:
        """Completes the agreement in flight, if any: FAIL or STOP when it carried a rank's request, else ``None``;
        the next agreement comes the agreed number of steps after the one that completed."""
        if self._pending is None:
            return None
        flags = self._pending.wait()
        self._pending = None
        self._gap = MAX_GAP - flags[self.GAP]  # the smallest proposal: every rank takes the same
        self._next = self._started + self._gap
        if flags[self.FAIL]:
            return Decision.FAIL
        if flags[self.PREEMPT]:
            return Decision.STOP
        return None
