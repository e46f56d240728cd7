"""The loop: the lifecycle of one call on one rank, wiring the engine's components together.

1. Open the job: rank 0 reads, checks and repairs what is stored, under the job lock; every rank gets the
   :class:`~torch_batch_process.engine.job.Start` (:mod:`~torch_batch_process.engine.job`).
2. Build the processor on every rank (``cls(context)``), restore its state, agree to start
   (:mod:`~torch_batch_process.engine.building`).
3. Run this rank's batches as its scheduler deals them (:mod:`~torch_batch_process.engine.scheduler`):
   ``process_batch(batch, batch_idx)`` with the global batch index (:mod:`~torch_batch_process.engine.runner`),
   loaded by the feed (:mod:`~torch_batch_process.engine.batches`).
4. Commit when the scheduler says so: ``on_checkpoint_start()``, then the committer makes outputs, progress and
   states durable together (:mod:`~torch_batch_process.engine.committer`); stop (preemption) or fail with the
   other ranks when the scheduler says so.
5. When the batches are done, or the ranks stop or fail: the closing commit, together.
6. When every batch is committed: ``on_finish()``, the final commit with the reduced metrics, and the same
   :class:`~torch_batch_process.result.BatchProcessResult` on every rank.

The observer (:mod:`~torch_batch_process.observe.observer`) is told what happens; it never drives the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from torch_batch_process.context import CurrentBatch, TorchBatchProcessorContext
from torch_batch_process.engine.agreement import Decision, FailureTracker
from torch_batch_process.engine.announce import announce_start, log_memory, log_preempted, warn_max_batches
from torch_batch_process.engine.autocast import resolve_autocast
from torch_batch_process.engine.batches import BatchFeed
from torch_batch_process.engine.bucket_options import AUTO, planned_max_tokens
from torch_batch_process.engine.building import build_processor
from torch_batch_process.engine.commit_wiring import make_committer
from torch_batch_process.engine.committer import Committer, Outcome
from torch_batch_process.engine.distributed import DistributedEnv
from torch_batch_process.engine.fitting import BatchFitter
from torch_batch_process.engine.guard import check_failures, guard_runner
from torch_batch_process.engine.job import JobOpener, Start
from torch_batch_process.engine.liveness import Heartbeats, watch_peers
from torch_batch_process.engine.oom import device_kind
from torch_batch_process.engine.plan import BucketedPlan, Plan, dataset_plan, planned_batches
from torch_batch_process.engine.preemption import SignalWatcher
from torch_batch_process.engine.prefetch import DevicePrefetcher, validate_device_prefetch
from torch_batch_process.engine.ranges import RangeSet
from torch_batch_process.engine.records import JobSpec
from torch_batch_process.engine.results import job_result, stored_result
from torch_batch_process.engine.runner import BatchRunner
from torch_batch_process.engine.scheduler import Scheduler, make_scheduler
from torch_batch_process.engine.streams import StreamJob, is_source
from torch_batch_process.engine.watchdog import BatchWatchdog
from torch_batch_process.observe.observer import JobObserver
from torch_batch_process.observe.options import ObserveOptions
from torch_batch_process.outputs.files import OutputStager
from torch_batch_process.outputs.records import RecordWriter
from torch_batch_process.outputs.schema import RecordSchema
from torch_batch_process.outputs.tables.commits import TableCommits
from torch_batch_process.outputs.tables.sink import TableSink
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.result import BatchProcessResult
from torch_batch_process.storage.base import Storage, open_storage
from torch_batch_process.storage.layout import OUTPUTS_DIR, tensorboard_dir
from torch_batch_process.validation import JobArguments

__all__ = ["JobRun"]

logger = logging.getLogger(__name__)


class JobRun:
    """One call of :func:`~torch_batch_process.torch_batch_process` on one rank (see the module docstring)."""

    def __init__(
        self,
        args: JobArguments,
        env: DistributedEnv,
        options: ObserveOptions | None = None,
        plan: Plan | None = None,
        record_schema: RecordSchema | None = None,
        storage: Storage | None = None,
        first_stage: int = 1,
    ) -> None:
        self.args = args
        self.parent_schema = record_schema  # a retry's rows unify with those of the job it retries
        self.env = env
        self.rank, self.world_size = env.info.rank, env.info.size
        self.coll = env.collectives
        self.started = time.monotonic()
        self.autocast = resolve_autocast(args.autocast, env.device)  # checked on the rank's device, before any I/O
        self.device_prefetch = validate_device_prefetch(args.device_prefetch, env.device)
        self.storage = storage or open_storage(args.storage_path, args.storage_options)  # given: a retry's
        t0 = time.perf_counter()
        streamed = is_source(args.dataset)  # a streaming source: its plan needs the shards' row counts
        self.stream = StreamJob(args.dataset, args.batch_size, self.storage, self.coll) if streamed else None
        self.full_plan: Plan = plan or (  # a given plan: retry_failed (engine/retry.py)
            self.stream.plan
            if self.stream is not None
            else dataset_plan(
                args.dataset_length,
                args.batch_size,
                args.lengths,
                args.bucket_window,
                planned_max_tokens(args.max_tokens),
            )
        )
        self.plan_s = args.lengths_s + time.perf_counter() - t0
        self.plan = self.full_plan
        length = self.stream.plan.dataset_length if self.stream is not None else args.dataset_length
        spec = JobSpec.of_call(args, length, self.plan.fingerprint())
        self.table = args.table.open() if args.table is not None else None  # table= (outputs/tables)
        self.table_commits = TableCommits(self.table) if self.table is not None and self.rank == 0 else None
        self.opener = JobOpener(
            self.storage, spec, args.job_name, args.resume, self.coll, self.table_commits, args.script,
            first_stage=first_stage,
        )
        self.failures = FailureTracker(self.rank)
        self.tensorboard = self.storage.mirrored_folder(tensorboard_dir(self.rank), f"tensorboard-rank{self.rank}")
        self.observer = JobObserver(
            options or ObserveOptions(), rank=self.rank, world_size=self.world_size, job_name=args.job_name,
            batch_size=args.batch_size, tensorboard=self.tensorboard, device=env.device,
        )
        self.committer: Committer | None = None
        self.fitter: BatchFitter | None = None  # on_oom="split": what fits in the device's memory (DESIGN §15)
        self.stager: OutputStager | None = None
        self.records: RecordWriter | None = None  # context.write()
        self.call_id = ""
        self._prefixed_store: Any = None
        self._scheduler: Scheduler | None = None
        self._peers: Heartbeats | None = None
        self.watchdog: BatchWatchdog | None = None  # batch_timeout: watches until the call ends (engine/guard.py)
        self._result: Callable[..., BatchProcessResult] = partial(job_result)  # bound to the call in run()

    # ------------------------------------------------------------------------ lifecycle

    def run(self) -> BatchProcessResult:
        warn_max_batches(self.plan, self.args.max_batches, self.world_size)
        try:
            with SignalWatcher() as signals:  # from here on, SIGTERM/SIGINT mean: commit and stop
                planned = planned_batches(self.plan.num_batches, self.args.max_batches, self.world_size)
                start = self.opener.open(planned, self.full_plan.cut(planned).num_examples)
                if start.finished_result is not None:
                    return stored_result(start, self.storage.url, self.world_size, self.started)
                self.call_id, self.start = start.call_id, start
                if self.stream is not None:
                    self.stream.opened()  # row counts counted now are kept for resumes
                self.plan = self.full_plan.cut(start.planned_batches)
                self.fitter = self._fitter(start)
                self._result = partial(  # this call's result from the closing commit's metrics and summary
                    job_result, plan=self.plan, start=start, preempted=False, storage_url=self.storage.url,
                    outputs_url=self.storage.url_of(OUTPUTS_DIR), world_size=self.world_size,
                )
                remaining = self.plan.remaining(start.latest.committed if start.latest else RangeSet())
                processor, stop_now = self._build(start, signals)
                schedule = make_scheduler if self.stream is None else self.stream.make_scheduler
                interval = self.args.checkpoint_interval
                scheduler = schedule(self.args.schedule, remaining, self.coll, interval, self.call_store())
                announce_start(self, start, remaining)
                outcome = self._process(processor, scheduler, signals, stop_now) if len(remaining) or stop_now else None
                if outcome is None or not outcome.preempted:
                    check_failures(self, outcome)  # max_failures over all ranks (engine/guard.py)
                    outcome = self._finish(processor)
                result = self._result(outcome.summary, outcome.metrics or {}, preempted=outcome.preempted)
                if self.rank == 0 and self.fitter is not None:
                    log_memory(result, auto=self.args.max_tokens == AUTO)
                if result.preempted:
                    log_preempted(result)
            self.observer.finish(result)
            return result
        finally:
            self._shutdown()

    def _build(self, start: Start, signals: SignalWatcher) -> tuple[TorchBatchProcessor, bool]:
        """The stager, context and committer of this rank, then the processor (restored) and the first agreement."""
        self.stager = OutputStager(self.storage, self.rank)
        current = CurrentBatch()
        committed = start.latest.record_schema if start.latest is not None else self.parent_schema
        sink = TableSink(self.table, self.rank, start.job_id, start.attempt) if self.table is not None else None
        records = RecordWriter(self.stager, current, self.rank, self.args.output_format, committed, sink)  # context.write()
        context = TorchBatchProcessorContext(
            device=self.env.device,
            distributed=self.env.info,
            stager=self.stager,
            storage_path=self.storage.url,
            tensorboard_path=self.tensorboard.path,
            metrics_sink=lambda line: self._committer().part.lines.append(line),
            current=current,
            records=records,
        )
        self.context, self.current, self.records = context, current, records
        result_json = lambda metrics, summary: self._result(summary, metrics).to_json()  # noqa: E731
        self.committer = make_committer(self, start, context, result_json, self.post_failure)
        t0 = time.perf_counter()
        processor, stop_now = build_processor(
            self.args.processor_cls,
            context,
            start.latest,
            self.opener.store,
            self.coll,
            self.failures,
            lambda: signals.preempt_requested,
        )
        self.committer.part.timings["hooks"] += time.perf_counter() - t0
        return processor, stop_now

    # ------------------------------------------------------------------------ steps and commits

    def _process(
        self, processor: TorchBatchProcessor, scheduler: Scheduler, signals: SignalWatcher, stop_now: bool
    ) -> Outcome:
        """Runs this rank's batches with their commits, then the closing commit; returns its outcome."""
        self._scheduler = scheduler
        self._peers = watch_peers(self)  # dynamic: a rank that dies stops the others (engine/liveness.py)
        decision = Decision.STOP if stop_now else self._steps(processor, scheduler, signals)
        scheduler.close()
        if self._peers is not None:
            self._peers.stop_watching()
        committer = self._committer()
        lockstep = scheduler.kind == "static"  # Determined's semantics: every rank's hook runs at the closing commit
        if decision in (Decision.STOP, Decision.DONE) and (lockstep or committer.part.num_batches or stop_now):
            self._checkpoint_hook(processor)
        return committer.close(processor, preempt=decision is Decision.STOP or signals.preempt_requested)

    def _steps(self, processor: TorchBatchProcessor, scheduler: Scheduler, signals: SignalWatcher) -> Decision:
        committer = self._committer()
        runner = BatchRunner(
            processor, self.current, self.plan, self.failures,
            inference_mode=self.args.inference_mode, mode=self.autocast,
        )
        dataset, order, kwargs = self.args.dataset, scheduler, self.args.dataloader_kwargs
        if self.stream is not None:  # a source: its dataset view, worker-affine order, columnar collation
            dataset, order, kwargs = self.stream.feed_parts(scheduler, kwargs, self.plan)
        feed = BatchFeed(dataset, self.plan, order, kwargs, self.env.device, self.fitter)
        guard_runner(self, runner, feed)  # on_error="skip", on_oom="split", batch_timeout (engine/guard.py)
        batches = DevicePrefetcher(feed, self.env.device, enabled=self.device_prefetch, error_of=feed.load_error)
        observer = self.observer
        try:
            feed.start()
            for step, has_batch in enumerate(scheduler.steps()):
                if has_batch and not self.failures.failed and not runner.step(batches, committer.part):
                    # no batch left for this rank (dynamic), or a stop seen at a claim
                    return scheduler.after_last(failed=self.failures.failed)
                if step >= observer.next_step:  # progress display, profiler: an int compare per step
                    observer.on_step(step, claimed=scheduler.claimed)
                committer.check()
                agreed_stop = committer.poll()
                decision = scheduler.decide(
                    step, agreed_stop=agreed_stop, preempt=signals.preempt_requested, failed=self.failures.failed
                )
                if decision is Decision.COMMIT:
                    self._checkpoint_hook(processor)
                    committer.commit(processor, preempt=signals.preempt_requested)
                    if runner.guard is not None:
                        runner.guard.committed()  # its failures are in that commit: tbp failures lists them
                elif decision is not Decision.CONTINUE:
                    return decision
            return Decision.DONE
        finally:
            batches.close()
            feed.close()  # stops the loader's worker processes
            if self.watchdog is not None:
                self.watchdog.steps_done()

    def _checkpoint_hook(self, processor: TorchBatchProcessor) -> None:
        """``on_checkpoint_start()`` before a commit (a rank that failed already skips it)."""
        if not self.failures.failed:
            self._hook("on_checkpoint_start", processor.on_checkpoint_start)

    def _finish(self, processor: TorchBatchProcessor) -> Outcome:
        """``on_finish()`` on every rank, then the final commit (its files, the result, the reduced metrics)."""
        self._hook("on_finish", processor.on_finish)
        return self._committer().close(processor, preempt=False, final=True)

    def _hook(self, name: str, hook: Any) -> None:
        """Runs a processor hook, timed; its failure travels in this rank's next vote."""
        t0 = time.perf_counter()
        try:
            hook()
        except Exception as exc:  # noqa: BLE001
            self.failures.record(exc, f"{name}()")
        self._committer().part.timings["hooks"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------ helpers

    def _fitter(self, start: Start) -> BatchFitter | None:
        """``on_oom="split"``: this rank's fitter, from the limits the job learned so far (stored with it)."""
        if not self.args.failures.split_on_oom:
            return None
        stored = start.latest.memory_limits if start.latest is not None else None
        lengths = self.plan.lengths if isinstance(self.plan, BucketedPlan) else None
        return BatchFitter.for_job(stored, lengths, device_kind(self.env.device))

    def _committer(self) -> Committer:
        assert self.committer is not None
        return self.committer

    def call_store(self) -> Any:
        """This call's keys in the rendezvous store (dynamic schedule on several ranks), or ``None``."""
        if self.args.schedule != "dynamic" or self.world_size == 1:
            return None
        if self._prefixed_store is None:
            self._prefixed_store = self.env.call_store(self.call_id)
        return self._prefixed_store

    def post_failure(self) -> None:
        """Rank 0's vote collector or heartbeats found a failure (from their thread): every rank stops at its next
        batch (dynamic schedule)."""
        if self._scheduler is not None:
            self._scheduler.post(Decision.FAIL)

    def _shutdown(self) -> None:
        """Always, when the call ends: background work completes (before the lock goes: no record write may
        outlive it), then the stager, the observer, the lock and the storage's local resources."""
        if self._peers is not None:
            self._peers.close()
        if self.watchdog is not None:  # after the closing commit: a timeout on a rank still busy is dumped here too
            self.watchdog.close()
        if self.committer is not None:
            self.committer.shutdown()
        if self.stager is not None:
            self.stager.close()
        self.observer.close()
        self.opener.release()
        if self.stream is not None:
            self.stream.close()
        self.storage.close()
