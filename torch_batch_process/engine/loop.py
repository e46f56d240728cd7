"""The loop: :func:`torch_batch_process` and the lifecycle of one job run.

Lifecycle of a call (every rank runs the same steps, in the same order):

1. Check every argument (before any work or storage access).
2. Join the process group; rank 0 reads the stored job under the job lock: refuse a different job,
   return the stored result of a finished one, repair what a crash left, and tell the plan to all.
3. Build the processor on every rank (``cls(context)``), restore its state, check its reducers.
4. Deal the batches not yet committed round-robin over the ranks; run the same number of steps on
   every rank: ``process_batch(batch, batch_idx)`` with the *global* batch index.
5. Every ``checkpoint_interval`` steps and after the last step: ``on_checkpoint_start()`` on every
   rank, then commit (outputs, progress, reducer and processor states become durable together).
   Between commits, ranks agree at each step boundary whether to continue, to stop (SIGTERM/SIGINT:
   commit and return ``preempted=True``) or to fail (a hook raised on some rank: every rank raises).
6. When every batch is committed: ``on_finish()`` on every rank, a final commit with the reduced
   metrics, and the same :class:`BatchProcessResult` returned on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from torch_batch_process.engine.background import BackgroundWork
from torch_batch_process.engine.checkpoint import (
    OUTPUTS_DIR,
    CheckpointStore,
    CommitRecord,
    JobInfo,
    JobSpec,
    check_fingerprint,
    qualified_name,
)
from torch_batch_process.context import TorchBatchProcessorContext
from torch_batch_process.engine.agreement import Decision, FailureInfo, FailureTracker, StepAgreement
from torch_batch_process.engine.distributed import DistributedEnv, PendingGather
from torch_batch_process.errors import JobMismatchError, StorageError, WorkerFailedError
from torch_batch_process.storage.lock import JobLock, acquire_job_lock
from torch_batch_process.log import setup_logging
from torch_batch_process.observe.metrics import MetricsLog
from torch_batch_process.observe.observer import JobObserver
from torch_batch_process.observe.options import ObserveOptions, resolve_observe_options
from torch_batch_process.outputs.files import OutputStager
from torch_batch_process.engine.preemption import SignalWatcher
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.provenance import merge_entries
from torch_batch_process.engine.ranges import RangeSet
from torch_batch_process.result import BatchProcessResult, to_jsonable
from torch_batch_process.engine.plan import BatchGeometry, RankBatchSampler, ShardPlan, planned_batches
from torch_batch_process.storage.base import Storage
from torch_batch_process.observe.stragglers import RankInterval
from torch_batch_process.observe.tensorboard import temporary_folder, tensorboard_dir
from torch_batch_process.validation import JobArguments, validate_arguments

logger = logging.getLogger(__name__)

MAX_RECORDS_IN_FLIGHT = 4  # rank 0 waits when this many record writes are still queued


def torch_batch_process(
    batch_processor_cls: type[TorchBatchProcessor],
    dataset: Any,
    batch_size: int | None = None,
    max_batches: int | None = None,
    checkpoint_interval: int = 5,
    dataloader_kwargs: dict[str, Any] | None = None,
    distributed_context: Any = None,
    *,
    storage_path: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    job_name: str | None = None,
    resume: bool = True,
    inference_mode: bool = True,
    progress: bool | str | None = None,
    progress_interval: float | None = None,
    tensorboard: bool | None = None,
    profile: bool | dict[str, Any] | None = None,
) -> BatchProcessResult:
    """Processes ``dataset`` with ``batch_processor_cls`` on every rank of the job, resumably.

    Args:
        batch_processor_cls: a :class:`TorchBatchProcessor` subclass (the class, not an instance);
            it is instantiated once per rank as ``cls(context)``.
        dataset: a map-style dataset with ``__len__`` (torch ``Dataset``, list, HF ``datasets.Dataset``...).
        batch_size: examples per batch; ``None`` means ``dataloader_kwargs["batch_size"]``, else 1.
        max_batches: cap on the batches of each rank (the job processes global batches
            ``[0, max_batches * world_size)``); larger than a rank's share: a warning, ignored.
        checkpoint_interval: commit every this many steps (and after the last one).
        dataloader_kwargs: options of ``torch.utils.data.DataLoader`` (``num_workers``,
            ``collate_fn``, ``pin_memory``, ``prefetch_factor``...); no ``shuffle=True``, ``sampler``,
            ``batch_sampler`` or ``drop_last=True``.
        distributed_context: Determined's ``core.DistributedContext`` (or any object with ``get_rank()`` and
            ``get_size()``), or ``None``. The job always runs on ``torch.distributed``; a context given here
            only states the ranks the caller expects, and a mismatch with torch.distributed (or with the
            ``RANK``/``WORLD_SIZE`` environment) is an error raised before any work.
        storage_path: local path or fsspec URL (``s3://bucket/prefix``...) for progress and outputs;
            default ``$TBP_STORAGE_PATH``, else ``./tbp_runs/<job_name>``.
        storage_options: options of the fsspec filesystem (credentials, endpoint...); default
            ``$TBP_STORAGE_OPTIONS`` (JSON), else the filesystem's own environment.
        job_name: name of the job; default ``$TBP_JOB_NAME``, else the script's file stem.
        resume: ``True`` resumes the job stored at ``storage_path``; ``False`` erases what is stored
            there (progress and outputs) and starts afresh.
        inference_mode: run ``process_batch`` under ``torch.inference_mode()`` (default); pass
            ``False`` when the processor needs autograd.
        progress: rank 0's progress display: ``None``/``True``/``"auto"`` (default ``$TBP_PROGRESS``,
            else auto): a tqdm bar when stderr is a terminal, else a plain log line every
            ``progress_interval`` seconds; ``"bar"`` or ``"log"`` to force one; ``False``/``"off"``: none.
        progress_interval: seconds between plain progress lines; default ``$TBP_PROGRESS_INTERVAL``, else 30.
        tensorboard: write TensorBoard event files (metrics, progress, throughput) under
            ``context.get_tensorboard_path()``; ``None`` (default ``$TBP_TENSORBOARD``): when the
            ``tensorboard`` package is installed.
        profile: run ``torch.profiler`` over a few steps and write the trace under the TensorBoard
            path: ``True`` (rank 0, default schedule) or a dict (``ranks``, ``wait``, ``warmup``,
            ``active``...); default ``$TBP_PROFILE``. See :mod:`torch_batch_process.observe.options`.

    Returns:
        The same :class:`BatchProcessResult` on every rank.

    Raises:
        InvalidArgumentError: a bad argument (raised before any work or storage access).
        JobMismatchError: ``storage_path`` holds another job.
        JobLockedError: another job is running on ``storage_path``.
        CheckpointCorruptError: the stored progress cannot be read.
        StorageError: the storage cannot be used.
        WorkerFailedError: another rank failed (the failing rank raises its own exception).
        WorkerLostError: another rank died or stopped answering.
    """
    args = validate_arguments(
        batch_processor_cls,
        dataset,
        batch_size,
        max_batches,
        checkpoint_interval,
        dataloader_kwargs,
        storage_path,
        storage_options,
        job_name,
        resume,
        inference_mode,
    )
    observe = resolve_observe_options(progress, progress_interval, tensorboard, profile)
    with DistributedEnv(expected=distributed_context) as env:
        setup_logging(env.info.rank)
        return _JobRun(args, env, observe).run()


@dataclass
class _StartPlan:
    """What rank 0 found in storage, broadcast to every rank before any work."""

    attempt: int
    next_commit: int
    planned_batches: int
    committed: list[list[int]]
    finished_result: dict[str, Any] | None = None
    previous_world_size: int | None = None
    previous_state_files: list[str | None] = field(default_factory=list)
    frozen_state_files: list[str] = field(default_factory=list)
    reducers: list[dict[str, Any]] | None = None


@dataclass
class _Vote:
    """One rank's contribution to a commit."""

    failure: FailureInfo | None
    preempt: bool
    batches: list[list[int]]
    examples: int
    state_file: str | None
    metrics: list[dict[str, Any]]
    slots: list[Any] | None
    timings: dict[str, float]
    durable: int = -1
    """Rank 0: every commit record up to this number is durable (its stages may be published)."""


