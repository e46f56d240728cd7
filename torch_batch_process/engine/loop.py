"""The loop: the lifecycle of one call on one rank, wiring the engine's components together.

1. Open the job (:class:`OpenJob`): the storage, the input and its plan
   (:mod:`~torch_batch_process.engine.feed.inputs`), the observer; rank 0 reads, checks and repairs what is stored,
   under the job lock; every rank gets the :class:`~torch_batch_process.jobstore.opening.Start`
   (:mod:`~torch_batch_process.engine.commit.shared_start`).
2. Make every part of the call from the enabled capabilities (:class:`JobRun`, in one constructor), build the
   processor on every rank (``cls(context)``), restore its state, agree to start
   (:mod:`~torch_batch_process.engine.building`).
3. Run this rank's batches as its scheduler deals them (:mod:`~torch_batch_process.engine.schedule`):
   ``process_batch(batch, batch_idx)`` with the global batch index, loaded by the feed
   (:mod:`~torch_batch_process.engine.feed`).
4. Commit when the scheduler says so: ``on_checkpoint_start()``, then the committer makes outputs, progress and
   states durable together, with what each capability stores (its participants:
   :mod:`~torch_batch_process.engine.commit`); stop (preemption) or fail with the other ranks when the scheduler
   says so.
5. When the batches are done, or the ranks stop or fail: the closing commit, together.
6. When every batch is committed: ``on_finish()``, the final commit with the reduced metrics, and the same
   :class:`~torch_batch_process.result.BatchProcessResult` on every rank.

The observer (:mod:`~torch_batch_process.observe.observer`) is told what happens; it never drives the loop.

The parts of a call hold no reference back to the run (the context's sinks and the background threads' callbacks
hold the parts they need), so they all go when the call returns, or when a failed call's exception is dropped.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from torch_batch_process.arguments import JobArguments
from torch_batch_process.context import CurrentBatch, TorchBatchProcessorContext
from torch_batch_process.engine.announce import (
    announce_start,
    describe_call,
    log_memory,
    log_preempted,
    warn_max_batches,
)
from torch_batch_process.engine.building import build_processor
from torch_batch_process.engine.capabilities.failures_participant import FailingExamplesParticipant, failed_before
from torch_batch_process.engine.capabilities.generation_participant import GenerationParticipant
from torch_batch_process.engine.capabilities.memory_participant import MemoryLimitsParticipant
from torch_batch_process.engine.capabilities.mesh_participant import MemberFiles, MemberFilesParticipant
from torch_batch_process.engine.capabilities.records_participant import RecordOutputs
from torch_batch_process.engine.capabilities.table_participant import TableOutputs
from torch_batch_process.engine.capabilities.timeline_participant import TimelineParticipant
from torch_batch_process.engine.commit.call_summary import Summary
from torch_batch_process.engine.commit.committer import Outcome
from torch_batch_process.engine.commit.participants import Participant, Participants
from torch_batch_process.engine.commit.reducer_summaries import ReducerSummaries
from torch_batch_process.engine.commit.shared_start import open_job
from torch_batch_process.engine.commit.wiring import CommitCall, make_committer
from torch_batch_process.engine.distributed import DistributedEnv, collective_timeout_s
from torch_batch_process.engine.feed.autocast import resolve_autocast
from torch_batch_process.engine.feed.batches import BatchFeed
from torch_batch_process.engine.feed.device_memory import device_kind
from torch_batch_process.engine.feed.error_handling import Placement, check_max_failures, guard_batches
from torch_batch_process.engine.feed.failing_examples import FailureLog, Transactions
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.feed.in_flight import InFlight
from torch_batch_process.engine.feed.inputs import open_input
from torch_batch_process.engine.feed.prefetch import DevicePrefetcher, validate_device_prefetch
from torch_batch_process.engine.feed.replica import ReplicaFeed
from torch_batch_process.engine.feed.runner import BatchCall, BatchRunner
from torch_batch_process.engine.feed.watchdog import watch_batches
from torch_batch_process.engine.final_drain import drain_committing
from torch_batch_process.engine.mesh.groups import open_job_mesh
from torch_batch_process.engine.mesh.members import MemberWatch
from torch_batch_process.engine.plan.bucket_options import AUTO
from torch_batch_process.engine.plan.plans import BucketedPlan, planned_batches
from torch_batch_process.engine.plan.retry import Retry
from torch_batch_process.engine.rank_failure import RankFailure
from torch_batch_process.engine.results import job_result, stored_result
from torch_batch_process.engine.same_call import check_same_call
from torch_batch_process.engine.schedule.agreement import Decision
from torch_batch_process.engine.schedule.liveness import watch_peers
from torch_batch_process.engine.schedule.preemption import SignalWatcher
from torch_batch_process.engine.work import RankWork
from torch_batch_process.errors import WorkerLostError
from torch_batch_process.jobstore.formats import JobSpec
from torch_batch_process.jobstore.layout import FAILURES_DIR, OUTPUTS_DIR, tensorboard_dir
from torch_batch_process.jobstore.opening import JobOpener, Start
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.observe.observer import JobObserver
from torch_batch_process.observe.options import ObserveOptions
from torch_batch_process.outputs.keyed.options import RowStamp
from torch_batch_process.outputs.records import RecordWriter
from torch_batch_process.outputs.segments import roll_leftovers
from torch_batch_process.outputs.stager import OutputStager
from torch_batch_process.outputs.tables.commits import TableCommits
from torch_batch_process.outputs.tables.sink import TableSink
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.result import BatchProcessResult
from torch_batch_process.storage.registry import open_storage

__all__ = ["JobRun", "OpenJob", "run_job"]


def run_job(
    args: JobArguments, env: DistributedEnv, options: ObserveOptions, signals: SignalWatcher, retry: Retry | None = None
) -> BatchProcessResult:
    """One call of :func:`~torch_batch_process.torch_batch_process` on one rank: steps 1 to 6 of the module docstring;
    the same result on every rank.

    Args:
        args: the call's checked arguments.
        env: the rank's distributed context.
        options: the observer's options.
        signals: the call's watcher of SIGTERM/SIGINT, entered before the ranks joined (a signal during the join or
            the job's opening is a preemption too).
        retry: ``retry_failed=True``: the retry to run (its plan, storage and first stage:
            :mod:`~torch_batch_process.engine.plan.retry`); ``None``: the job of ``args``.
    """
    with OpenJob(args, env, options, retry) as job:  # 1.
        start = job.open()
        if start.finished_result is not None:
            return stored_result(start, job.storage.url, env.info.size, job.started)
        with JobRun(job, start, signals) as run:  # 2. every part of the call, from the enabled capabilities
            result = run.run()  # 2. to 6.
            job.observer.finish(result)
        return result


class OpenJob:
    """Step 1 on one rank: the storage, the input and its plan, the table target, the observer and the job's opener;
    closed (the job lock released last but for the storage) when the call ends.

    Args:
        args: the call's checked arguments.
        env: the rank's distributed context.
        options: the observer's options.
        retry: a retry's plan, storage and first stage (``None``: the job of ``args``).
    """

    def __init__(
        self, args: JobArguments, env: DistributedEnv, options: ObserveOptions, retry: Retry | None = None
    ) -> None:
        self.started = time.monotonic()
        self.args = args if retry is None else retry.args
        self.env = env
        self.retry = retry
        args, rank = self.args, env.info.rank
        # checked on the rank's device, before any I/O
        self.autocast = resolve_autocast(args.autocast, env.device)
        self.device_prefetch = validate_device_prefetch(args.device_prefetch, env.device)
        # mesh=: its layout checked, then its groups (a collective over every rank), before any I/O
        timeout = datetime.timedelta(seconds=collective_timeout_s())
        self.mesh = open_job_mesh(args.mesh, env.info.size, env.device, timeout, env.info.local_size)
        self.units = self.mesh.units if self.mesh is not None else (rank, env.info.size)
        """What batches are dealt over: this rank's replica and the number of replicas (without a mesh: ranks)."""
        self._closing = contextlib.ExitStack()
        with self._closing:  # closes what was opened when a later part fails
            storage = retry.storage if retry is not None else open_storage(args.storage_path, args.storage_options)
            self.storage = self._closing.enter_context(contextlib.closing(storage))
            t0 = time.perf_counter()
            self.input = self._closing.enter_context(contextlib.closing(open_input(args, storage, env.collectives)))
            self.plan = retry.plan if retry is not None else self.input.plan
            self.plan_s = args.lengths_s + time.perf_counter() - t0
            self.spec = JobSpec.of_call(args, self.input.dataset_length, self.plan.fingerprint())
            # table= (outputs/tables); key=: a MERGE by key (§21)
            merge_key = args.keyed.column if args.keyed is not None else None
            self.table = args.table.open(merge_key) if args.table is not None else None
            self.table_commits = TableCommits(self.table) if self.table is not None else None
            self.opener = JobOpener(
                storage, self.spec, args.job_name, args.resume, env.info.size,
                self.table_commits if rank == 0 else None, args.script,
                first_stage=retry.first_stage if retry is not None else 1, leftovers=roll_leftovers,
            )
            self._closing.callback(self.opener.release)
            self.tensorboard = storage.mirrored_folder(tensorboard_dir(rank), f"tensorboard-rank{rank}")
            self.observer = JobObserver(
                options, rank=rank, world_size=env.info.size, job_name=args.job_name,
                batch_size=args.batch_size, tensorboard=self.tensorboard, device=env.device,
            )
            self._closing.callback(self.observer.close)
            self._closing = self._closing.pop_all()

    def __enter__(self) -> OpenJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.close()

    def open(self) -> Start:
        """Every rank: the :class:`Start` of this attempt, once rank 0 read, checked and repaired what is stored
        (the same error on every rank when it could not)."""
        coll, plan = self.env.collectives, self.plan
        warn_max_batches(plan, self.args.max_batches, self.units[1])
        planned = planned_batches(plan.num_batches, self.args.max_batches, self.units[1])  # per replica
        check_same_call(self.spec.to_json(), coll, "jobs (dataset, plan...)")  # before rank 0 opens it
        start = open_job(self.opener, coll, planned, plan.cut(planned).num_examples)
        if start.finished_result is None:
            self.input.opened()  # what a resume reuses (a stream's row counts) is kept now
        return start

    @property
    def failures_url(self) -> str:
        return self.storage.url_of(FAILURES_DIR)


