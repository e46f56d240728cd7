"""Failing examples with ``on_error="skip"`` (DESIGN §11): split a failing batch down to the examples that
fail, record them, go on.

**Bisection.** When loading a batch (its ``__getitem__`` or ``collate_fn``) or its ``process_batch`` raises,
the batch is split in two halves (in the batch's order), and each half is loaded again in the main process
(the dataset's ``__getitems__``/``__getitem__`` and the loader's ``collate_fn``, the same calls the
``DataLoader`` makes) and processed; a half that fails is split again, down to single examples. A single
example that still fails is a *failure*: it is recorded and skipped. A batch of ``B`` examples with one bad
example costs about ``2 * log2(B)`` extra loads and ``process_batch`` calls. A batch that fails only as a
whole (its halves succeed) records nothing.

**What a failed attempt leaves.** Nothing: every attempt (the whole batch, or a part) runs as a transaction.
``upload_path()`` blocks of an attempt are held back until it returns, then kept (success) or deleted
(failure); wrapped reducers are restored to their state before the attempt (a :class:`SimpleReducer` is cut
back to its earlier length, any other reducer gets a ``copy.deepcopy`` of its attributes back: keep reducer
state small); ``report_metrics()`` lines of a failed attempt are dropped. So reducers count only the examples
that succeeded, and the batch's outputs hold each good example once.

**Output names of the parts.** ``process_batch`` of a part receives the batch's own ``batch_idx`` and the
part's examples; ``context.batch_indices`` gives the part's dataset indices. Its ``upload_path()`` files are
stored under a sub-folder ``part_<first dataset index of the part>/`` of the rank's commit folder, e.g.
``outputs/commit_<s>/rank_<r>/part_1234/pred_19.pt``: parts are disjoint, so names never collide even when
files are named by ``batch_idx``. Use a recursive glob (``outputs/**/pred_*.pt``) to read outputs back.

**Failure records** go into the stage of the rank's next commit, so they are committed (and published to
``<storage>/failures/<stage>-rank_<r>.jsonl``) exactly once together with the batch they belong to, across
``kill -9`` and resumes with another world size. One JSON object a line, with the keys ``index`` (dataset
index), ``batch_idx`` (in a retry: the batch the example failed in, in the job; ``retry_batch_idx`` is then the
retry's), ``attempt`` (the job's attempt), ``rank``, ``phase`` (``"load"`` or ``"process"``),
``error_type``, ``message``, ``traceback`` and ``time`` (UNIX seconds). ``tbp failures STORAGE`` lists them.

**Out-of-memory errors** (``on_oom="split"``, the default, independent of ``on_error``): the same transactions
and parts serve :mod:`~torch_batch_process.engine.feed.oom`, which cuts a batch that ran out of memory into parts that
fit; a half that runs out of memory during a bisection goes there too (the ``split`` route of
:meth:`FailingExamples.recover`). Without ``"skip"`` the handler only runs transactions (nothing is recorded: an
error that is not an out-of-memory one fails the job as before).

The pieces: :class:`Transactions` (an attempt's files, reducer updates and metrics lines, kept or undone),
:class:`PartLoader` (loads a part in the main process as the loader would), :class:`FailureLog` (the failures this
rank recorded since its previous vote: the failing-examples participant of the commit, see
:mod:`~torch_batch_process.engine.capabilities.failures_participant`) and :class:`FailingExamples` (bisection).

**max_failures**: when the committed failures plus this rank's new ones exceed the limit, the rank fails with
:class:`~torch_batch_process.errors.TooManyFailuresError` (every rank stops; the last commit stays, so a
re-run with a larger limit resumes); the total over all ranks is checked again at the end (:func:`check_total`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from torch_batch_process.context import CurrentBatch
from torch_batch_process.engine.feed.device_memory import MemberOutOfMemoryError, is_out_of_memory
from torch_batch_process.engine.work import Part
from torch_batch_process.errors import (
    BatchTimeoutError,
    LoaderWorkerDiedError,
    MemberOutOfStepError,
    SchemaConflictError,
    TooManyFailuresError,
    WorkerLostError,
)
from torch_batch_process.observe.visible_text import visible
from torch_batch_process.outputs.stager import OutputStager
from torch_batch_process.reducers import ReducerRegistry, SimpleReducer
from torch_batch_process.sources.base import SourceChangedError
from torch_batch_process.storage.errors import is_out_of_space

__all__ = [
    "ATTEMPT_FAILED", "ATTEMPT_OK", "ATTEMPT_OUT_OF_MEMORY",
    "FailingExamples", "FailureLog", "PartLoader", "SplitRoute", "Transactions", "check_total", "no_span",
    "too_many_message",
]

SLOW_SNAPSHOT_S = 0.005
"""A copy of the reducers' state before an attempt that takes longer than this is worth a warning (once)."""

