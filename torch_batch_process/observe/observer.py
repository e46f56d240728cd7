"""The job's observer: what the loop tells the user while it runs, in few, cheap calls.

The loop calls a :class:`JobObserver` at four points: :meth:`~JobObserver.start` before the first
step, :meth:`~JobObserver.on_step` after a step when ``step >= next_step`` (an int compare per step),
:meth:`~JobObserver.on_record` (rank 0, while it writes a commit record) and
:meth:`~JobObserver.on_commit` once a commit's votes are in (its record may not be durable yet: rank 0
writes it in the background; what is shown as committed is what the votes commit), then
:meth:`~JobObserver.finish` with the
result and :meth:`~JobObserver.close` in any case. Behind it:

- rank 0's progress display (:mod:`~torch_batch_process.observe.progress`): between commits the done count
  is extrapolated from rank 0's own step (``step * world_size`` batches), at commits it is exact;
- straggler warnings (:mod:`~torch_batch_process.observe.stragglers`) from the commit votes;
- TensorBoard event files (:mod:`~torch_batch_process.observe.tensorboard_feed`);
- ``torch.profiler`` over a few steps (:mod:`~torch_batch_process.observe.profiler`);
- the throughput, progress and "reduced metrics so far" stored in commit records and in
  ``metrics.jsonl`` (read by ``tbp status``).
- the job config's ``hyperparameters`` (``tbp run``: ``$TBP_HPARAMS``, what ``context.get_hparams()``
  returns), once per attempt on rank 0: one ``metrics.jsonl`` record (group ``hparams``, with the
  first commit record of the attempt) and TensorBoard's Text and HParams tabs.
- the call's arguments and plan (group ``job``, once per attempt, with its first commit record; see
  :meth:`JobObserver.describe_job`) and the job's timeline (group ``timeline``, see
  :mod:`~torch_batch_process.observe.timeline`), read by ``tbp report`` and ``tbp dashboard``.

Overhead: no collective and no I/O per step; a step costs one integer comparison in the loop, and
rank 0 reads the clock only every few steps (sized from the step rate to hit the display's refresh
time). Everything else happens at commits, throttled in time.

Reduced metrics so far: the reducers' ``cross_slot_reduce`` runs on rank 0 at a commit when
``TBP_METRICS_INTERVAL`` seconds (default 60) have passed since the last time, and at least 100 times
its own last duration (so it never takes more than ~1% of the job, even for function reducers, which
keep every value). The result is stored in the commit record (``stats.metrics``) and
``metrics.jsonl`` (group ``reduced``), and plotted as ``reduced/<name>``. A failure there only logs a
warning and turns interim metrics off; the final metrics are computed as always.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from torch_batch_process.observe.hparams import read_hparams
from torch_batch_process.observe.options import ObserveOptions
from torch_batch_process.observe.profiler import StepProfiler
from torch_batch_process.observe.progress import BarDisplay, LogDisplay, ProgressDisplay, pick_mode
from torch_batch_process.observe.stragglers import RankInterval, StragglerDetector
from torch_batch_process.observe.summary import summary_line
from torch_batch_process.observe.tensorboard_feed import TensorBoardFeed
from torch_batch_process.observe.timeline import RankActivity, Timeline
from torch_batch_process.observe.token_rates import TokenRates
from torch_batch_process.result import BatchProcessResult, to_jsonable
from torch_batch_process.shell_commands import job_commands
from torch_batch_process.storage.base import MirroredFolder

logger = logging.getLogger(__name__)

METRICS_BUDGET = 100.0
"""Interim reduced metrics wait at least this many times their own last duration."""

NEVER = 1 << 62
"""``next_step`` when nothing watches steps."""

MAX_STEP_GAP = 100
"""The display checks the clock at least every this many steps (bounds the delay if steps slow down)."""


class JobObserver:
    """Progress, stragglers, TensorBoard, profiler and throughput records of one job run on one rank.

    Args:
        options: the resolved options.
        rank: this rank.
        world_size: ranks of this attempt.
        job_name: shown on the bar.
        batch_size: examples per global batch (for the extrapolation between commits).
        tensorboard: this rank's TensorBoard folder (a local folder mirrored to the storage).
        device: this rank's device (for the profiler's activities).
    """

    def __init__(
        self,
        options: ObserveOptions,
        *,
        rank: int,
        world_size: int,
        job_name: str,
        batch_size: int,
        tensorboard: MirroredFolder,
        device: torch.device,
    ) -> None:
        self.options = options
        self.rank = rank
        self.world_size = world_size
        self.job_name = job_name
        self.batch_size = batch_size
        self.total_batches = 0
        self.total_examples = 0
        self._tb_dir = tensorboard.path
        self._device = device
        self._display: ProgressDisplay | None = None
        self._profiler: StepProfiler | None = None
        self._tb: TensorBoardFeed | None = None
        self._uploader: MirroredFolder | None = tensorboard
        self._stragglers = StragglerDetector(options.straggler_ratio)
        self.generation = TokenRates()
        """A generation job's committed prompts and tokens (rank 0; its participant adds them), shown with the
        progress."""
        self.next_step = NEVER
        """The loop calls :meth:`on_step` after a step ``>= next_step`` (the display or profiler is due)."""
        self._last_check = 0.0
        self._last_check_step = -1
        # Progress of this attempt (set by start()).
        self._started = time.monotonic()
        self._started_wall = time.time()
        self._base_batches = 0
        self._base_examples = 0
        self._remaining_batches = 0
        self._remaining_examples = 0
        self._committed_batches = 0
        self._committed_examples = 0
        self._next_show = 0.0
        self._clock_started = False
        # Rank 0's records: metrics so far, progress lines.
        self._metrics: dict[str, Any] | None = None
        self._metrics_batches: int | None = None
        self._metrics_time: float | None = None
        self._metrics_next = time.monotonic() + options.metrics_interval
        self._metrics_off = options.metrics_interval == 0
        self._next_progress_record = time.monotonic() + options.progress_interval
        self._hparams: dict[str, Any] | None = None  # rank 0: logged with the attempt's first record
        self._job: dict[str, Any] | None = None  # rank 0: the call's arguments, logged with the attempt's first record
        self._timeline = Timeline()  # rank 0: when timeline points are due (reset by start())

    # ------------------------------------------------------------------------ start

    def start(
        self,
        *,
        total_batches: int,
        total_examples: int,
        committed_batches: int,
        committed_examples: int,
        remaining_batches: int,
        previous_stats: dict[str, Any] | None = None,
    ) -> None:
        """Before the first step: opens the display, the event file and the profiler.

        Args:
            total_batches: planned global batches of the whole job.
            total_examples: examples in them.
            committed_batches: batches committed before this attempt.
            committed_examples: examples in them.
            remaining_batches: batches this attempt processes.
            previous_stats: ``stats`` of the latest commit record (rank 0, on a resume), for the
                reduced metrics so far.
        """
        previous = previous_stats or {}
        self._metrics = previous.get("metrics")
        self._metrics_batches = previous.get("metrics_batches_committed")
        self._metrics_time = previous.get("metrics_time")
        self.total_batches = total_batches
        self.total_examples = total_examples
        self._started = time.monotonic()
        self._started_wall = time.time()
        self._base_batches = self._committed_batches = committed_batches
        self._base_examples = self._committed_examples = committed_examples
        self._remaining_batches = remaining_batches
        self._remaining_examples = max(0, self.total_examples - committed_examples)
        self._clock_started = False
        if self.rank == 0:
            self._hparams = read_hparams()
            self._timeline = Timeline(int(previous.get("timeline_points") or 0))
        if self.options.tensorboard:
            self._tb = TensorBoardFeed(self._tb_dir, self.rank, self._progress_scalars if self.rank == 0 else None)
            if self._hparams:
                self._tb.hparams(self._hparams, committed_batches)
        profile = self.options.profile
        if self.rank == 0 and profile is not None and profile.ranks is not None:
            missing = sorted(r for r in profile.ranks if r >= self.world_size)
            if missing:  # a typo or a smaller world than planned: say it rather than profile nothing in silence
                logger.warning(
                    "profile['ranks'] names rank(s) %s, which this job of %d rank(s) does not have; %s", missing,
                    self.world_size,
                    "nothing is profiled" if len(missing) == len(profile.ranks) else "they are skipped",
                )
        if profile is not None and profile.covers(self.rank) and remaining_batches:
            self._open_profiler()
        if self.rank == 0 and self.options.progress != "off" and remaining_batches:
            self._open_display()
        if self._display is not None or self._profiler is not None:
            self.next_step = 0
        self._last_check = time.monotonic()

    def _open_display(self) -> None:
        mode = pick_mode(self.options.progress, sys.stderr)
        sizes = dict(
            total_examples=self.total_examples,
            total_batches=self.total_batches,
            initial_examples=self._base_examples,
            initial_batches=self._base_batches,
        )
        if mode == "bar":
            self._display = BarDisplay(name=self.job_name, **sizes)
        else:
            self._display = LogDisplay(interval=self.options.progress_interval, **sizes)
        self._display.extra = self.generation.text
        self._next_show = time.monotonic() + self._display.refresh_s

    def _open_profiler(self) -> None:
        assert self.options.profile is not None
        try:
            self._profiler = StepProfiler(self.options.profile, self._tb_dir, self.rank, self._device)
        except Exception as exc:  # noqa: BLE001 - profiling is a convenience
            logger.warning("the profiler could not start: %s", exc)

    # ------------------------------------------------------------------------ steps

    def on_step(self, step: int, claimed: int | None = None) -> None:
        """After step ``step`` (0-based) of this attempt, when ``step >= next_step``.

        ``claimed``: batches taken so far by all ranks, when the scheduler knows it (dynamic schedule);
        otherwise the done count is extrapolated from this rank's step (``(step + 1) * world_size``).

        The loop only compares ``step`` with :attr:`next_step` at every step; this method moves
        :attr:`next_step` ahead to about when the next display refresh is due (from the measured step
        rate, at most :data:`MAX_STEP_GAP` steps ahead), or to the next step while profiling.
        """
        if self._profiler is not None:
            self._profiler.step()
            if not self._profiler.running:
                self._profiler = None
        if self._display is None:
            self.next_step = step + 1 if self._profiler is not None else NEVER
            return
        now = time.monotonic()
        if not self._clock_started:  # the first step (start-up included) is done: rates count from here
            self._clock_started = True
            self._next_show = now + self._display.refresh_s
            self._display.start_clock(*self._done_after(step, claimed))
        elif now >= self._next_show:
            self._next_show = now + self._display.refresh_s
            self._display.show(*self._done_after(step, claimed))
        gap = 1
        if self._profiler is None and now > self._last_check and step > self._last_check_step:
            rate = (step - self._last_check_step) / (now - self._last_check)
            gap = max(1, min(MAX_STEP_GAP, int((self._next_show - now) * rate)))
        self._last_check, self._last_check_step = now, step
        self.next_step = step + gap

    def _done_after(self, step: int, claimed: int | None) -> tuple[int, int]:
        """Examples and batches of the job done after step ``step`` (extrapolated, exact at commits)."""
        batches = min(self._remaining_batches, claimed if claimed is not None else (step + 1) * self.world_size)
        examples = min(self._remaining_examples, batches * self.batch_size)
        return (
            max(self._committed_examples, self._base_examples + examples),
            max(self._committed_batches, self._base_batches + batches),
        )

    # ------------------------------------------------------------------------ commits

    def describe_job(self, description: dict[str, Any]) -> None:
        """Rank 0, before the first step: the call's arguments and plan, stored once per attempt (group ``job``
        of ``metrics.jsonl``, with the attempt's first commit record): what ``tbp report`` shows as the job's
        arguments."""
        self._job = description

    def timeline_due(self, last: bool) -> bool:
        """Rank 0, preparing a commit record: whether a timeline point goes with it (``last``: the call's last).
        (:meth:`Timeline.due`, inlined: it runs at every commit.)"""
        return last or time.monotonic() >= self._timeline.next_at

    def interim_metrics(self, reduce: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Rank 0, at a commit that is neither final nor preempting: reduced metrics so far, when due."""
        if self._metrics_off or time.monotonic() < self._metrics_next:
            return None
        t0 = time.perf_counter()
        try:
            metrics = reduce()
        except Exception as exc:  # noqa: BLE001 - the final metrics are computed anyway
            self._metrics_off = True
            logger.warning("computing the reduced metrics so far failed (%s); they are computed at the end only", exc)
            return None
        cost = time.perf_counter() - t0
        self._metrics_next = time.monotonic() + max(self.options.metrics_interval, METRICS_BUDGET * cost)
        return metrics

    def on_skipped_record(self) -> None:
        """Rank 0: a record of a group commit that is never written (a newer record of its group is, and carries the
        stats and the ``metrics.jsonl`` records due): counted in the timeline's next point as :meth:`on_record` counts
        a record."""
        self._timeline.records += 1  # Timeline.count_record, inlined as in on_record

    def on_record(
        self,
        *,
        batches_committed: int,
        examples_committed: int,
        batches_processed: int,
        examples_processed: int,
        preempted: bool,
        last: bool,
        metrics: dict[str, Any] | None,
        failed_examples: int = 0,
        activity: RankActivity | None = None,
        finished: bool = False,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Rank 0, writing a commit record: its extra ``stats`` and the extra ``metrics.jsonl`` records.

        ``activity``: the ranks' work since the previous timeline point, when :meth:`timeline_due` said a point
        is due (then this record carries one); ``finished``: the job's final record.
        """
        now = time.time()
        if metrics is not None:
            self._metrics = to_jsonable(metrics)
            self._metrics_batches = batches_committed
            self._metrics_time = now
        elapsed = time.monotonic() - self._started
        rate = examples_processed / elapsed if elapsed > 0 else 0.0
        stats: dict[str, Any] = {
            "preempted": preempted,
            "attempt_started": self._started_wall,
            "attempt_elapsed_s": round(elapsed, 3),
            "attempt_batches_processed": batches_processed,
            "attempt_examples_processed": examples_processed,
            "examples_per_s": round(rate, 3),
        }
        if self._metrics is not None:
            stats.update(
                metrics=self._metrics, metrics_batches_committed=self._metrics_batches, metrics_time=self._metrics_time
            )
        records: list[dict[str, Any]] = []
        base = self._base_batches
        if self._job is not None:  # once per attempt: with its first record
            job, self._job = self._job, None
            job = {**job, "attempt_started": self._started_wall}
            records.append({"group": "job", "steps_completed": base, "rank": 0, "metrics": job})
        if self._hparams:  # once per attempt: with its first record
            records.append({"group": "hparams", "steps_completed": base, "rank": 0, "metrics": self._hparams})
            self._hparams = None
        timeline = self._timeline
        timeline.records += 1  # Timeline.count_record, inlined: it runs at every commit
        if activity is not None:
            records.append(
                timeline.point(
                    activity,
                    attempt_started=self._started_wall,
                    elapsed_s=elapsed,
                    batches_committed=batches_committed,
                    examples_committed=examples_committed,
                    failed_examples=failed_examples,
                    preempted=preempted,
                    finished=finished,
                    last=last,
                )
            )
        stats["timeline_points"] = timeline.points
        mono = time.monotonic()
        if last or mono >= self._next_progress_record:
            self._next_progress_record = mono + self.options.progress_interval
            records.append(
                {
                    "group": "progress",
                    "steps_completed": batches_committed,
                    "rank": 0,
                    "metrics": {
                        "batches_committed": batches_committed,
                        "examples_committed": examples_committed,
                        "fraction_done": _fraction(examples_committed, self.total_examples),
                        "examples_per_s": round(rate, 3),
                        "elapsed_s": round(elapsed, 3),
                    },
                }
            )
        return stats, records

    def on_commit(
        self,
        *,
        intervals: list[RankInterval],
        own_records: list[dict[str, Any]],
        batches_committed: int,
        examples_committed: int,
        metrics: dict[str, Any] | None,
        all_ranks: bool = True,
    ) -> None:
        """Every rank, once a commit is complete: display, stragglers, TensorBoard.

        ``all_ranks``: ``intervals`` holds every rank's part (the static schedule's commits; with the dynamic
        one a rank only knows its own, and stragglers are not looked for).
        """
        self._committed_batches = batches_committed
        self._committed_examples = examples_committed
        if self.rank == 0 and all_ranks:
            straggler = self._stragglers.add(intervals)
            if straggler is not None:
                logger.warning(straggler.describe())
        if self._tb is not None:
            self._tb.on_commit(intervals[self.rank], own_records, metrics, batches_committed, examples_committed)
        if self._uploader is not None and self._uploader.due():  # object stores: upload the folder's changes
            if self._tb is not None:
                self._tb.flush()
            self._uploader.sync()

    def _progress_scalars(self, examples_committed: int) -> dict[str, float]:
        """Rank 0's ``progress/`` scalars in TensorBoard."""
        elapsed = time.monotonic() - self._started
        done = examples_committed - self._base_examples
        return {
            "examples_per_s": done / elapsed if elapsed > 0 else 0.0,
            "fraction_done": _fraction(examples_committed, self.total_examples),
            "examples_committed": examples_committed,
        }

    # ------------------------------------------------------------------------ end

    def finish(self, result: BatchProcessResult) -> None:
        """After the last commit of this call: closes the display and logs the summary (rank 0)."""
        if self._display is not None and isinstance(self._display, BarDisplay):
            self._display.show(result.examples_committed, result.batches_committed)  # the bar ends exact
        self._close_display()
        if self._tb is not None:
            self._tb.finish(result.batches_committed, result.examples_committed)
        if self.rank == 0:
            line = summary_line(result)
            if result.finished:  # where a new user looks next
                line += "; look at the job: {} and {}".format(*job_commands(result.storage_path))
            logger.info(line)

    def close(self) -> None:
        """Always, when the call ends (also on errors): stops the profiler, closes files and display."""
        self._close_display()
        if self._profiler is not None:
            self._profiler.close()
            self._profiler = None
        self.next_step = NEVER
        if self._tb is not None:
            tb, self._tb = self._tb, None
            tb.close()
        if self._uploader is not None:
            uploader, self._uploader = self._uploader, None
            uploader.close()

    def _close_display(self) -> None:
        if self._display is not None:
            display, self._display = self._display, None
            display.close()


def _fraction(done: int, total: int) -> float:
    return round(done / total, 6) if total else 1.0