@dataclass
class _PendingCommit:
    """A commit whose votes are on their way."""

    number: int
    final: bool
    has_files: bool
    votes: PendingGather


@dataclass
class _PreparedRecord:
    """A commit record ready to be written, with what goes to metrics.jsonl and result.json."""

    record: CommitRecord
    lines: list[dict[str, Any]]
    result: dict[str, Any] | None
    metrics: dict[str, Any] | None


@dataclass
class _Outcome:
    """Rank 0's answer to a commit's votes."""

    failure: FailureInfo | None
    metrics: dict[str, Any] | None = None


class _JobRun:
    """One call of :func:`torch_batch_process` on one rank."""

    def __init__(self, args: JobArguments, env: DistributedEnv, observe: ObserveOptions | None = None) -> None:
        self.args = args
        self.observe_options = observe or ObserveOptions()
        self.env = env
        self.rank = env.info.rank
        self.world_size = env.info.size
        self.coll = env.collectives
        self.failures = FailureTracker(self.rank)
        self.geometry = BatchGeometry(args.dataset_length, args.batch_size)
        self.spec = JobSpec(
            args.dataset_length,
            args.batch_size,
            qualified_name(args.processor_cls),
            args.max_batches,
            qualified_name(type(args.dataset)),
        )
        self.storage = Storage(args.storage_path, args.storage_options)
        self.store = CheckpointStore(self.storage)
        self.lock: JobLock | None = None
        self.metrics_log = MetricsLog(self.storage)
        self.started = time.monotonic()
        # Progress of this attempt.
        self.committed = RangeSet()
        self.interval_batches = RangeSet()
        self.interval_examples = 0
        self.metric_buffer: list[dict[str, Any]] = []
        self.commit_number = 0
        self.commits = 0
        self.batches_processed = 0
        self.examples_processed = 0
        self.timings = {"data": 0.0, "process": 0.0, "commit": 0.0, "hooks": 0.0}
        self.total_timings: dict[str, float] = {}
        self.rank_timings: list[dict[str, float]] = []
        self.tensorboard_path = self._tensorboard_path()
        self.observer = JobObserver(
            self.observe_options,
            rank=self.rank,
            world_size=self.world_size,
            job_name=args.job_name,
            batch_size=args.batch_size,
            tensorboard_dir=self.tensorboard_path,
            storage=self.storage,
            device=env.device,
        )
        self.last_record: CommitRecord | None = None
        self.provenance: list[dict[str, Any]] = []  # rank 0: entries of report_task_using_*(), kept in records
        self.background = BackgroundWork()  # record writes (rank 0) and stage publishing, in order
        self.unpublished: list[int] = []  # commits whose stage of this rank waits for its record
        self.pending_records: list[tuple[int, Future[Any]]] = []  # rank 0: records being written
        self.durable_through = 0  # rank 0: every record up to this commit is written

    # ------------------------------------------------------------------------ lifecycle

    def run(self) -> BatchProcessResult:
        self._warn_max_batches()
        try:
            with SignalWatcher() as signals:  # from here on, SIGTERM/SIGINT mean: commit and stop
                plan = self._open_job()
                self.plan = plan
                if plan.finished_result is not None:
                    return self._stored_result(plan)
                processor, stager = self._build_processor(plan, signals)
                try:
                    shard = ShardPlan(self.committed.complement(plan.planned_batches), self.world_size)
                    self._log_start(plan, shard)
                    self._start_observer(plan, shard)
                    preempted = self._process(processor, stager, shard, signals)
                    metrics = (self.preempt_metrics or {}) if preempted else self._finish(processor, stager, signals)
                finally:
                    stager.close()
            result = self._result(plan, preempted=preempted, metrics=metrics)
            self.observer.finish(result)
            return result
        finally:
            self.background.close()  # before the lock goes: no record write may outlive it
            self.observer.close()
            if self.lock is not None:
                self.lock.release()
            self.metrics_log.close()

    def _warn_max_batches(self) -> None:
        max_batches = self.args.max_batches
        per_rank = -(-self.geometry.num_batches // self.world_size)
        if max_batches is not None and max_batches > per_rank:
            warnings.warn(
                f"max_batches={max_batches} exceeds the {per_rank} batch(es) per rank of this job "
                f"({self.geometry.num_batches} batches over {self.world_size} rank(s)); max_batches is ignored",
                UserWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------- 2. open the stored job

    def _open_job(self) -> _StartPlan:
        """Rank 0 reads, checks and repairs the stored job under the lock; every rank gets the plan."""
        plan: _StartPlan | BaseException
        if self.rank == 0:
            try:
                plan = self._read_plan()
            except Exception as exc:  # noqa: BLE001 - sent to every rank, then raised everywhere
                plan = _picklable(exc)
        else:
            plan = None  # type: ignore[assignment]
        plan = self.coll.broadcast(plan)
        if isinstance(plan, BaseException):
            raise plan
        self.committed = RangeSet.from_json(plan.committed)
        self.commit_number = plan.next_commit - 1
        self.durable_through = self.commit_number  # records of earlier attempts
        if self.world_size > 1 and plan.finished_result is None:
            self._check_shared_storage()
        return plan

    def _read_plan(self) -> _StartPlan:
        self.storage.check()  # unreachable, missing bucket, no permission: a clear error before anything else
        job, latest = self._read_and_check()
        if latest is not None and latest.finished and self.args.resume and latest.result is not None:
            if self.store.unpublished_commits(latest):  # killed while publishing its last outputs
                self.lock = acquire_job_lock(self.storage)
                job, latest = self._read_and_check()
                assert latest is not None
                self.store.repair(latest)
            return _StartPlan(
                attempt=latest.attempt,
                next_commit=latest.commit + 1,
                planned_batches=job.planned_batches if job else 0,
                committed=latest.committed.to_json(),
                finished_result=latest.result,
            )
        self.lock = acquire_job_lock(self.storage)  # the first write to storage
        job, latest = self._read_and_check()  # again, now that no other job can change it
        if not self.args.resume and (job is not None or latest is not None):
            logger.warning("resume=False: erasing the job stored at %s", self.storage.url)
            self.store.erase()
            job, latest = None, None
        self.store.repair(latest)
        if job is None:
            planned = planned_batches(self.geometry.num_batches, self.args.max_batches, self.world_size)
            job = JobInfo(self.spec.to_json(), planned, self.args.job_name, time.time())
            self.store.write_job(job)
        if latest is not None and latest.finished:  # finished, but resume=False was handled above
            latest = None
        self.last_record = latest
        self.provenance = list(latest.provenance) if latest else []
        return _StartPlan(
            attempt=self.store.next_attempt(latest, self.world_size),
            next_commit=(latest.commit if latest else 0) + 1,
            planned_batches=job.planned_batches,
            committed=latest.committed.to_json() if latest else [],
            previous_world_size=latest.world_size if latest else None,
            previous_state_files=list(latest.state_files) if latest else [],
            frozen_state_files=(latest.frozen_state_files + [f for f in latest.state_files if f]) if latest else [],
            reducers=latest.reducers if latest else None,
        )

    def _read_and_check(self) -> tuple[JobInfo | None, CommitRecord | None]:
        job = self.store.load_job()
        latest = self.store.load_latest()
        if self.args.resume and job is not None:
            check_fingerprint(job, self.spec, self.storage.url)
            self.store.check_integrity(latest)  # a damaged checkpoint is an error, never a restart from zero
        if self.args.resume and job is None and (latest is not None or self.store.has_outputs()):
            raise JobMismatchError(
                f"storage_path {self.storage.url!r} holds {'commit records' if latest else 'outputs'} but no job file "
                "(a previous erase was interrupted, or files were removed by hand). Nothing was changed. Pass "
                "resume=False to erase it and start afresh, or use a new storage_path."
            )
        return job, latest

    def _check_shared_storage(self) -> None:
        """Every rank must see the storage rank 0 wrote (a local path must be shared by all nodes)."""
        from torch_batch_process.engine.checkpoint import JOB_FILE

        try:
            visible = self.storage.exists(JOB_FILE)
        except Exception:  # noqa: BLE001
            visible = False
        everyone = self.coll.all_gather(visible)
        if not all(everyone):
            blind = [rank for rank, ok in enumerate(everyone) if not ok]
            raise StorageError(
                f"storage_path {self.storage.url!r} is not shared by all ranks: rank(s) {blind} cannot see what rank "
                "0 wrote there. Use a filesystem mounted on every node (NFS, Lustre...) or an object store URL "
                "(s3://..., gs://...)"
            )

    def _stored_result(self, plan: _StartPlan) -> BatchProcessResult:
        assert plan.finished_result is not None
        logger.info("job at %s is already finished; nothing to do", self.storage.url)
        return BatchProcessResult.from_json(
            plan.finished_result,
            preempted=False,
            finished=True,
            already_finished=True,
            batches_processed=0,
            examples_processed=0,
            batches_skipped=plan.finished_result.get("batches_committed", 0),
            commits=0,
            world_size=self.world_size,
            elapsed_s=time.monotonic() - self.started,
            timings={},
        )

    # ------------------------------------------------------------- 3. build the processor

    def _build_processor(self, plan: _StartPlan, signals: SignalWatcher) -> tuple[TorchBatchProcessor, OutputStager]:
        stager = OutputStager(self.storage, self.rank, plan.next_commit)
        context = TorchBatchProcessorContext(
            device=self.env.device,
            distributed=self.env.info,
            stager=stager,
            storage_path=self.storage.url,
            tensorboard_path=self.tensorboard_path,
            metrics_sink=self.metric_buffer.append,
        )
        self.context = context
        processor: TorchBatchProcessor | None = None
        start = time.perf_counter()
        try:
            processor = self.args.processor_cls(context)
        except Exception as exc:  # noqa: BLE001
            self.failures.record(exc, f"{self.args.processor_cls.__name__}.__init__")
        if processor is not None and not self.failures.failed:
            try:
                self._restore(processor, plan)
            except Exception as exc:  # noqa: BLE001
                self.failures.record(exc, "restoring the processor state")
        self.timings["hooks"] += time.perf_counter() - start
        # The first agreement: a failure, or a SIGTERM that came while the job was opened or the processors
        # were built, stops every rank before its first step.
        answers = self.coll.all_gather((self.failures.info, signals.preempt_requested))
        self.failures.raise_for([info for info, _ in answers])
        self.stop_before_first_step = any(preempt for _, preempt in answers)
        assert processor is not None
        return processor, stager

    def _restore(self, processor: TorchBatchProcessor, plan: _StartPlan) -> None:
        signature = self.context.reducers.signature()
        if plan.reducers is not None and plan.frozen_state_files and plan.reducers != signature:
            raise JobMismatchError(
                f"the processor registers reducers {signature} but the stored job used {plan.reducers}; a resumed "
                "job must wrap the same reducers (same order, names and types). Start afresh with resume=False "
                "or a new storage_path."
            )
        if plan.previous_world_size is None:
            return
        if plan.previous_world_size == self.world_size:
            rel = plan.previous_state_files[self.rank] if self.rank < len(plan.previous_state_files) else None
            if rel:
                state = self.store.load_state(rel)
                if state.get("processor") is not None:
                    processor.load_state_dict(state["processor"])
        elif callable(getattr(type(processor), "merge_state_dicts", None)):
            states = [self.store.load_state(rel).get("processor") if rel else None for rel in plan.previous_state_files]
            merged = type(processor).merge_state_dicts(states)
            if merged is not None:
                processor.load_state_dict(merged)
        elif type(processor).state_dict is not TorchBatchProcessor.state_dict and self.rank == 0:
            logger.warning(
                "the world size changed from %d to %d: processor states are not restored (they belong to the "
                "ranks of the earlier attempt; define the classmethod merge_state_dicts(states) to combine them); "
                "reducer metrics stay exact",
                plan.previous_world_size,
                self.world_size,
            )

    def _tensorboard_path(self) -> Path:
        """``<storage>/tensorboard/rank_<r>`` for local storage, else a fresh local folder uploaded at commits."""
        if self.storage.is_local:
            return self.storage.local_path(tensorboard_dir(self.rank))
        return temporary_folder(self.args.job_name, self.rank)

    # ------------------------------------------------------------- 4-5. steps and commits

    def _process(
        self, processor: TorchBatchProcessor, stager: OutputStager, shard: ShardPlan, signals: SignalWatcher
    ) -> bool:
        """Runs every step with its commits; returns True when the job was preempted.

        A commit begins at its step boundary (hook, state, votes sent) and completes at the next one,
        when the votes have arrived, so that exchanging them overlaps with a step of work (a single
        process has no votes to wait for and completes at once). The last commit, and one at which the
        job stops, complete at once; otherwise rank 0 writes the record in the background.
        """
        self.preempt_metrics: dict[str, Any] | None = None
        if self.stop_before_first_step:  # every rank agreed while building the processors
            self._commit(processor, stager, signals, hook=True)
            return True
        if shard.num_steps == 0:
            return False
        loader_iter = iter(self._make_loader(shard)) if shard.num_batches_of(self.rank) else None
        self.observer.loader_started()  # after the workers' fork: background threads may import now
        agreement = StepAgreement(self.coll)
        observer = self.observer
        interval = self.args.checkpoint_interval
        mode = torch.inference_mode() if self.args.inference_mode else contextlib.nullcontext()
        pending: _PendingCommit | None = None
        try:
            for step in range(shard.num_steps):
                batch_idx = shard.batch_at(step, self.rank)
                if batch_idx is not None and not self.failures.failed:
                    self._run_batch(processor, loader_iter, batch_idx, mode)
                if step >= observer.next_step:  # progress display, profiler: an int compare per step
                    observer.on_step(step)
                if pending is not None:  # the votes of the previous commit: they also carry its stop flags
                    stop = self._complete_commit(pending)
                    pending = None
                    if stop:  # a rank asked to stop: commit this step's work too, and stop
                        self._commit(processor, stager, signals, hook=True)
                        return True
                if (step + 1) % interval == 0 or step == shard.num_steps - 1:
                    agreement.drain()
                    if step == shard.num_steps - 1:
                        return self._commit(processor, stager, signals, hook=True)
                    if self.coll.world_size == 1:  # no votes to wait for: its record goes out now
                        if self._commit(processor, stager, signals, hook=True):
                            return True
                        continue
                    pending = self._begin_commit(processor, stager, signals, hook=True)
                    continue
                decision = agreement.boundary(signals.preempt_requested, self.failures.failed)
                if decision is Decision.FAIL:
                    self._raise_failures(self.coll.all_gather(self.failures.info))
                    raise WorkerFailedError("a rank reported a failure but sent no details")  # pragma: no cover
                if decision is Decision.PREEMPT:
                    self._commit(processor, stager, signals, hook=True)
                    return True
            return False  # pragma: no cover - the last step always commits
        finally:
            del loader_iter  # stops the loader's worker processes

    def _make_loader(self, shard: ShardPlan) -> DataLoader:
        """This rank's DataLoader: the user's options, the library's batch sampler, and on CUDA pinned
        memory unless the user said otherwise (so ``to_device`` copies without blocking)."""
        kwargs = dict(self.args.dataloader_kwargs)
        kwargs["worker_init_fn"] = _WorkerInit(kwargs.get("worker_init_fn"))
        if self.env.device.type == "cuda":
            kwargs.setdefault("pin_memory", True)
        sampler = RankBatchSampler(shard, self.rank, self.geometry)
        return DataLoader(self.args.dataset, batch_sampler=sampler, **kwargs)

    def _run_batch(self, processor: TorchBatchProcessor, loader_iter: Any, batch_idx: int, mode: Any) -> None:
        t0 = time.perf_counter()
        try:
            batch = next(loader_iter)
        except Exception as exc:  # noqa: BLE001 - a failing dataset/collate_fn fails the job cleanly
            self.failures.record(exc, f"loading batch {batch_idx}")
            return
        t1 = time.perf_counter()
        try:
            with mode:
                processor.process_batch(batch, batch_idx)
        except Exception as exc:  # noqa: BLE001
            self.failures.record(exc, f"process_batch(batch_idx={batch_idx})")
            return
        finally:
            t2 = time.perf_counter()
            self.timings["data"] += t1 - t0
            self.timings["process"] += t2 - t1
        self.interval_batches.add(batch_idx)
        self.interval_examples += len(self.geometry.examples(batch_idx))

    def _commit(
        self,
        processor: TorchBatchProcessor,
        stager: OutputStager,
        signals: SignalWatcher,
        *,
        hook: bool,
        final: bool = False,
    ) -> bool:
        """Commits what every rank did since the last commit, now. Returns True when a rank asked to stop.

        Raises on every rank when any rank failed, before anything becomes durable. When the job stops
        at this commit (a rank asked to stop, or it is the final one), its record is written and its
        outputs are published before this returns.
        """
        pending = self._begin_commit(processor, stager, signals, hook=hook, final=final)
        return self._complete_commit(pending)

    def _begin_commit(
        self,
        processor: TorchBatchProcessor,
        stager: OutputStager,
        signals: SignalWatcher,
        *,
        hook: bool,
        final: bool = False,
    ) -> _PendingCommit:
        """This rank's part of a commit: the hook, its outputs and state saved, its vote sent."""
        t0 = time.perf_counter()
        number = self.commit_number + 1
        if hook and not self.failures.failed:
            try:
                processor.on_checkpoint_start()
            except Exception as exc:  # noqa: BLE001
                self.failures.record(exc, "on_checkpoint_start()")
        t_hook = time.perf_counter()
        state_file, slots = self._save_rank_state(number, processor, stager, final=final)
        has_files = stager.has_files
        stager.advance(number + 1)  # what is written from now on belongs to the next commit
        self.commit_number = number
        self.timings["hooks"] += t_hook - t0
        self.timings["commit"] += time.perf_counter() - t_hook
        timings = dict(self.timings)
        self.timings = {key: 0.0 for key in self.timings}
        vote = _Vote(
            failure=self.failures.info,
            preempt=signals.preempt_requested,
            batches=self.interval_batches.to_json(),
            examples=self.interval_examples,
            state_file=state_file,
            metrics=self.metric_buffer[:],
            slots=slots,
            timings=timings,
            durable=self.durable_through if self.rank == 0 else -1,
        )
        self.metric_buffer.clear()
        self.interval_batches = RangeSet()
        self.interval_examples = 0
        return _PendingCommit(number, final, has_files, self.coll.start_all_gather(vote))

    def _complete_commit(self, pending: _PendingCommit) -> bool:
        """Every rank's votes for a commit arrived: fail, or make it durable. Returns True to stop."""
        t0 = time.perf_counter()
        number, final = pending.number, pending.final
        votes: list[_Vote] = pending.votes.wait()
        self._raise_failures([v.failure for v in votes])
        self._account(votes)  # every rank keeps the same totals
        self._publish_unpublished(through=votes[0].durable)  # stages whose records rank 0 has written
        if pending.has_files:
            self.unpublished.append(number)
        preempted = any(v.preempt for v in votes)
        if final or preempted:
            metrics = self._commit_now(number, votes, final=final)
            self._publish_unpublished(through=number, wait=True)
        else:
            metrics = None
            if self.rank == 0:
                prepared = self._prepare_record(number, votes, final=False)
                metrics = prepared.metrics
                self._write_record_in_background(prepared)
        self.final_metrics = metrics
        self.timings["commit"] += time.perf_counter() - t0
        self.observer.on_commit(
            intervals=[RankInterval(sum(b - a for a, b in v.batches), v.examples, v.timings) for v in votes],
            own_records=votes[self.rank].metrics,
            batches_committed=len(self.committed),
            examples_committed=self.geometry.count_examples(self.committed),
            metrics=metrics,
        )
        if preempted and not final:
            self.preempt_metrics = metrics
        return preempted

    def _raise_failures(self, infos: list[FailureInfo | None]) -> None:
        """If a rank failed: finish what is already durable on every rank, then raise on every rank.

        Each rank completes its background work (rank 0: the last record; all: publications); when
        every rank did, every earlier record is durable and each rank publishes its pending stages,
        so that ``outputs/`` shows everything committed. Then the failing rank raises its own error,
        the others :class:`WorkerFailedError`.
        """
        if not any(infos):
            return
        try:
            self.background.settle()
            settled = True
        except Exception as exc:  # noqa: BLE001 - the job fails anyway; the next start repairs
            logger.warning("rank %d: completing earlier commits failed: %s", self.rank, exc)
            settled = False
        if all(self.coll.all_gather(settled)):  # rank 0 settled: every record it queued is durable
            try:
                self._publish_unpublished(through=self.commit_number, wait=True)
            except Exception as exc:  # noqa: BLE001
                logger.warning("rank %d: publishing committed outputs failed (the next start will): %s", self.rank, exc)
        self.failures.raise_for(infos)

    def _save_rank_state(
        self, number: int, processor: TorchBatchProcessor, stager: OutputStager, *, final: bool
    ) -> tuple[str | None, list[Any] | None]:
        """Settles this rank's part before the vote: earlier background work, uploads, state file."""
        if self.failures.failed:
            return None, None
        try:
            self.background.check()  # an earlier record or publication failed? (never waits)
            if self.rank == 0:
                self._records_durable()
        except Exception as exc:  # noqa: BLE001 - e.g. an earlier record could not be written
            self.failures.record(exc, "completing an earlier commit (record or publication)")
            return None, None
        try:
            stager.flush()
            reducers = self.context.reducers
            processor_state = processor.state_dict()
            if reducers.wrapped or processor_state is not None:
                slot = reducers.per_slot_states()
                state_file = self.store.write_state(number, self.rank, slot, processor_state)
                return state_file, (slot if final else None)
        except Exception as exc:  # noqa: BLE001
            self.failures.record(exc, f"commit {number} (saving outputs and state)")
        return None, None

    def _commit_now(self, number: int, votes: list[_Vote], *, final: bool) -> dict[str, Any] | None:
        """Rank 0 writes record ``number`` now and tells every rank the outcome (the job stops after it)."""
        outcome: _Outcome
        own_error: BaseException | None = None
        if self.rank == 0:
            try:
                self.background.settle()  # earlier records first
                self._records_durable()
                prepared = self._prepare_record(number, votes, final=final)
                self._persist_record(prepared)
                self.durable_through = number
                outcome = _Outcome(failure=None, metrics=prepared.metrics)
            except Exception as exc:  # noqa: BLE001 - sent to every rank
                own_error = exc
                outcome = _Outcome(failure=FailureInfo(0, f"writing commit {number}", type(exc).__name__, str(exc), ""))
        else:
            outcome = None  # type: ignore[assignment]
        outcome = self.coll.broadcast(outcome)
        if outcome.failure is not None:
            if own_error is not None:
                raise own_error
            raise WorkerFailedError(f"{outcome.failure.describe()}; the commit did not happen. Run the job again to resume.")
        return outcome.metrics

    def _publish_unpublished(self, *, through: int, wait: bool = False) -> None:
        """Publishes this rank's stages of commits ``<= through`` (records durable), in the background
        unless ``wait``."""
        ready = [number for number in self.unpublished if number <= through]
        self.unpublished = [number for number in self.unpublished if number > through]
        for number in ready:
            self.background.submit(f"publishing the outputs of commit {number}", self.store.publish, number, self.rank)
        if wait:
            self.background.settle()

    def _write_record_in_background(self, prepared: _PreparedRecord) -> None:
        """Rank 0: queues the record write; waits only when several are still queued (slow storage)."""
        while len(self.pending_records) >= MAX_RECORDS_IN_FLIGHT:
            self.pending_records[0][1].result()
            self._records_durable()
        number = prepared.record.commit
        future = self.background.submit(f"writing commit record {number}", self._persist_record, prepared)
        self.pending_records.append((number, future))

    def _records_durable(self) -> None:
        """Rank 0: advances ``durable_through`` over the record writes that finished (never waits)."""
        while self.pending_records and self.pending_records[0][1].done():
            number, future = self.pending_records.pop(0)
            if future.exception() is None:
                self.durable_through = number
            else:
                self.pending_records.insert(0, (number, future))
                raise future.exception()  # type: ignore[misc]

    def _account(self, votes: list[_Vote]) -> None:
        """Adds the votes of a commit to the totals (an error afterwards fails the whole call anyway)."""
        self.commits += 1
        if len(self.rank_timings) != len(votes):
            self.rank_timings = [{} for _ in votes]
        for v, rank_timings in zip(votes, self.rank_timings):
            self.committed.update(RangeSet.from_json(v.batches))
            self.batches_processed += sum(b - a for a, b in v.batches)
            self.examples_processed += v.examples
            for key, value in v.timings.items():
                self.total_timings[key] = self.total_timings.get(key, 0.0) + value
                rank_timings[key] = rank_timings.get(key, 0.0) + value

    def _prepare_record(self, number: int, votes: list[_Vote], *, final: bool) -> _PreparedRecord:
        """Rank 0, main thread: the record of commit ``number``, its metrics and JSONL lines."""
        committed = RangeSet(self.committed.ranges())  # a snapshot: the loop goes on while it is written
        reducers = self.context.reducers
        preempting = any(v.preempt for v in votes)
        metrics: dict[str, Any] | None = None
        state_files = [v.state_file for v in votes]

        def reduce() -> dict[str, Any]:
            live = [v.slots for v in votes] if final else [self.store.load_state(f)["reducers"] for f in state_files if f]
            frozen = [self.store.load_state(f)["reducers"] for f in self.plan.frozen_state_files]
            return reducers.cross_slot_reduce(frozen + [s for s in live if s is not None])

        if reducers.wrapped and (final or preempting):
            metrics = reduce()
        elif final:
            metrics = {}
        elif reducers.wrapped:
            metrics = self.observer.interim_metrics(reduce)  # "metrics so far", within a time budget
        observed_stats, observed_lines = self.observer.on_record(
            batches_committed=len(committed),
            examples_committed=self.geometry.count_examples(committed),
            batches_processed=self.batches_processed,
            examples_processed=self.examples_processed,
            preempted=preempting,
            last=final or preempting,
            metrics=metrics,
        )
        result = None
        if final:
            result = self._result(self.plan, preempted=False, metrics=metrics or {}).to_json()
        record = CommitRecord(
            commit=number,
            attempt=self.plan.attempt,
            world_size=self.world_size,
            committed=committed,
            state_files=state_files,
            frozen_state_files=list(self.plan.frozen_state_files),
            reducers=reducers.signature(),
            finished=final,
            result=result,
            provenance=list(self.provenance),
            stats={
                "batches_committed": len(committed),
                "examples_committed": self.geometry.count_examples(committed),
                "planned_batches": self.plan.planned_batches,
                **observed_stats,
            },
        )
        lines = [line for v in votes for line in v.metrics]
        self.provenance = merge_entries(self.provenance, [line["metrics"] for line in lines if line["group"] == "provenance"])
        if metrics is not None:
            lines.append({"group": "reduced", "steps_completed": len(committed), "rank": 0, "metrics": to_jsonable(metrics)})
        lines.extend(observed_lines)
        return _PreparedRecord(record, lines, result, metrics)

    def _persist_record(self, prepared: _PreparedRecord) -> None:
        """Rank 0 (background thread, or main thread when stopping): the commit point, then conveniences."""
        record = prepared.record
        if self.lock is not None:
            self.lock.check()
        self.store.write_record(record)
        try:
            self.metrics_log.append(prepared.lines, commit=record.commit, attempt=self.plan.attempt)
            if prepared.result is not None:
                self.store.write_result(prepared.result)
            self.store.collect_garbage(record, self.last_record)
        except Exception as exc:  # noqa: BLE001 - the commit is durable; these are conveniences
            logger.warning("commit %d is durable, but writing its metrics or cleaning up failed: %s", record.commit, exc)
        self.last_record = record

    # ------------------------------------------------------------------- 6. finish

    def _finish(self, processor: TorchBatchProcessor, stager: OutputStager, signals: SignalWatcher) -> dict[str, Any]:
        """``on_finish()`` on every rank, then the final commit with the reduced metrics."""
        t0 = time.perf_counter()
        try:
            processor.on_finish()
        except Exception as exc:  # noqa: BLE001
            self.failures.record(exc, "on_finish()")
        self.timings["hooks"] += time.perf_counter() - t0
        self._commit(processor, stager, signals, hook=False, final=True)
        return self.final_metrics or {}

    # ------------------------------------------------------------------- results

    def _result(self, plan: _StartPlan, *, preempted: bool, metrics: dict[str, Any]) -> BatchProcessResult:
        committed = self.committed
        skipped = len(RangeSet.from_json(plan.committed))
        result = BatchProcessResult(
            metrics=metrics,
            preempted=preempted,
            finished=not preempted and len(committed) >= plan.planned_batches,
            storage_path=self.storage.url,
            outputs_path=self.storage.url_of(OUTPUTS_DIR),
            num_batches=plan.planned_batches,
            num_examples=min(plan.planned_batches * self.args.batch_size, self.args.dataset_length),
            batches_committed=len(committed),
            examples_committed=self.geometry.count_examples(committed),
            batches_processed=self.batches_processed,
            examples_processed=self.examples_processed,
            batches_skipped=skipped,
            attempt=plan.attempt,
            world_size=self.world_size,
            commits=self.commits,
            elapsed_s=time.monotonic() - self.started,
            timings={key: round(value, 6) for key, value in self.total_timings.items()},
            timings_per_rank=[{key: round(value, 6) for key, value in t.items()} for t in self.rank_timings],
        )
        if preempted:
            logger.warning(
                "preempted: %d of %d batches committed; run the same command again to resume", len(committed), plan.planned_batches
            )
        return result

    def _start_observer(self, plan: _StartPlan, shard: ShardPlan) -> None:
        """Progress display, TensorBoard, profiler, stragglers (see :mod:`torch_batch_process.observe.observer`)."""
        self.observer.start(
            total_batches=plan.planned_batches,
            total_examples=min(plan.planned_batches * self.args.batch_size, self.args.dataset_length),
            committed_batches=len(self.committed),
            committed_examples=self.geometry.count_examples(self.committed),
            remaining_batches=shard.num_remaining,
            previous_stats=self.last_record.stats if self.last_record is not None else None,
        )

    def _log_start(self, plan: _StartPlan, shard: ShardPlan) -> None:
        if self.rank != 0:
            return
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        restart_note = f" (torchrun restart {restart})" if restart and restart != "0" else ""
        done = len(self.committed)
        if done:
            first = shard.batch_at(0, 0)
            logger.info(
                "job %s attempt %d%s: resuming at batch %s; %d of %d batches already committed, %d to go on %d rank(s); storage %s",
                self.args.job_name,
                plan.attempt,
                restart_note,
                first,
                done,
                plan.planned_batches,
                shard.num_remaining,
                self.world_size,
                self.storage.url,
            )
        else:
            logger.info(
                "job %s attempt %d%s: %d examples in %d batches of %d on %d rank(s); storage %s",
                self.args.job_name,
                plan.attempt,
                restart_note,
                self.args.dataset_length,
                plan.planned_batches,
                self.args.batch_size,
                self.world_size,
                self.storage.url,
            )


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (to be re-raised on every rank), else a stand-in with its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling problem
        return WorkerFailedError(f"rank 0 failed while opening the job: {type(exc).__name__}: {exc}")


class _WorkerInit:
    """DataLoader worker initializer: workers ignore SIGINT/SIGTERM (the main process stops them
    after committing), then run the user's ``worker_init_fn``."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.user_fn is not None:
            self.user_fn(worker_id)