logger = logging.getLogger(__name__)

FATAL = (
    BatchTimeoutError,
    TooManyFailuresError,
    WorkerLostError,
    SchemaConflictError,
    SourceChangedError,
    LoaderWorkerDiedError,
)
"""Errors that fail the job even with ``on_error="skip"``: they are not an example's fault (a streaming source's
shard that holds fewer rows than counted fails the job as with ``on_error="raise"``; a row that cannot be
decoded, e.g. a JSONL line that is not JSON, is that row's failure; a dead ``DataLoader`` worker is reported by the
loader as a ``RuntimeError``, which :meth:`FailingExamples.recoverable` tells apart)."""


_NAMED = 5
"""A :class:`TooManyFailuresError` raised before a commit names at most this many of the examples."""


def too_many_message(failed: int, limit: int, failures_url: str, uncommitted: Sequence[str] = (), rank: int = 0) -> str:
    """The message of :class:`TooManyFailuresError`: after a commit the failures are in ``failures_url``; raised
    by a rank before its failures are committed (``uncommitted``: descriptions of this rank's examples that failed
    since its last commit), it names them, since nothing lists them yet."""
    advice = "Fix the data or the code, or raise max_failures, and run the job again: it resumes from its last commit."
    if not uncommitted:
        return (
            f"{failed} examples failed, more than max_failures allows ({limit}); the job stops. The failures are "
            f"listed in {failures_url}/ (`tbp failures` shows them). {advice}"
        )
    named = ", ".join(uncommitted[-_NAMED:])
    more = f" and {len(uncommitted) - _NAMED} earlier" if len(uncommitted) > _NAMED else ""
    committed = failed - len(uncommitted)
    earlier = ""
    if committed > 0:
        earlier = f"; {committed} more were committed before (in {failures_url}/: `tbp failures` lists them)"
    return (
        f"{failed} examples failed, more than max_failures allows ({limit}); the job stops before committing them. "
        f"Rank {rank}'s since its last commit: {named}{more}{earlier}. {advice}"
    )


def check_total(failed: int, limit: int | None, failures_url: str) -> None:
    """Raises :class:`TooManyFailuresError` when the job's committed failures exceed ``limit`` (every rank
    calls it with the same counts, after the closing commit)."""
    if limit is not None and failed > limit:
        raise TooManyFailuresError(too_many_message(failed, limit, failures_url))


ATTEMPT_OK, ATTEMPT_OUT_OF_MEMORY, ATTEMPT_FAILED = 0, 1, 2
"""What a member passes to its replica's exchange after an attempt (the largest wins)."""


