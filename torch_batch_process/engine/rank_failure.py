"""A rank's failure and how every rank raises it (DESIGN §3, §7: a failure anywhere travels to every rank with the
next vote).

A rank that fails keeps its first exception (:class:`RankFailure`) and goes on stepping (idle); the exception's
picklable summary (:class:`FailureInfo`) travels in the rank's next vote or agreement, and when the ranks stop
together the failing rank raises its own exception and every other rank a
:class:`~torch_batch_process.errors.WorkerFailedError` with its traceback. (Failing *examples*, with
``on_error="skip"``, are :mod:`~torch_batch_process.engine.feed.failing_examples`'.)
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

from torch_batch_process.errors import LoaderWorkerDiedError, WorkerFailedError
from torch_batch_process.observe.visible_text import visible

__all__ = ["JOB_STOPS", "SENT_CHARS", "FailureInfo", "RankFailure"]

logger = logging.getLogger(__name__)

JOB_STOPS = "the job stops"
"""What the log line of a rank's failure adds, with how to resume, unless the exception says it already (the
library's own that stop the job do: a batch timeout, too many failures): said once, never twice."""

SENT_CHARS = 4000
"""At most this many characters of a failure's message, and of each part of its traceback (a frame, the exception's
line), travel to the other ranks: a message holding a whole prompt or document would otherwise be copied into the
votes and into every other rank's :class:`WorkerFailedError` and log. The failing rank raises its own exception,
whole."""


def _sent(text: str) -> str:
    """``text`` cut to :data:`SENT_CHARS` characters, saying how many were left out."""
    if len(text) <= SENT_CHARS:
        return text
    end = "\n" if text.endswith("\n") else ""
    return f"{text[:SENT_CHARS]}... ({len(text) - SENT_CHARS:,} more characters in the failing rank's own error){end}"


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


class RankFailure:
    """This rank's failure: the first exception it raised (in a hook, a batch, background work), reported to the
    other ranks in its votes and raised again here when every rank stops."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.exception: BaseException | None = None
        self.info: FailureInfo | None = None

    @property
    def failed(self) -> bool:
        return self.info is not None

    def record(self, exc: BaseException, where: str) -> None:
        died = LoaderWorkerDiedError.wrap(exc)  # may surface anywhere: it is the loader's, not that place's
        if died is not None:
            exc, where = died, "the DataLoader's workers"
        if self.exception is None:
            first = str(exc).strip().splitlines()
            said = first[0] if first else ""
            logger.error(  # names the batch, which the exception re-raised at the end (the user's own) may not say
                "rank %d: %s raised %s: %s%s", self.rank, where, type(exc).__name__, visible(said, 300),
                "" if JOB_STOPS in said else f"; {JOB_STOPS} (the last commit stays: fix it and run the job again to "
                "resume)",
            )
            self.exception = exc
            self.info = FailureInfo(
                rank=self.rank,
                where=where,
                type_name=type(exc).__name__,
                message=_sent(str(exc)),
                traceback="".join(_sent(part) for part in traceback.format_exception(exc)),
            )

    def raise_for(self, infos: list[FailureInfo | None]) -> None:
        """Raises this rank's own exception if it failed, else a :class:`WorkerFailedError`.

        The exception is handed over, not kept: its traceback holds this frame and the loop's, which hold this
        object, and a reference from here would make a cycle that keeps the failed batch (on the device too)
        alive until a garbage collection, after the caller has dropped the exception."""
        exc, self.exception = self.exception, None
        if exc is not None:
            try:
                raise exc
            finally:
                del exc
        failures = [info for info in infos if info is not None]
        if failures:
            first = failures[0]
            others = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
            raise WorkerFailedError(
                f"{first.describe()}{others}; this rank stops too. The last commit is intact: fix the error "
                f"and run the job again to resume.\n--- traceback of rank {first.rank} ---\n{first.traceback}"
            )
