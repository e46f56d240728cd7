"""What a call tells the user besides the observer's progress: a ``max_batches`` that cannot apply, the start (or
resume) line, what the job learned about the device's memory, and how to go on after a preemption."""

from __future__ import annotations

import logging
import os
import platform
import socket
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torch_batch_process.arguments import JobArguments
from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.jobstore.opening import Start
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.observe.observer import JobObserver
from torch_batch_process.result import BatchProcessResult, to_jsonable
from torch_batch_process.version import __version__

__all__ = [
    "announce_start", "describe_call", "log_memory", "log_preempted", "log_start", "start_observing", "warn_max_batches"
]

logger = logging.getLogger(__name__)


def warn_max_batches(plan: Plan, max_batches: int | None, world_size: int) -> None:
    """Warns (naming ``max_batches``) when it exceeds what each rank has: it is then ignored."""
    per_rank = -(-plan.num_batches // world_size)
    if max_batches is not None and max_batches > per_rank:
        warnings.warn(
            f"max_batches={max_batches} exceeds the {per_rank} batch(es) per rank of this job "
            f"({plan.num_batches} batches over {world_size} rank(s)); max_batches is ignored",
            UserWarning,
            stacklevel=5,
        )


def announce_start(
    observer: JobObserver,
    plan: Plan,
    start: Start,
    remaining: RangeSet,
    *,
    rank: int,
    job_name: str,
    world_size: int,
    schedule: str,
    storage_url: str,
    plan_s: float,
    fitter: BatchFitter,
    call: Callable[[], dict[str, Any]],
) -> None:
    """What this call starts with: told to the rank's observer on every rank, and logged by rank 0 (see
    :func:`log_start` for the arguments; ``fitter``: the rank's memory limits (learned with ``on_oom="split"``);
    ``call``: makes rank 0's description of the call for ``tbp report``, :func:`describe_call`)."""
    start_observing(observer, plan, start, remaining)
    if rank == 0:
        observer.describe_job(call())
        log_start(
            job_name=job_name, start=start, plan=plan, remaining=remaining, world_size=world_size,
            schedule=schedule, storage_url=storage_url, plan_s=plan_s,
        )
        if fitter.active and remaining:
            logger.info(
                "memory limits learned by earlier attempts, used to cut batches before they run: %s",
                fitter.limits.describe(),
            )


def start_observing(observer: JobObserver, plan: Plan, start: Start, remaining: RangeSet) -> None:
    """Tells the observer what the job holds, what earlier calls committed and what this call has to do."""
    committed = start.latest.committed if start.latest else RangeSet()
    observer.start(
        total_batches=plan.num_batches,
        total_examples=plan.num_examples,
        committed_batches=len(committed),
        committed_examples=plan.count_examples(committed),
        remaining_batches=len(remaining),
        previous_stats=start.latest.stats if start.latest is not None else None,
    )


def log_start(
    *, job_name: str, start: Start, plan: Plan, remaining: RangeSet, world_size: int, schedule: str, storage_url: str,
    plan_s: float,
) -> None:
    """Rank 0's first line: the plan (fresh job) or where it resumes, the world, the storage, the plan's cost."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    note = f" (torchrun restart {restart})" if restart and restart != "0" else ""
    done = plan.num_batches - len(remaining)
    where = f"on {world_size} rank(s), schedule {schedule}; storage {storage_url}"
    if plan_s >= 0.01:
        where += f"; plan computed in {plan_s:.2f} s"
    if done and not remaining:
        logger.info(
            "job '%s' attempt %d%s: all %d batches already committed, none to go; finishing the job %s",
            job_name, start.attempt, note, plan.num_batches, where,
        )
    elif done:
        first = next(iter(remaining))
        logger.info(
            "job '%s' attempt %d%s: resuming at batch %s; %d of %d batches already committed, %d to go %s",
            job_name, start.attempt, note, first, done, plan.num_batches, len(remaining), where,
        )
    else:
        logger.info("job '%s' attempt %d%s: %s %s", job_name, start.attempt, note, plan.describe(), where)


def log_memory(result: BatchProcessResult, auto: bool) -> None:
    """Rank 0, at the end of a call that did work: what the job learned about the device's memory, in one line
    (also in ``result.memory_limits`` and ``tbp status``)."""
    limits = result.memory_limits
    if limits is not None:
        budget = f"; max_tokens learned: {limits['budget']:,}" if auto and limits.get("budget") else ""
        logger.info(
            "memory: %s%s (this call: %d out-of-memory error(s), %d batch(es) run in parts)",
            limits["text"], budget, result.ooms, result.split_batches,
        )
    elif auto:
        logger.info("memory: max_tokens='auto' met no out-of-memory error: every batch ran whole")
    budget = result.generation_budget
    if budget is not None:
        logger.info(
            "memory: the generation engine's budget learned: KV cache %s tokens, %s tokens per step (%d "
            "out-of-memory error(s) over all attempts); a resume starts its engines within it",
            f"{budget['cache_tokens']:,}", f"{budget['batch_tokens']:,}", budget.get("ooms", 0),
        )


def describe_call(
    args: JobArguments,
    start: Start,
    plan: Plan,
    *,
    world_size: int,
    device: torch.device,
    device_prefetch: bool,
    storage_url: str,
    straggler_ratio: float,
) -> dict[str, Any]:
    """The call's arguments, world and plan as JSON-able values: stored once per attempt (group ``job`` of
    ``metrics.jsonl``) for ``tbp report``. Callables (a ``collate_fn``) are named by module and qualified name."""
    failures = args.failures
    arguments = {
        "batch_size": args.batch_size,
        "max_batches": args.max_batches,
        "checkpoint_interval": args.checkpoint_interval,
        "schedule": args.schedule,
        "dataloader_kwargs": {key: _argument(value) for key, value in sorted(args.dataloader_kwargs.items())},
        "bucket_by": args.lengths is not None,
        "bucket_window": args.bucket_window if args.lengths is not None else None,
        "max_tokens": args.max_tokens,
        "on_error": failures.on_error,
        "max_failures": failures.max_failures,
        "batch_timeout": failures.batch_timeout,
        "on_oom": "split" if failures.split_on_oom else "raise",
        "retry_failed": failures.retry_failed,
        "inference_mode": args.inference_mode,
        "autocast": args.autocast,
        "device_prefetch": device_prefetch,
        "output_format": args.output_format,
        "table": args.table.describe() if args.table is not None else None,
        "mesh": args.mesh.describe() if args.mesh is not None else None,
        "resume": args.resume,
        "job_name": args.job_name,
        "storage_path": storage_url,
    }
    return {
        "attempt": start.attempt,
        "world_size": world_size,
        "device": str(device),
        "processor": _argument(args.processor_cls),
        "dataset": _argument(type(args.dataset)),
        "arguments": arguments,
        "plan": plan.describe(),
        "tokens": plan.token_stats(),
        "straggler_ratio": straggler_ratio,
        "torchrun_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
        "host": socket.gethostname(),
        "versions": {
            "torch_batch_process": __version__, "torch": torch.__version__, "python": platform.python_version()
        },
    }


def _argument(value: Any) -> Any:
    """An argument as a JSON-able value (a class or function by its qualified name)."""
    if isinstance(value, type) or callable(value):
        module = getattr(value, "__module__", None) or ""
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"{module}.{name}" if module else name
    return to_jsonable(value)


def log_preempted(result: BatchProcessResult) -> None:
    """After a preempted call: what is committed, and that the same command resumes."""
    logger.warning(
        "preempted: %d of %d batches committed; run the same command again to resume",
        result.batches_committed,
        result.num_batches,
    )
