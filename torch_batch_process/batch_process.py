"""The public entry point, :func:`torch_batch_process`: checks every argument, joins the process group, and
runs the job's lifecycle (:mod:`torch_batch_process.engine.loop`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch_batch_process import settings
from torch_batch_process.arguments import DEFAULT_BUCKET_WINDOW
from torch_batch_process.engine.distributed import DistributedEnv
from torch_batch_process.engine.loop import run_job
from torch_batch_process.engine.mesh.groups import check_job_mesh
from torch_batch_process.engine.same_call import call_values, check_same_call
from torch_batch_process.engine.schedule.preemption import SignalWatcher
from torch_batch_process.environment import write_launch_state
from torch_batch_process.failure_options import validate_failure_options
from torch_batch_process.log import setup_logging
from torch_batch_process.lost_workers import one_line_for_a_lost_peer
from torch_batch_process.observe.options import resolve_observe_options
from torch_batch_process.outputs.keyed.options import check_keyed_options
from torch_batch_process.outputs.tables.base import TableTarget
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.result import BatchProcessResult
from torch_batch_process.validation import validate_arguments

if TYPE_CHECKING:
    from torch_batch_process.engine.plan.retry import Retry

__all__ = ["torch_batch_process"]


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
    schedule: str = "static",
    bucket_by: Sequence[int] | Callable[[int], int] | None = None,
    bucket_window: int = DEFAULT_BUCKET_WINDOW,
    max_tokens: int | str | None = None,
    device_prefetch: bool | None = None,
    autocast: str | None = None,
    output_format: str = "parquet",
    table: TableTarget | None = None,
    on_error: str = "raise",
    max_failures: int | float | None = None,
    batch_timeout: float | None = None,
    retry_failed: bool = False,
    on_oom: str = "split",
    key: str | Callable[[Any], Any] | None = None,
    content: Sequence[str] | Callable[[Any], Any] | None = None,
    version: Any = None,
    incremental: bool = False,
    on_change: str = "refuse",
    prune_missing: bool = False,
    mesh: dict[str, int] | None = None,
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
        inference_mode: run ``process_batch``, the loading of its batch in the main process, and the hooks
            ``on_checkpoint_start``/``on_finish`` (which handle its tensors) under ``torch.inference_mode()``
            (default); pass ``False`` when the processor needs autograd.
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
        schedule: ``"static"`` (default, Determined's behaviour): batches dealt round-robin, ranks in lockstep;
            ``"dynamic"``: a free rank takes the next batch, so a slow batch or rank never stalls the others
            (see :mod:`torch_batch_process.engine.schedule.scheduler`).
        bucket_by: the length of each example (a sequence of ints, or a callable ``index -> int``): batches
            then hold examples of similar length, sorted inside windows of ``bucket_window * batch_size``
            consecutive examples, largest batches first (see :mod:`torch_batch_process.engine.plan.bucketing`;
            cheap ways to get lengths: :mod:`torch_batch_process.lengths`). ``context.batch_indices`` tells
            which examples a batch holds. The plan is part of the job's fingerprint.
        bucket_window: batches' worth of consecutive examples sorted together (default 100).
        max_tokens: with ``bucket_by``, a batch holds as many examples (at most ``batch_size``) as keep
            ``len(batch) * max(length in batch) <= max_tokens``; batch sizes vary. ``"auto"``: the job finds the
            budget itself (with ``on_oom="split"``): batches of ``batch_size`` (give one larger than what fits)
            sorted by length, largest first, cut into parts that fit as it learns from out-of-memory errors
            (see :mod:`torch_batch_process.engine.feed.fitting`); the plan and fingerprint are those of ``None``.
        device_prefetch: on CUDA (default there), the next batch is copied to the device on a side stream while
            the current one runs, and ``process_batch`` receives it already on the device (``to_device`` is then
            a no-op). ``False`` turns it off; ``True`` elsewhere does nothing.
        autocast: ``None`` (default), ``"bf16"`` or ``"fp16"``: ``process_batch`` runs under ``torch.autocast``
            with that dtype on the rank's device.
        output_format: format of the shards ``context.write()`` stores: ``"parquet"`` (default) or ``"jsonl"``
            (see :func:`torch_batch_process.read_outputs`). Part of the job's fingerprint.
        table: a table that receives the ``context.write()`` rows instead of shards, exactly once:
            ``tables.delta(uri)``, ``tables.iceberg(identifier, catalog=...)`` or ``tables.lance(uri)`` (see
            :mod:`torch_batch_process.tables`; each needs its extra). Checked before any work; part of the job's
            fingerprint.
        on_error: ``"raise"`` (default): an exception in loading or ``process_batch`` fails the job. ``"skip"``: a
            failing batch is retried in halves down to single examples; those that still fail are recorded in
            ``<storage_path>/failures/`` (``tbp failures``) and skipped (see
            :mod:`torch_batch_process.engine.feed.failing_examples`).
        max_failures: with ``"skip"``: the most examples that may fail, an int count or a float fraction of the
            examples; past it the job fails with :class:`TooManyFailuresError` (resumable). ``None``: no limit.
        batch_timeout: seconds a batch may run, or take to load; a longer one makes the ranks dump their Python
            stacks to the log and the job fail with :class:`BatchTimeoutError` (see
            :mod:`torch_batch_process.engine.feed.watchdog`).
        retry_failed: on a finished job: process only its recorded failures, as a retry job stored in
            ``<storage_path>/retries/<k>/``; those that succeed are cleared from the failures, the result is the
            retry's (see :mod:`torch_batch_process.engine.plan.retry`).
        on_oom: ``"split"`` (default): a batch whose ``process_batch`` (or copy to the device) runs out of the
            device's memory (``torch.OutOfMemoryError``...) runs in parts that fit, with the outputs of the
            batch run whole, and the job learns what fits, per length range with ``bucket_by``: later batches
            are cut before they run, on every rank and after a resume; one example that does not fit alone is a
            failing example with ``on_error="skip"``, else :class:`ExampleTooLargeError`. ``"raise"``: an
            out-of-memory error is an error like any other (see :mod:`torch_batch_process.engine.feed.oom`).
        key: makes the job *keyed* (DESIGN §21, ``docs/incremental.md``): the name of a field of each example (a
            dict; a column of a streamed source), or a function of the example, giving its key (an ``int`` or a
            ``str``, unique in the dataset: duplicates are refused before any work). Every row ``context.write()``
            stores then carries the key, ``_tbp_hash`` (the example's content hash), ``_tbp_version`` and ``_tbp_run``.
        content: what of an example is hashed: ``None`` (the whole example), a list of field names, or a function
            of the example.
        version: what the outputs depend on besides the examples (a model revision, a prompt's name: any JSON
            value, NaN excepted); stored with every row, in a digest with the processor's class (and a
            ``generation.Generate`` processor's model, sampling, prompt...): a changed one is handled by ``on_change``.
        incremental: on a finished keyed job, process only the examples whose key is new, whose content changed,
            or that failed, as the job's next run (``<storage_path>/retries/<k>/``); ``read_outputs`` then gives
            every key once, with its newest values (see :mod:`torch_batch_process.engine.plan.incremental`).
        on_change: rows stored by another ``version``: ``"refuse"`` (default: the incremental run raises
            :class:`VersionChangedError` naming what changed, before any work) or ``"recompute"`` (processed
            again; with ``incremental=True`` only).
        prune_missing: with ``incremental=True``, the stored keys that the dataset no longer has leave the outputs
            (shards: hidden from ``read_outputs``; tables: deleted in the run's first transaction); default
            ``False``: they are counted (``removed``) and kept.
        mesh: one model over several ranks (DESIGN §18, docs/mesh.md): a dict of dimension names to sizes, the outer
            one the replicas (data parallel; ``-1``: what the world size leaves), e.g. ``{"replica": -1, "tp": 2}``.
            Batches are dealt over the replicas, every rank of a replica gets the same batch (loaded by its first
            rank and broadcast), ``context.mesh`` is a torch ``DeviceMesh`` with these names, and a replica's outputs
            and metrics count once, from its writer (its last rank, ``context.is_writer``). ``None`` (default): every
            rank is a replica of its own.

    Returns:
        The same :class:`BatchProcessResult` on every rank.

    Raises:
        InvalidArgumentError: a bad argument (raised before any work or storage access).
        JobMismatchError: ``storage_path`` holds another job.
        DuplicateKeyError: ``key=``: two examples have the same key (an :class:`InvalidArgumentError`).
        VersionChangedError: ``incremental=True``: stored rows have another ``version`` and ``on_change="refuse"``
            (a :class:`JobMismatchError`).
        JobLockedError: another job is running on ``storage_path``.
        CheckpointCorruptError: the stored progress cannot be read.
        StorageError: the storage cannot be used.
        WorkerFailedError: another rank failed (the failing rank raises its own exception).
        WorkerLostError: another rank died or stopped answering.
        BatchTimeoutError: a batch ran longer than ``batch_timeout``.
        TooManyFailuresError: more examples failed than ``max_failures``.
        ExampleTooLargeError: one example does not fit in the device's memory (``on_oom="split"``, without
            ``on_error="skip"``).
    """
    # every TBP_* variable, read and checked once: a bad one fails the call before any work
    with settings.in_force(settings.read_settings()):
        failures = validate_failure_options(on_error, max_failures, batch_timeout, retry_failed, on_oom)
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
            schedule=schedule,
            bucket_by=bucket_by,
            bucket_window=bucket_window,
            max_tokens=max_tokens,
            device_prefetch=device_prefetch,
            autocast=autocast,
            output_format=output_format,
            failures=failures,
            table=table,
            mesh=mesh,
        )
        keyed = check_keyed_options(
            key, content, version, incremental, on_change, prune_missing=prune_missing,
            processor=args.processor_cls,
            dataset=dataset, autocast=autocast, inference_mode=args.inference_mode,
            retry_failed=failures.retry_failed, table=table,
        )
        args = dataclasses.replace(args, keyed=keyed)
        observe = resolve_observe_options(progress, progress_interval, tensorboard, profile)
        # SIGTERM/SIGINT mean "commit and stop" from here on, the join and the job's opening included: a rank
        # signalled before its first step keeps joining, and every rank agrees to stop before that step
        with one_line_for_a_lost_peer(), SignalWatcher() as signals, DistributedEnv(
            expected=distributed_context, preempted=lambda: signals.preempt_requested
        ) as env:
            setup_logging(env.info.rank)
            check_same_call(call_values(args), env.collectives)  # before any work: every rank, the same error
            if args.mesh is not None:  # the world fits the mesh: before a keyed job's or a retry's planning
                check_job_mesh(args.mesh, env.info.size, env.device)
            tell_launcher = write_launch_state if env.info.local_rank == 0 else (lambda state: None)
            tell_launcher("running")
            try:
                if failures.retry_failed:
                    from torch_batch_process.engine.plan.retry import prepare_retry

                    retry = prepare_retry(args, env.collectives)
                    result = _as_the_jobs(run_job(args, env, observe, signals, retry), retry)
                elif keyed is not None:  # key=: the job's own run, or an incremental run (engine/plan/incremental)
                    from torch_batch_process.engine.plan.incremental import prepare_incremental

                    run = prepare_incremental(args, env.collectives)
                    result = run_job(args, env, observe, signals, run)
                    if run is not None and run.args.keyed is not None:
                        result = dataclasses.replace(_as_the_jobs(result, run), increment=run.args.keyed.increment)
                else:
                    result = run_job(args, env, observe, signals)
            except BaseException:
                tell_launcher("failed")
                raise
            tell_launcher("finished" if result.finished else "preempted")  # the launcher words a late Ctrl-C by it
            return result


def _as_the_jobs(result: BatchProcessResult, run: Retry) -> BatchProcessResult:
    """The result of a run stored in ``retries/<k>/`` (``retry_failed=True``, ``incremental=True``) with the job's
    storage path: its rows are the job's (published to the job's ``outputs/``), so ``read_outputs(result.storage_path)``
    reads them there (the run's folder holds its commit records, not its shards)."""
    parent = getattr(run.storage, "parent", None)  # a NestedStorage below the job's storage
    return result if parent is None else dataclasses.replace(result, storage_path=parent.url)
