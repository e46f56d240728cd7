"""Agreement (static schedule): all ranks take the same decision at the same step boundary.

Ranks never leave the loop on their own. A rank whose hook raised, or that received SIGTERM, keeps
stepping (idle) and raises a flag; the flags of all ranks are combined at step boundaries so that
every rank decides, at the same boundary, to continue, to commit and stop (preemption), or to fail.
Because every rank then runs the same collectives in the same order, nothing hangs, and every rank
exits promptly with an error when one rank fails, even when no torchrun agent is there to kill the
others.

The per-step agreement is an asynchronous MAX all_reduce of two integers started at the end of step
``s`` and read at the end of step ``s + 1``, so its latency overlaps with a whole step of work: a
signal or failure during step ``s`` stops every rank after step ``s + 1`` at the latest. Commits
carry the same flags in their votes, where the decision is immediate.
"""

from __future__ import annotations

import enum
import logging
import traceback
from dataclasses import dataclass

from torch_batch_process.engine.distributed import Collectives, PendingMax
from torch_batch_process.errors import LoaderWorkerDiedError, WorkerFailedError

logger = logging.getLogger(__name__)


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


@dataclass
class FailureInfo:
    """A picklable summary of an exception raised on one rank."""

    rank: int
    where: str
    type_name: str
    message: str
    traceback: str

    def describe(self) -> str:
        return f"rank {self.rank} failed in {self.where}: {self.type_name}: {self.message}"


class FailureTracker:
    """Remembers the first exception this rank raised, to report it to the others and re-raise it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.exception: BaseException | None = None
        self.info: FailureInfo | None = None

    @property
    def failed(self) -> bool:
        return self.exception is not None

    def record(self, exc: BaseException, where: str) -> None:
        died = LoaderWorkerDiedError.wrap(exc)  # may surface anywhere: it is the loader's, not that place's
        if died is not None:
            exc, where = died, "the DataLoader's workers"
        if self.exception is None:
            first = str(exc).strip().splitlines()
            logger.error(  # names the batch, which the exception re-raised at the end (the user's own) may not say
                "rank %d: %s raised %s: %s; the job stops (the last commit stays: fix it and run the job again to "
                "resume)", self.rank, where, type(exc).__name__, first[0][:300] if first else "",
            )
            self.exception = exc
            self.info = FailureInfo(
                rank=self.rank,
                where=where,
                type_name=type(exc).__name__,
                message=str(exc),
                traceback="".join(traceback.format_exception(exc)),
            )

    def raise_for(self, infos: list[FailureInfo | None]) -> None:
        """Raises this rank's own exception if it failed, else a :class:`WorkerFailedError`."""
        if self.exception is not None:
            raise self.exception
        failures = [info for info in infos if info is not None]
        if failures:
            first = failures[0]
            others = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
            raise WorkerFailedError(
                f"{first.describe()}{others}; this rank stops too. The last commit is intact: fix the error "
                f"and run the job again to resume.\n--- traceback of rank {first.rank} ---\n{first.traceback}"
            )


class StepAgreement:
    """Combines the preempt/failure flags of all ranks once per step, overlapped with the next step."""

    PREEMPT, FAIL = 0, 1

    def __init__(self, collectives: Collectives) -> None:
        self._collectives = collectives
        self._pending: PendingMax | None = None

    def boundary(self, preempt: bool, failed: bool) -> Decision:
        """Called by every rank at every non-commit step boundary; returns the common decision."""
        if self._collectives.world_size == 1:
            return Decision.FAIL if failed else Decision.STOP if preempt else Decision.CONTINUE
        agreed = self._settle()
        if agreed is not None:
            return agreed
        self._pending = self._collectives.start_max([int(preempt), int(failed)])
        return Decision.CONTINUE

    def at_commit(self, preempt: bool) -> Decision:
        """Called by every rank at a commit step's boundary instead of :meth:`boundary`: completes the agreement
        in flight and returns STOP or FAIL when it carried a rank's request, else COMMIT (the commit's votes
        then carry fresh flags, see :class:`~torch_batch_process.engine.votes.Vote`). A single process stops at
        once on its own request."""
        if self._collectives.world_size == 1:
            return Decision.STOP if preempt else Decision.COMMIT
        agreed = self._settle()
        return Decision.COMMIT if agreed is None else agreed

    def drain(self) -> None:
        """Completes the agreement in flight (when the steps end)."""
        self._settle()

    def _settle(self) -> Decision | None:
        """Completes the agreement in flight, if any: FAIL or STOP when it carried a rank's request, else ``None``."""
        flags = self._pending.wait() if self._pending is not None else [0, 0]
        self._pending = None
        if flags[self.FAIL]:
            return Decision.FAIL
        if flags[self.PREEMPT]:
            return Decision.STOP
        return None
