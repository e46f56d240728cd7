"""The loop: the lifecycle of one call on one rank, wiring the engine's components together.

1. Open the job: the storage, the input and its plan (:mod:`~torch_batch_process.engine.feed.inputs`); rank 0
   reads, checks and repairs what is stored, under the job lock; every rank gets the
   :class:`~torch_batch_process.jobstore.opening.Start` (:mod:`~torch_batch_process.engine.commit.opening`).
2. Build the processor on every rank (``cls(context)``), restore its state, agree to start
   (:mod:`~torch_batch_process.engine.building`).
3. Run this rank's batches as its scheduler deals them (:mod:`~torch_batch_process.engine.schedule`):
   ``process_batch(batch, batch_idx)`` with the global batch index, loaded by the feed
   (:mod:`~torch_batch_process.engine.feed`).
4. Commit when the scheduler says so: ``on_checkpoint_start()``, then the committer makes outputs, progress and
   states durable together (:mod:`~torch_batch_process.engine.commit`); stop (preemption) or fail with the
   other ranks when the scheduler says so.
5. When the batches are done, or the ranks stop or fail: the closing commit, together.
6. When every batch is committed: ``on_finish()``, the final commit with the reduced metrics, and the same
   :class:`~torch_batch_process.result.BatchProcessResult` on every rank.

The observer (:mod:`~torch_batch_process.observe.observer`) is told what happens; it never drives the loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from torch_batch_process.arguments import JobArguments
from torch_batch_process.context import CurrentBatch, TorchBatchProcessorContext
from torch_batch_process.engine.agreement import check_same_call
from torch_batch_process.engine.announce import (
    announce_start,
    describe_call,
    log_memory,
    log_preempted,
    warn_max_batches,
)
from torch_batch_process.engine.building import build_processor
from torch_batch_process.engine.commit.committer import Committer, Outcome
from torch_batch_process.engine.commit.opening import open_job
from torch_batch_process.engine.commit.rank_failure import RankFailure
from torch_batch_process.engine.commit.wiring import make_committer
from torch_batch_process.engine.distributed import DistributedEnv, RendezvousStore
from torch_batch_process.engine.feed.autocast import resolve_autocast
from torch_batch_process.engine.feed.batches import BatchFeed
from torch_batch_process.engine.feed.device_memory import device_kind
from torch_batch_process.engine.feed.error_handling import check_max_failures, guard_batches
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.feed.inputs import JobInput, open_input
from torch_batch_process.engine.feed.prefetch import DevicePrefetcher, validate_device_prefetch
from torch_batch_process.engine.feed.runner import BatchRunner
from torch_batch_process.engine.plan.bucket_options import AUTO
from torch_batch_process.engine.plan.plans import BucketedPlan, Plan, planned_batches
from torch_batch_process.engine.results import job_result, stored_result
from torch_batch_process.engine.schedule.agreement import Decision
from torch_batch_process.engine.schedule.liveness import watch_peers
from torch_batch_process.engine.schedule.preemption import SignalWatcher
from torch_batch_process.engine.schedule.scheduler import Scheduler
from torch_batch_process.jobstore.formats import JobSpec
from torch_batch_process.jobstore.layout import FAILURES_DIR, OUTPUTS_DIR, tensorboard_dir
from torch_batch_process.jobstore.opening import JobOpener, Start
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.jobstore.schema import RecordSchema
from torch_batch_process.observe.observer import JobObserver
from torch_batch_process.observe.options import ObserveOptions
from torch_batch_process.outputs.files import OutputStager
from torch_batch_process.outputs.records import RecordWriter
from torch_batch_process.outputs.segments import roll_leftovers
from torch_batch_process.outputs.tables.base import Table
from torch_batch_process.outputs.tables.commits import TableCommits
from torch_batch_process.outputs.tables.sink import TableSink
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.result import BatchProcessResult
from torch_batch_process.storage.base import MirroredFolder, Storage
from torch_batch_process.storage.registry import open_storage

__all__ = ["JobRun"]

logger = logging.getLogger(__name__)


class JobRun:
    """One call of :func:`~torch_batch_process.torch_batch_process` on one rank (see the module docstring).

    The constructor keeps the call's arguments and checks those that depend on the rank's device: no I/O, no
    collective. :meth:`run` makes the components in the order of the lifecycle, each from the components it
    uses, and closes them when the call ends, the last made first (the committer's background work completes
    before the job lock goes: no record write outlives it).

    Args:
        args: the call's checked arguments.
        env: the rank's distributed context.
        options: the observer's options.
        plan: a retry's plan (:mod:`~torch_batch_process.engine.plan.retry`); ``None``: the input's.
        record_schema: the schema a retry's rows unify with (the retried job's).
        storage: a retry's storage (sharing the job's ``outputs/``), closed when the call ends; ``None``: the one
            of ``args.storage_path``, opened by :meth:`run`.
        first_stage: a retry's first commit and stage number (after every one the job used).
        signals: the call's watcher of SIGTERM/SIGINT, entered by the caller before the ranks joined (a signal
            during the join or the job's opening is a preemption too); ``None``: the run watches them itself
            from the opening of the job on.
    """

    # the components run() makes, in this order
    storage: Storage
    input: JobInput
    plan: Plan
    """The job's plan: the input's (or a retry's), cut to the batches planned at the job's first start."""
    plan_s: float
    table: Table | None
    """A table target's table (``table=``), ``None``: record shards in the job's storage."""
    table_commits: TableCommits | None
    """Rank 0's transactions of the table target."""
    opener: JobOpener
    tensorboard: MirroredFolder
    observer: JobObserver
    stager: OutputStager
    current: CurrentBatch
    context: TorchBatchProcessorContext
    committer: Committer
    fitter: BatchFitter | None
    """``on_oom="split"``: what fits in the device's memory (DESIGN §15); ``None``: ``"raise"``."""
    _result_of: Callable[..., BatchProcessResult]

    def __init__(
        self,
        args: JobArguments,
        env: DistributedEnv,
        options: ObserveOptions | None = None,
        plan: Plan | None = None,
        record_schema: RecordSchema | None = None,
        storage: Storage | None = None,
        first_stage: int = 1,
        signals: SignalWatcher | None = None,
    ) -> None:
        self.args = args
        self.env = env
        self.options = options or ObserveOptions()
        self.given_plan = plan
        self.parent_schema = record_schema
        self.given_storage = storage
        self.first_stage = first_stage
        self.given_signals = signals
        self.rank, self.world_size = env.info.rank, env.info.size
        self.coll = env.collectives
        self.started = time.monotonic()
        self.autocast = resolve_autocast(args.autocast, env.device)  # checked on the rank's device, before any I/O
        self.device_prefetch = validate_device_prefetch(args.device_prefetch, env.device)
        self.rank_failure = RankFailure(self.rank)
        self._scheduler: Scheduler | None = None  # dynamic: told to stop every rank by background threads
        self._closing = contextlib.ExitStack()  # what run() made, closed when the call ends

    # ------------------------------------------------------------------------ lifecycle

    def run(self) -> BatchProcessResult:
        """The call on this rank, steps 1 to 6 of the module docstring; the same result on every rank. A run is
        used once: when it ends, it drops its parts (see :meth:`_drop_parts`)."""
        try:
            return self._run()
        finally:
            self._drop_parts()

    def _drop_parts(self) -> None:
        """Forgets every part of the run. They point at each other (callbacks, the context's sinks) and hold the
        user's objects (reducers, the dataset, the plan's arrays): without this they would wait for a garbage
        collection after the call returns, or live on with a failed call's exception, whose frames hold the run."""
        self.__dict__.clear()

    def _run(self) -> BatchProcessResult:
        with self._closing:
            watching = contextlib.nullcontext(self.given_signals) if self.given_signals is not None else SignalWatcher()
            with watching as signals:  # from here on, SIGTERM/SIGINT mean: commit and stop
                planned, planned_examples = self._prepare()
                check_same_call(self.spec.to_json(), self.coll, "jobs (dataset, plan...)")  # before rank 0 opens it
                start = open_job(self.opener, self.coll, planned, planned_examples)
                if start.finished_result is not None:
                    return stored_result(start, self.storage.url, self.world_size, self.started)
                self.input.opened()  # what a resume reuses (a stream's row counts) is kept now
                self.plan = self.plan.cut(start.planned_batches)
                self.fitter = self._fitter(start)
                remaining = self.plan.remaining(start.latest.committed if start.latest else RangeSet())
                store = self.env.call_store(start.call_id) if self._dynamic else None
                processor, stop_now = self._build(start, signals, store)
                interval = self.args.checkpoint_interval
                scheduler = self.input.scheduler(self.args.schedule, remaining, self.coll, interval, store)
                announce_start(
                    self.observer, self.plan, start, remaining, rank=self.rank, job_name=self.args.job_name,
                    world_size=self.world_size, schedule=self.args.schedule, storage_url=self.storage.url,
                    plan_s=self.plan_s, fitter=self.fitter, call=lambda: self._describe(start),
                )
                outcome = None
                if len(remaining) or stop_now:
                    outcome = self._process(processor, scheduler, signals, stop_now, start, store)
                if outcome is None or not outcome.preempted:
                    failed = outcome.summary.failed_examples if outcome is not None else None
                    check_max_failures(self.args.failures, failed, start, self.plan.num_examples, self._failures_url)
                    outcome = self._finish(processor)
                self.coll.all_gather(None)  # every rank has published its files: what a rank reads under outputs/
                # once the call returns holds every rank's (Determined's call ends with such a gather too)
                result = self._result_of(outcome.summary, outcome.metrics or {}, preempted=outcome.preempted)
                if self.rank == 0 and self.fitter is not None:
                    log_memory(result, auto=self.args.max_tokens == AUTO)
                if result.preempted:
                    log_preempted(result)
            self.observer.finish(result)
            return result

    def _prepare(self) -> tuple[int, int]:
        """The storage, the input and its plan, the observer; returns the batches and examples a fresh job plans
        (the plan's, after ``max_batches``)."""
        args, rank = self.args, self.rank
        storage = self.given_storage or open_storage(args.storage_path, args.storage_options)
        self.storage = self._closing.enter_context(contextlib.closing(storage))
        t0 = time.perf_counter()
        self.input = self._closing.enter_context(contextlib.closing(open_input(args, self.storage, self.coll)))
        self.plan = self.given_plan or self.input.plan
        self.plan_s = args.lengths_s + time.perf_counter() - t0
        self.spec = spec = JobSpec.of_call(args, self.input.dataset_length, self.plan.fingerprint())
        self.table = args.table.open() if args.table is not None else None  # table= (outputs/tables)
        self.table_commits = TableCommits(self.table) if self.table is not None and rank == 0 else None
        self.opener = JobOpener(
            self.storage, spec, args.job_name, args.resume, self.world_size, self.table_commits, args.script,
            first_stage=self.first_stage, leftovers=roll_leftovers,
        )
        self._closing.callback(self.opener.release)
        self.tensorboard = self.storage.mirrored_folder(tensorboard_dir(rank), f"tensorboard-rank{rank}")
        self.observer = JobObserver(
            self.options, rank=rank, world_size=self.world_size, job_name=args.job_name,
            batch_size=args.batch_size, tensorboard=self.tensorboard, device=self.env.device,
        )
        self._closing.callback(self.observer.close)
        warn_max_batches(self.plan, args.max_batches, self.world_size)
        planned = planned_batches(self.plan.num_batches, args.max_batches, self.world_size)
        return planned, self.plan.cut(planned).num_examples

    def _build(
        self, start: Start, signals: SignalWatcher, store: RendezvousStore | None
    ) -> tuple[TorchBatchProcessor, bool]:
        """The stager, context and committer of this rank, then the processor (restored) and the first agreement."""
        self.stager = OutputStager(self.storage, self.rank)
        self._closing.callback(self.stager.close)
        self.current = CurrentBatch()
        committed = start.latest.record_schema if start.latest is not None else self.parent_schema
        sink = TableSink(self.table, self.rank, start.job_id, start.attempt) if self.table is not None else None
        records = RecordWriter(self.stager, self.current, self.rank, self.args.output_format, committed, sink)
        self.context = TorchBatchProcessorContext(
            device=self.env.device,
            distributed=self.env.info,
            upload_path=self.stager.upload_path,
            storage_path=self.storage.url,
            tensorboard_path=self.tensorboard.path,
            metrics_sink=lambda line: self.committer.part.lines.append(line),
            current=self.current,
            write_rows=records.write,
        )
        self._result_of = partial(  # this call's result from the closing commit's metrics and summary
            job_result, plan=self.plan, start=start, preempted=False, storage_url=self.storage.url,
            outputs_url=self.storage.url_of(OUTPUTS_DIR), world_size=self.world_size,
        )
        self.committer = make_committer(
            rank=self.rank, collectives=self.coll, job_store=self.opener.store, lock=self.opener.lock,
            storage=self.storage, plan=self.plan, start=start, reducers=self.context.reducers, observer=self.observer,
            rank_failure=self.rank_failure, stager=self.stager, records=records, call_store=store,
            result_json=lambda metrics, summary: self._result_of(summary, metrics).to_json(), started=self.started,
            on_background_error=self._post_failure, table=self.table_commits, fitter=self.fitter,
        )
        self._closing.callback(self.committer.shutdown)
        t0 = time.perf_counter()
        processor, stop_now = build_processor(
            self.args.processor_cls, self.context, start.latest, self.opener.store, self.coll, self.rank_failure,
            lambda: signals.preempt_requested,
        )
        self.committer.part.timings["hooks"] += time.perf_counter() - t0
        return processor, stop_now

    # ------------------------------------------------------------------------ steps and commits

    def _process(
        self,
        processor: TorchBatchProcessor,
        scheduler: Scheduler,
        signals: SignalWatcher,
        stop_now: bool,
        start: Start,
        store: RendezvousStore | None,
    ) -> Outcome:
        """Runs this rank's batches with their commits, then the closing commit; returns its outcome."""
        self._scheduler = scheduler
        peers = watch_peers(store, self.rank, self.world_size, self._lost_peer)  # dynamic: a rank that dies stops
        if peers is not None:  # the others (engine/schedule/liveness.py)
            self._closing.callback(peers.close)
        decision = Decision.STOP if stop_now else self._steps(processor, scheduler, signals, start)
        scheduler.close()
        if peers is not None:
            peers.stop_watching()
        lockstep = scheduler.kind == "static"  # Determined's semantics: every rank's hook runs at the closing commit
        if decision in (Decision.STOP, Decision.DONE) and (lockstep or self.committer.part.num_batches or stop_now):
            self._checkpoint_hook(processor)
        return self.committer.close(processor, preempt=decision is Decision.STOP or signals.preempt_requested)

    def _steps(
        self, processor: TorchBatchProcessor, scheduler: Scheduler, signals: SignalWatcher, start: Start
    ) -> Decision:
        committer, rank_failure = self.committer, self.rank_failure
        runner = BatchRunner(
            processor, self.current, self.plan, rank_failure,
            inference_mode=self.args.inference_mode, mode=self.autocast,
        )
        dataset, order, kwargs = self.input.feed_parts(scheduler, self.args.dataloader_kwargs, self.plan)
        feed = BatchFeed(dataset, self.plan, order, kwargs, self.env.device, self.fitter)
        watchdog = guard_batches(  # on_error="skip", on_oom="split", batch_timeout (engine/feed/error_handling.py)
            runner, feed, self.args.failures, rank=self.rank, store=self._watchdog_store(start),
            device=self.env.device if self.device_prefetch else None, current=self.current, stager=self.stager,
            reducers=self.context.reducers, start=start, num_examples=self.plan.num_examples,
            failures_url=self._failures_url, fitter=self.fitter,
            original_batch=getattr(self.plan, "original_batch", None),  # a retry's plan keeps the original batches
            lengths=self.plan.lengths if isinstance(self.plan, BucketedPlan) else None, rank_device=self.env.device,
        )
        if watchdog is not None:  # it watches until the call ends: a rank whose batches are done still dumps
            self._closing.callback(watchdog.close)  # its stacks when another rank's batch times out
        batches = DevicePrefetcher(feed, self.env.device, enabled=self.device_prefetch, error_of=feed.load_error)
        observer = self.observer
        try:
            feed.start()
            for step, has_batch in enumerate(scheduler.steps()):
                if has_batch and not rank_failure.failed and not runner.step(batches, committer.part):
                    # no batch left for this rank (dynamic), or a stop seen at a claim
                    return scheduler.after_last(failed=rank_failure.failed)
                if step >= observer.next_step:  # progress display, profiler: an int compare per step
                    observer.on_step(step, claimed=scheduler.claimed)
                committer.check()
                agreed_stop = committer.poll()
                decision = scheduler.decide(
                    step, agreed_stop=agreed_stop, preempt=signals.preempt_requested, failed=rank_failure.failed
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
            runner.close()
            if watchdog is not None:
                watchdog.steps_done()

    def _checkpoint_hook(self, processor: TorchBatchProcessor) -> None:
        """``on_checkpoint_start()`` before a commit (a rank that failed already skips it)."""
        if not self.rank_failure.failed:
            self._hook("on_checkpoint_start", processor.on_checkpoint_start)

    def _finish(self, processor: TorchBatchProcessor) -> Outcome:
        """``on_finish()`` on every rank, then the final commit (its files, the result, the reduced metrics).

        The ranks first wait for one another: each rank publishes its own files of the closing commit once the
        record is durable, so without it rank 0's ``on_finish()`` could list ``outputs/`` before another rank's
        last files are there (Determined's uploads are done when its checkpoint's gather returns: code that
        aggregates every rank's outputs in rank 0's ``on_finish()`` relies on it).
        """
        self.coll.all_gather(None)
        self._hook("on_finish", processor.on_finish)
        return self.committer.close(processor, preempt=False, final=True)

    def _hook(self, name: str, hook: Callable[[], Any]) -> None:
        """Runs a processor hook, timed; its failure travels in this rank's next vote.

        Under ``torch.inference_mode()`` when ``process_batch`` runs under it: the hooks handle the tensors
        ``process_batch`` made (inference tensors), and an in-place update of one outside the mode raises (code
        written for Determined, which has no inference mode, does ``self.total += ...`` there).
        """
        t0 = time.perf_counter()
        try:
            with torch.inference_mode() if self.args.inference_mode else contextlib.nullcontext():
                hook()
        except Exception as exc:  # noqa: BLE001
            self.rank_failure.record(exc, f"{name}()")
        self.committer.part.timings["hooks"] += time.perf_counter() - t0

    # ------------------------------------------------------------------------ helpers

    def _fitter(self, start: Start) -> BatchFitter | None:
        """``on_oom="split"``: this rank's fitter, from the limits the job learned so far (stored with it)."""
        if not self.args.failures.split_on_oom:
            return None
        stored = start.latest.memory_limits if start.latest is not None else None
        lengths = self.plan.lengths if isinstance(self.plan, BucketedPlan) else None
        return BatchFitter.for_job(stored, lengths, device_kind(self.env.device))

    def _describe(self, start: Start) -> dict[str, Any]:
        """Rank 0: the call's arguments, world and plan for ``tbp report`` (:func:`describe_call`)."""
        return describe_call(
            self.args, start, self.plan, world_size=self.world_size, device=self.env.device,
            device_prefetch=self.device_prefetch, storage_url=self.storage.url,
            straggler_ratio=self.observer.options.straggler_ratio,
        )

    @property
    def _dynamic(self) -> bool:
        """The dynamic schedule on several ranks: ranks share counters and queues in the rendezvous store."""
        return self.args.schedule == "dynamic" and self.world_size > 1

    @property
    def _failures_url(self) -> str:
        return self.storage.url_of(FAILURES_DIR)

    def _watchdog_store(self, start: Start) -> Callable[[], RendezvousStore] | None:
        """``batch_timeout`` on several ranks: a factory of rendezvous store connections for the watchdog thread."""
        if self.world_size == 1:
            return None
        call_store = self.env.call_store
        return lambda: call_store(start.call_id).clone()

    def _lost_peer(self, error: BaseException) -> None:
        """Rank 0's heartbeat thread found a rank gone: its failure, and every rank stops at its next batch."""
        rank_failure = getattr(self, "rank_failure", None)  # None: the run ended (its parts are dropped)
        if rank_failure is not None:
            rank_failure.record(error, "watching the other ranks' heartbeats")
        self._post_failure()

    def _post_failure(self) -> None:
        """Rank 0's vote collector or heartbeats found a failure (from their thread): every rank stops at its next
        batch (dynamic schedule)."""
        scheduler = getattr(self, "_scheduler", None)  # None also once the run ended (its parts are dropped)
        if scheduler is not None:
            scheduler.post(Decision.FAIL)