class Transactions:
    """Runs a rank's attempts (a batch, or a part of one) as transactions: what a failed attempt wrote or reported
    is undone (see the module docstring).

    Args:
        stager: the rank's output stager (an attempt's ``upload_path()`` blocks are held until it returns).
        reducers: the rank's reducers (restored after a failed attempt).
        rank: this rank (for the warning of a slow snapshot).
        agree: ``mesh=``, a replica of several ranks: the members' exchange after each attempt
            (:meth:`~torch_batch_process.engine.feed.replica.ReplicaFeed.agree_attempt`): an attempt is kept only when
            no member ran out of memory in it, so that the members split a batch together (a member that split alone
            would run its parts while its peers wait in the whole batch's collectives). ``None``: no exchange.
    """

    def __init__(
        self, stager: OutputStager, reducers: ReducerRegistry, rank: int, agree: Callable[[int], int] | None = None
    ) -> None:
        self._agree = agree
        self._stager = stager
        self._reducers = reducers
        self._rank = rank
        self._saved: list[Any] = []
        self._lines = 0
        self._warned_slow = False

    def begin(self, part: Part, prefix: str = "") -> None:
        """Before an attempt: hold its files, remember the reducers' state and the metrics lines."""
        if self._reducers.wrapped:
            t0 = time.perf_counter()
            self._saved = _snapshot(self._reducers)
            if time.perf_counter() - t0 > SLOW_SNAPSHOT_S and not self._warned_slow:
                self._warn_slow(time.perf_counter() - t0)
        else:
            self._saved = []
        self._lines = len(part.lines)
        self._stager.hold(prefix)

    def _warn_slow(self, seconds: float) -> None:
        self._warned_slow = True
        custom = [w.label for w in self._reducers.wrapped if not isinstance(w.reducer, SimpleReducer)]
        logger.warning(
            "rank %d: copying the state of reducer(s) %s before each batch took %.1f ms: a batch runs as a "
            "transaction (on_oom='split', the default, and on_error='skip' restore the reducers after a failed "
            "attempt), so keep a reducer's state small (sums and counts, not every value seen), or pass "
            "on_oom='raise' without on_error='skip'",
            self._rank, ", ".join(custom) or "?", seconds * 1000,
        )

    def keep(self, part: Part) -> BaseException | None:
        """The attempt succeeded: its files join the stage. With ``agree``, unless another member of the replica ran
        out of memory in the same attempt: it is then undone as a failed one, and a
        :class:`~torch_batch_process.engine.feed.device_memory.MemberOutOfMemoryError` returned (a
        :class:`~torch_batch_process.errors.MemberOutOfStepError` when the other members never came)."""
        try:
            agreed = self._agree(ATTEMPT_OK) if self._agree is not None else ATTEMPT_OK
        except MemberOutOfStepError as stuck:  # the other members never came: this rank fails with it
            self._discard(part)
            return stuck
        if agreed == ATTEMPT_OUT_OF_MEMORY:
            self._discard(part)
            return MemberOutOfMemoryError(
                "another member of this rank's replica ran out of device memory in this attempt: every member runs "
                "it in parts together"
            )
        self._stager.release(keep=True)
        return None

    def rollback(self, part: Part, error: BaseException) -> BaseException:
        """The attempt failed with ``error``: its files, reducer updates and metrics lines are discarded. Returns
        the attempt's error: ``error``, or with ``agree`` a
        :class:`~torch_batch_process.errors.MemberOutOfStepError` when this rank ran out of memory and the other
        members did not come to the exchange (they wait in a collective of the attempt this rank left: the batch
        cannot be split together). Another error stays the attempt's error (it fails the job either way)."""
        self._discard(part)
        if self._agree is not None:
            out_of_memory = is_out_of_memory(error)
            try:
                self._agree(ATTEMPT_OUT_OF_MEMORY if out_of_memory else ATTEMPT_FAILED)
            except MemberOutOfStepError as stuck:
                return stuck if out_of_memory else error
        return error

    def _discard(self, part: Part) -> None:
        self._stager.release(keep=False)
        if self._saved:
            _restore(self._reducers, self._saved)
        del part.lines[self._lines :]


