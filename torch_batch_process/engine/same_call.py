"""Every rank of a job must be given the same call: checked once per call, before any work or storage write.

Each rank checks its own arguments (:mod:`torch_batch_process.validation`), but only together can the ranks see
that they were given different ones: a ``batch_size`` or a dataset length computed per process, a ``schedule`` read
from a per-node setting. Unchecked, rank 0's job would be stored while the other ranks cut other batches (examples
processed twice or never, with no error), or the ranks would run different protocols and wait on each other
forever (a mixed ``schedule`` did). So each call gathers every rank's arguments once, as a small dict, and every rank
raises the same :class:`~torch_batch_process.errors.InvalidArgumentError` naming what differs and where.

Two moments: :func:`call_values` right after the process group is joined (the arguments as given), and the job's
fingerprint (:class:`~torch_batch_process.jobstore.formats.JobSpec`, with the plan's: the lengths of ``bucket_by``, a
stream's shards and rows) once every rank has planned, before rank 0 opens the stored job. Not compared: the storage
path (a shared filesystem may be mounted at another path on each node;
:mod:`~torch_batch_process.engine.commit.shared_start` checks that every rank sees rank 0's files), storage options
(credentials) and ``dataloader_kwargs`` (loader workers may differ per node).
"""

from __future__ import annotations

from typing import Any

from torch_batch_process.arguments import JobArguments
from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.jobstore.formats import qualified_name

__all__ = ["call_values", "check_same_call"]

_SHOWN = 4
"""Ranks named per differing argument."""


def call_values(args: JobArguments) -> dict[str, Any]:
    """The arguments of ``args`` every rank must share, as small picklable values."""
    failures = args.failures
    return {
        "batch_processor_cls": qualified_name(args.processor_cls),
        "dataset": qualified_name(type(args.dataset)),
        "len(dataset)": args.dataset_length,
        "batch_size": args.batch_size,
        "max_batches": args.max_batches,
        "checkpoint_interval": args.checkpoint_interval,
        "job_name": args.job_name,
        "resume": args.resume,
        "inference_mode": args.inference_mode,
        "schedule": args.schedule,
        "bucket_by": args.lengths is not None,
        "bucket_window": args.bucket_window,
        "max_tokens": args.max_tokens,
        "autocast": args.autocast,
        "output_format": args.output_format,
        "table": args.table.describe() if args.table is not None else None,
        "on_error": failures.on_error,
        "max_failures": failures.max_failures,
        "batch_timeout": failures.batch_timeout,
        "retry_failed": failures.retry_failed,
        "on_oom": failures.on_oom,
        "mesh": args.mesh.describe() if args.mesh is not None else None,
    }


def check_same_call(values: dict[str, Any], collectives: Collectives, what: str = "arguments") -> None:
    """Raises on every rank an :class:`InvalidArgumentError` naming each value of ``values`` that differs between
    ranks (one ``all_gather``; nothing on a job of one rank).

    Args:
        values: this rank's values (the same keys on every rank).
        collectives: the library's collectives.
        what: what the values are, for the message.
    """
    if collectives.world_size == 1:
        return
    everyone = [_flat(got) for got in collectives.all_gather(values)]
    first = everyone[0]
    problems = []
    keys = list(first) + sorted({key for got in everyone for key in got} - set(first))
    for key in keys:
        others = [(rank, got.get(key)) for rank, got in enumerate(everyone) if got.get(key) != first.get(key)]
        if others:
            shown = ", ".join(f"{value!r:.80} on rank {rank}" for rank, value in others[:_SHOWN])
            more = f" (and {len(others) - _SHOWN} more ranks)" if len(others) > _SHOWN else ""
            problems.append(f"{key} is {first.get(key)!r:.80} on rank 0 but {shown}{more}")
    if problems:
        raise InvalidArgumentError(
            f"the ranks of this job were given different {what}: {'; '.join(problems)}. Every rank must call "
            "torch_batch_process(...) with the same ones (compute them the same way in every process): otherwise the "
            "ranks would process different batches, or wait for each other forever"
        )


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``values`` with nested dicts spread out (``plan.lengths_sha256``), so that a message names what differs."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