class JobRun:
    """Steps 2 to 6 of one call on one rank (see the module docstring). The constructor makes every part of the call
    from the enabled capabilities, in the order they use one another (no I/O but the rendezvous store's stage
    counter, no user code, no collective); :meth:`run` runs the lifecycle; leaving the ``with`` block closes the
    parts, the last made first (the committer's background work completes before the job lock goes: no record write
    outlives it).

    Args:
        job: the opened job (step 1).
        start: what opening it found.
        signals: the call's watcher of SIGTERM/SIGINT.
    """

    def __init__(self, job: OpenJob, start: Start, signals: SignalWatcher) -> None:
        args, env = job.args, job.env
        self.job = job
        self.args = args
        self.start = start
        self.signals = signals
        self.rank, self.world_size = env.info.rank, env.info.size
        self.coll = env.collectives
        self.plan = job.plan.cut(start.planned_batches)
        self.remaining = self.plan.remaining(start.latest.committed if start.latest else RangeSet())
        self._result_of = partial(  # this call's result from a closing commit's summary and metrics
            job_result, plan=self.plan, start=start, preempted=False, storage_url=job.storage.url,
            outputs_url=job.storage.url_of(OUTPUTS_DIR), world_size=self.world_size,
        )
        self._closing = contextlib.ExitStack()  # what is closed when the call ends, the last made first
        try:
            self.rank_failure = RankFailure(self.rank)
            mesh = job.mesh
            self.writer = mesh is None or mesh.position.is_writer
            """Whether this rank's outputs and metrics count (``mesh=``: its replica's writer only)."""
            self.work = RankWork(counts=self.writer)
            dynamic = args.schedule == "dynamic" and self.world_size > 1  # ranks share counters and queues in the store
            self.call_store = env.call_store(start.call_id) if dynamic else None
            self.scheduler = job.input.scheduler(
                args.schedule, self.remaining, self.coll, args.checkpoint_interval, self.call_store,
                job.units if mesh is not None else None,
            )
            if mesh is not None and mesh.replica_group is not None:  # dynamic: the replica claims as one
                self.scheduler.join_replica(source=mesh.position.is_source)
            self.stager = self._closing.enter_context(contextlib.closing(OutputStager(job.storage, self.rank)))
            self.current = CurrentBatch()
            latest = start.latest
            committed = latest.record_schema if latest is not None else (job.retry.schema if job.retry else None)
            sink = TableSink(job.table, self.rank, start.job_id, start.attempt) if job.table is not None else None
            # key=: every row carries its key, content hash, version and run (§21)
            stamp = (  # a table's MERGE also removes the rows of failed keys
                RowStamp(args.keyed, job.input.examples(), sink.remove_key if sink is not None else None)
                if args.keyed is not None else None
            )
            if sink is not None and args.keyed is not None and self.rank == 0:  # prune_missing: every attempt's
                for key in args.keyed.removed:  # first transaction deletes them (again: deleting is idempotent)
                    sink.remove_key(key)
            self.records = RecordWriter(
                self.stager, self.current, self.rank, args.output_format, committed, sink,
                sole=self.world_size == 1, stamp=stamp,
                keeps_rows=self.writer,  # a replica's other members: rows checked, not kept (docs/mesh.md)
            )
            member_files = MemberFiles(mesh.position, self.stager.upload_path) if mesh is not None else None
            self.failure_log = FailureLog(
                self.stager, rank=self.rank, attempt=start.attempt, failed_before=failed_before(latest),
                limit=args.failures.limit(self.plan.num_examples), failures_url=job.failures_url,
                original_batch=getattr(self.plan, "original_batch", None),  # a retry's plan keeps the original batches
                keyed=stamp.failure_fields if stamp is not None else None,  # key=: a failure names its key and run
            )
            self.in_flight = InFlight(  # batches in a generation engine (DESIGN §19), when the processor uses one
                self.current, self.work, self.rank_failure,
                torch.inference_mode if args.inference_mode else contextlib.nullcontext,
                self.failure_log.record if args.failures.skip else None, args.failures.batch_timeout,
                learn_budget=args.failures.split_on_oom,  # an engine out of memory restarts with a smaller budget
                claims=dynamic,  # a rank that claims its batches holds no more than its engine runs at once
            )
            self._closing.callback(self.in_flight.close)
            self.context = TorchBatchProcessorContext(
                device=env.device,
                distributed=env.info,
                upload_path=member_files.upload_path if member_files is not None else self.stager.upload_path,
                storage_path=job.storage.url,
                tensorboard_path=job.tensorboard.path,
                metrics_sink=self.work.add_line,
                current=self.current,
                write_rows=self.records.write,
                mesh=mesh.device_mesh if mesh is not None else None,
                mesh_position=mesh.position if mesh is not None else None,
                use_engine=self.in_flight.use,
                generate=self.in_flight.generate,
            )
            # the capabilities: each with its feed side and its commit participant
            failures = args.failures
            lengths = self.plan.lengths if isinstance(self.plan, BucketedPlan) else None
            stored_limits = latest.memory_limits if latest is not None and failures.split_on_oom else None
            self.fitter = BatchFitter.for_job(stored_limits, lengths, device_kind(env.device))
            """What fits in the device's memory (DESIGN §15): it learns only with ``on_oom="split"``."""
            self.summaries = ReducerSummaries(self.context.reducers, job.opener.store, latest, counts=self.writer)
            participants: list[Participant] = [RecordOutputs(self.records, latest)]
            if job.table_commits is not None:
                participants.append(TableOutputs(self.records, job.table_commits))
            if member_files is not None and mesh is not None:
                participants.append(MemberFilesParticipant(member_files, mesh.layout))
            participants += [
                MemoryLimitsParticipant(self.fitter, latest),
                FailingExamplesParticipant(self.failure_log, latest),
                self.summaries,
                # counts nothing unless the processor uses an engine; restores a stop's partial answers
                GenerationParticipant(
                    self.in_flight, latest, job.opener.store.storage, self.rank, start.attempt, job.observer.generation,
                    device_kind(env.device),
                ),
                TimelineParticipant(self.world_size, job.observer),  # last: it times what the others do after a record
            ]
            scheduler = self.scheduler
            commit_call = CommitCall(
                store=job.opener.store, plan=self.plan, start=start, started=job.started, collectives=self.coll,
                call_store=self.call_store, on_background_error=partial(scheduler.post, Decision.FAIL),
                result_json=partial(_result_json, self._result_of),
            )
            self.committer = make_committer(
                commit_call, Participants(participants), self.summaries, self.stager, self.work, job.observer,
                self.rank_failure,
            )
            self._closing.callback(self.committer.shutdown)
        except BaseException:
            self._closing.close()
            raise

    def __enter__(self) -> JobRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.close()

    # ------------------------------------------------------------------------ lifecycle

    def run(self) -> BatchProcessResult:
        """Steps 2 to 6 of the module docstring; the same result on every rank."""
        processor, stop_now = self._build()  # 2.
        announce_start(
            self.job.observer, self.plan, self.start, self.remaining, rank=self.rank, job_name=self.args.job_name,
            world_size=self.world_size, schedule=self.args.schedule, storage_url=self.job.storage.url,
            plan_s=self.job.plan_s, fitter=self.fitter, call=self._describe,
        )
        outcome = None
        if len(self.remaining) or stop_now:
            try:
                outcome = self._process(processor, stop_now)  # 3. to 5.
            except WorkerLostError:
                # a rank lost while this one had failed (mesh=: its peer, ended by the member watch while it waited
                # in a collective with this rank): this rank's own error is the cause, the lost rank its consequence
                if self.rank_failure.failed:
                    self.rank_failure.raise_for([])
                raise
        if outcome is None or not outcome.preempted:
            failed = outcome.summary.failed_examples if outcome is not None else None
            check_max_failures(
                self.args.failures, failed, self.start, self.plan.num_examples, self.job.failures_url
            )
            outcome = self._finish(processor)  # 6.
        self.coll.all_gather(None)  # every rank has published its files: what a rank reads under outputs/
        # once the call returns holds every rank's (Determined's call ends with such a gather too)
        result = self._result_of(outcome.summary, outcome.metrics or {}, preempted=outcome.preempted)
        if self.rank == 0 and self.args.failures.split_on_oom:
            log_memory(result, auto=self.args.max_tokens == AUTO)
        if result.preempted:
            log_preempted(result)
        return result

    def _build(self) -> tuple[TorchBatchProcessor, bool]:
        """The processor (restored), and whether the ranks agreed at once to stop."""
        t0 = time.perf_counter()
        processor, stop_now = build_processor(
            self.args.processor_cls, self.context, self.start.latest, self.job.opener.store, self.coll,
            self.rank_failure, lambda: self.signals.preempt_requested,
        )
        self.work.add_hook_seconds(time.perf_counter() - t0)
        return processor, stop_now

    # ------------------------------------------------------------------------ steps and commits

    def _process(self, processor: TorchBatchProcessor, stop_now: bool) -> Outcome:
        """Runs this rank's batches with their commits, then the closing commit; returns its outcome."""
        scheduler = self.scheduler
        # dynamic: a rank that dies stops the others (engine/schedule/liveness.py)
        peers = watch_peers(self.call_store, self.rank, self.world_size, _PeerLoss(self.rank_failure, scheduler))
        if peers is not None:
            self._closing.callback(peers.close)
        decision = Decision.STOP if stop_now else self._steps(processor)
        if self.in_flight.active:  # the batches in a generation engine: done, or drained within drain_s at a stop
            decision = self._final_drain(processor, decision)
            self.in_flight.close()  # what did not finish is not committed: the resume generates it again
        scheduler.close()
        if peers is not None:
            peers.stop_watching()
        # Determined's semantics: every rank's hook runs at the closing commit (mesh=: every member of a replica)
        lockstep = scheduler.kind == "static" or self.job.mesh is not None
        if decision in (Decision.STOP, Decision.DONE) and (lockstep or self.work.part.num_batches or stop_now):
            self._checkpoint_hook(processor)
        return self.committer.close(processor, preempt=decision is Decision.STOP or self.signals.preempt_requested)

    def _steps(self, processor: TorchBatchProcessor) -> Decision:
        args, env, job = self.args, self.job.env, self.job
        committer, rank_failure, scheduler, signals = self.committer, self.rank_failure, self.scheduler, self.signals
        call_store = env.call_store if self.world_size > 1 else None
        call_id = self.start.call_id
        watchdog = watch_batches(  # batch_timeout: watches until the call ends (a rank whose batches are done still
            args.failures.batch_timeout, self.rank,  # dumps its stacks when another rank's batch times out)
            (lambda: call_store(call_id).clone()) if call_store is not None else None,
        )
        self._closing.callback(watchdog.close)
        dataset, order, kwargs = job.input.feed_parts(scheduler, args.dataloader_kwargs, self.plan)
        mesh = job.mesh
        feed: BatchFeed | ReplicaFeed
        feed = BatchFeed(dataset, self.plan, order, kwargs, env.device, self.fitter, watchdog.watch)
        members: MemberWatch | None = None  # mesh=: a failed member stops its replica (engine/mesh/members.py)
        replica = mesh if mesh is not None and mesh.replica_group is not None else None
        replica_feed: ReplicaFeed | None = None
        if replica is not None:  # the replica's first member loads and sends
            feed = replica_feed = ReplicaFeed(
                feed, replica.replica_group, replica.position.first_rank, rank_failure, scheduler.replica_mark
            )
            assert call_store is not None  # a replica of several ranks: a job of several ranks
            members = MemberWatch(replica.position, call_store(call_id), rank_failure)
            self._closing.callback(members.close)
        call = BatchCall(
            processor, self.current, inference_mode=args.inference_mode, mode=job.autocast, no_grad=mesh is not None
        )
        agree = replica_feed.agree_attempt if replica_feed is not None and args.failures.split_on_oom else None
        guards = guard_batches(  # on_error="skip", on_oom="split" (engine/feed/error_handling.py)
            call, feed, self.plan, args.failures,
            # mesh= with on_oom="split": the members keep an attempt, or split it, together (the exchange after a
            # step's first attempt carries the next step's batch too: engine/feed/replica.py)
            Transactions(self.stager, self.context.reducers, self.rank, agree),
            self.failure_log, self.fitter, Placement(env.device, job.device_prefetch),
        )
        in_flight = self.in_flight
        runner = BatchRunner(call, self.plan, rank_failure, self.work, guards, watchdog.watch, in_flight.owns)
        # a replica's batch comes with its step's message (engine/feed/replica.py), not copied to the device ahead
        prefetch = job.device_prefetch and replica is None
        batches = DevicePrefetcher(feed, env.device, enabled=prefetch, error_of=feed.load_error)
        observer = job.observer
        try:
            with call.inference():  # the loader's workers fork here and keep the mode: they load under it too
                feed.start()
            for step, has_batch in enumerate(scheduler.steps()):
                if has_batch and replica_feed is not None:  # the step's batch; none if a member failed or saw a stop
                    has_batch = scheduler.follow(*replica_feed.exchange())
                if in_flight.active:  # a generation engine: room for the next batch, the finished batches in
                    in_flight.wait_for_room(lambda: signals.preempt_requested)
                # a replica's members run the batch they agreed on, a member that failed since too (its failure
                # reaches them with the next message: none of them waits for it in the model's collectives)
                runs = has_batch and (replica_feed is not None or not rank_failure.failed)
                if runs and not runner.step(batches):
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
                    self._commit(processor)
                elif decision is not Decision.CONTINUE:
                    return decision
            return Decision.DONE
        finally:
            batches.close()
            feed.close()  # stops the loader's worker processes
            runner.close()
            watchdog.steps_done()
            if members is not None:
                members.steps_done()

    def _final_drain(self, processor: TorchBatchProcessor, decision: Decision) -> Decision:
        """When the steps end, the batches still in the rank's generation engine: drained by every rank together,
        committed every ``checkpoint_interval`` delivered batches (:mod:`~torch_batch_process.engine.final_drain`;
        every rank takes part, whatever its steps ended with, so that they leave at the same round with the same
        decision); at a stop, drained within ``drain_s`` and the unfinished answers kept for the closing commit."""
        in_flight, signals, failure, ended = self.in_flight, self.signals, self.rank_failure, decision
        decision = drain_committing(
            in_flight, self.coll, self.args.checkpoint_interval, partial(self._commit, processor), self.committer.poll,
            stopping=lambda: ended is Decision.STOP or signals.preempt_requested,
            failed=lambda: ended is Decision.FAIL or failure.failed,
        )
        if decision is Decision.STOP and not in_flight.drain(in_flight.drain_s):
            in_flight.keep_partial_answers()  # stored with the closing commit
        return decision

    def _commit(self, processor: TorchBatchProcessor) -> None:
        """A regular commit: ``on_checkpoint_start()``, then this rank's vote."""
        self._checkpoint_hook(processor)
        self.committer.commit(processor, preempt=self.signals.preempt_requested)

    def _checkpoint_hook(self, processor: TorchBatchProcessor) -> None:
        """``on_checkpoint_start()`` before a commit (a rank that failed already skips it; the base class's, which does
        nothing, is not entered: its grad mode and timer cost ~5 µs, with tiny batches a commit every ~0.5 ms)."""
        if getattr(processor.on_checkpoint_start, "__func__", None) is TorchBatchProcessor.on_checkpoint_start:
            return
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
            with self._grad_mode():
                hook()
        except Exception as exc:  # noqa: BLE001
            self.rank_failure.record(exc, f"{name}()")
        self.work.add_hook_seconds(time.perf_counter() - t0)

    # ------------------------------------------------------------------------ helpers

    def _grad_mode(self) -> contextlib.AbstractContextManager[Any]:
        """What the hooks run under: ``inference_mode`` as ``process_batch`` (a mesh job: ``no_grad``, see
        :class:`~torch_batch_process.engine.feed.runner.BatchCall`)."""
        if not self.args.inference_mode:
            return contextlib.nullcontext()
        return torch.no_grad() if self.job.mesh is not None else torch.inference_mode()

    def _describe(self) -> dict[str, Any]:
        """Rank 0: the call's arguments, world and plan for ``tbp report`` (:func:`describe_call`)."""
        job = self.job
        return describe_call(
            self.args, self.start, self.plan, world_size=self.world_size, device=job.env.device,
            device_prefetch=job.device_prefetch, storage_url=job.storage.url,
            straggler_ratio=job.observer.options.straggler_ratio,
        )


def _result_json(
    result_of: Callable[..., BatchProcessResult], metrics: dict[str, Any], summary: Summary
) -> dict[str, Any]:
    """The final record's ``result.json``: the result of the call from the final metrics and the summary."""
    return result_of(summary, metrics).to_json()


class _PeerLoss:
    """Rank 0's heartbeat thread found a rank gone: its failure, and every rank stops at its next batch. Holds the two
    parts it needs, never the run."""

    def __init__(self, rank_failure: RankFailure, scheduler: Any) -> None:
        self._rank_failure = rank_failure
        self._scheduler = scheduler

    def __call__(self, error: BaseException) -> None:
        self._rank_failure.record(error, "watching the other ranks' heartbeats")
        self._scheduler.post(Decision.FAIL)