class PartLoader:
    """Loads the examples of a part in the main process, as the ``DataLoader`` loads a batch (the dataset's
    ``__getitems__`` or ``__getitem__``, then the loader's ``collate_fn``), and puts it where the loader's batches go.

    Args:
        dataset: the user's dataset (a source's rows by global row number).
        collate_fn: the loader's ``collate_fn``.
        place: puts a loaded part where the loader's batches go (the device, with device prefetch).
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any], place: Callable[[Any], Any]) -> None:
        self._dataset = dataset
        self._collate = collate_fn
        self._place = place

    def load(self, piece: list[int]) -> Any:
        """The part of the examples ``piece``, loaded and placed."""
        return self._place(self._collate(self._fetch(piece)))

    def _fetch(self, piece: list[int]) -> Any:
        """The examples of a part, fetched as the ``DataLoader`` fetches a batch (``__getitems__``' result goes to
        the ``collate_fn`` as it is: a streaming source's Parquet rows come as one Arrow table)."""
        getitems = getattr(self._dataset, "__getitems__", None)
        if getitems:
            return getitems(piece)
        return [self._dataset[i] for i in piece]


class FailureLog:
    """The examples this rank recorded as failing (``on_error="skip"``), each in the stage of its next commit.

    Args:
        stager: the rank's output stager (failure records are staged with the stage's files).
        rank: this rank.
        attempt: the job's attempt number.
        failed_before: failures committed by earlier attempts (``max_failures`` counts them).
        limit: ``max_failures`` as a count (``None``: no limit).
        failures_url: where the failures are published (for messages).
        original_batch: a retry's ``(batch_idx, index) -> the batch the example failed in, in the job``: its
            failure records keep the original batch (``batch_idx``), and the retry's (``retry_batch_idx``).
        keyed: a keyed job's fields of a failure record, its key and run (``RowStamp.failure_fields``; DESIGN §21).
    """

    def __init__(
        self,
        stager: OutputStager,
        *,
        rank: int,
        attempt: int,
        failed_before: int,
        limit: int | None,
        failures_url: str,
        original_batch: Callable[[int, int], int] | None,
        keyed: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        self._stager = stager
        self.rank = rank
        self._job_attempt = attempt
        self._failed_before = failed_before
        self._limit = limit
        self.failures_url = failures_url
        self._original_batch = original_batch
        self.failed = 0
        """Failures this rank recorded in this call."""
        self._keyed = keyed  # a keyed job's fields of a failure record (its key and run), DESIGN §21
        self._since_vote = 0
        self._uncommitted: list[str] = []  # descriptions of those since the rank's last commit (for the message)

    def record(self, batch_idx: int, index: int, phase: str, error: BaseException) -> None:
        """Records example ``index`` of batch ``batch_idx`` as failing (in the stage of this rank's next commit).

        Raises:
            TooManyFailuresError: the job's failures now exceed ``max_failures``.
        """
        self.failed += 1
        self._since_vote += 1
        where = {"batch_idx": batch_idx}
        if self._original_batch is not None:
            where = {"batch_idx": self._original_batch(batch_idx, int(index)), "retry_batch_idx": batch_idx}
        self._stager.add_failure(
            {
                "index": int(index),
                **where,
                "attempt": self._job_attempt,
                "rank": self.rank,
                "phase": phase,
                "error_type": type(error).__name__,
                "message": str(error),
                "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__, chain=False)),
                "time": round(time.time(), 3),
                **(self._keyed(int(index)) if self._keyed is not None else {}),
            }
        )
        logger.warning(
            "rank %d: example %d of batch %d failed in %s (%s: %s); skipped, recorded in %s/",
            self.rank, index, batch_idx, phase, type(error).__name__, _first_line(error), self.failures_url,
        )
        first = _first_line(error)[:80]
        self._uncommitted.append(f"example {index} (batch {batch_idx}, {type(error).__name__}: {first})")
        total = self._failed_before + self.failed
        if self._limit is not None and total > self._limit:
            message = too_many_message(total, self._limit, self.failures_url, self._uncommitted, self.rank)
            raise TooManyFailuresError(message) from None  # each example's own error is in the message and the log

    def take(self) -> int:
        """The failures recorded since the previous call, for this rank's vote: they are in the stage it commits (and
        ``tbp failures`` lists them once it is published)."""
        count, self._since_vote = self._since_vote, 0
        self._uncommitted.clear()
        return count


SplitRoute = Callable[[int, list[int], Part, BaseException], int]
"""Runs a part that ran out of memory in smaller parts; returns how many of its examples succeeded
(:meth:`~torch_batch_process.engine.feed.oom.OomSplitter.run_parts`)."""


class FailingExamples:
    """Runs a rank's parts as transactions and bisects those that fail (see the module docstring).

    Args:
        skip: ``on_error="skip"``: failing examples are found and recorded in ``log`` (``False``: transactions only,
            for ``on_oom="split"``).
        loader: loads a part in the main process.
        process: runs ``process_batch(batch, batch_idx)`` under the job's modes.
        current: the context's current batch.
        span: a context manager factory timing one attempt (``batch_timeout``).
        transactions: the rank's transactions.
        log: where the failing examples are recorded.
    """

    def __init__(
        self,
        *,
        skip: bool,
        loader: PartLoader,
        process: Callable[[Any, int], None],
        current: CurrentBatch,
        span: Callable[[int], contextlib.AbstractContextManager[Any]],
        transactions: Transactions,
        log: FailureLog,
    ) -> None:
        self.skip = skip
        self._loader = loader
        self._process = process
        self._current = current
        self._span = span
        self.transactions = transactions
        self._log = log

    @staticmethod
    def recoverable(exc: BaseException) -> bool:
        """Whether ``exc`` is an example's failure (else it fails the job). A full disk or quota is no example's fault:
        recorded as failures, every example processed while the disk stays full would be skipped, and the job could
        finish with them all failed."""
        return (
            isinstance(exc, Exception)
            and not isinstance(exc, FATAL)
            and not LoaderWorkerDiedError.reports(exc)
            and not is_out_of_space(exc)
        )

    # ------------------------------------------------------------------ bisection

    def recover(
        self, batch_idx: int, indices: Sequence[int], error: BaseException, phase: str, part: Part,
        split: SplitRoute | None,
    ) -> int:
        """The examples ``indices`` of batch ``batch_idx`` (the batch, or a part of it) failed together with
        ``error`` (in ``phase``): bisects them and records the examples that fail; returns how many succeeded. A half
        that runs out of memory goes to ``split`` (``on_oom="split"``; ``None``: it is a failure like any other)."""
        indices = list(indices)
        logger.warning(
            "rank %d: batch %d (%d examples) failed in %s (%s: %s); splitting it to find the failing examples",
            self._log.rank, batch_idx, len(indices), phase, type(error).__name__, _first_line(error),
        )
        if len(indices) == 1:
            self.record(batch_idx, indices[0], phase, error)
            return 0
        return self._bisect(batch_idx, indices, part, split)

    def _bisect(self, batch_idx: int, indices: list[int], part: Part, split: SplitRoute | None) -> int:
        succeeded = 0
        half = (len(indices) + 1) // 2
        for piece in (indices[:half], indices[half:]):
            failure = self.attempt(batch_idx, piece, part)
            try:
                if failure is None:
                    succeeded += len(piece)
                elif split is not None and is_out_of_memory(failure[1]):
                    succeeded += split(batch_idx, piece, part, failure[1])
                elif len(piece) == 1:
                    self.record(batch_idx, piece[0], failure[0], failure[1])
                else:
                    succeeded += self._bisect(batch_idx, piece, part, split)
            finally:
                failure = None  # its traceback reaches this frame: a cycle that would keep the part's batch alive
        return succeeded

    def attempt(self, batch_idx: int, piece: list[int], part: Part) -> tuple[str, BaseException] | None:
        """Loads and processes one part (the examples ``piece``, in the main process) as a transaction; returns
        ``(phase, error)`` when it failed (an error that fails the job even with ``on_error="skip"`` is raised)."""
        with self._span(batch_idx):
            try:
                batch = self._loader.load(piece)
            except Exception as exc:  # noqa: BLE001 - the part's failure
                if not self.recoverable(exc):
                    raise
                return "load", exc
            self.transactions.begin(part, prefix=f"part_{piece[0]}/")
            self._current.enter(batch_idx, piece)
            try:
                self._process(batch, batch_idx)
            except BaseException as exc:  # no local holds the error: its traceback holds this frame and the batch
                if not self.recoverable(exc):
                    self.transactions.rollback(part, exc)
                    raise
                return "process", self.transactions.rollback(part, exc)
            finally:
                self._current.leave()
            undone = self.transactions.keep(part)
            return ("process", undone) if undone is not None else None

    def record(self, batch_idx: int, index: int, phase: str, error: BaseException) -> None:
        """Records example ``index`` of batch ``batch_idx`` as failing (see :meth:`FailureLog.record`)."""
        self._log.record(batch_idx, index, phase, error)


_NULL = contextlib.nullcontext()


def no_span(batch_idx: int) -> contextlib.AbstractContextManager[Any]:
    """A span that times nothing (no ``batch_timeout``)."""
    del batch_idx
    return _NULL


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s message for a log line: :func:`visible` (its escapes do not act on the terminal)
    and at most 300 characters (a message holding a whole prompt is in the failure record, not the log)."""
    lines = str(error).strip().splitlines()
    return visible(lines[0] if lines else "", 300)


def _snapshot(reducers: ReducerRegistry) -> list[Any]:
    saved: list[Any] = []
    for wrapped in reducers.wrapped:
        reducer = wrapped.reducer
        if isinstance(reducer, SimpleReducer):
            saved.append((reducer.values, len(reducer.values)))
        else:
            saved.append(copy.deepcopy(reducer.__dict__))
    return saved


def _restore(reducers: ReducerRegistry, saved: list[Any]) -> None:
    for wrapped, state in zip(reducers.wrapped, saved, strict=False):
        reducer = wrapped.reducer
        if isinstance(reducer, SimpleReducer):
            values, length = state
            del values[length:]
            reducer.values = values
        else:
            reducer.__dict__.clear()
            reducer.__dict__.update(state)
