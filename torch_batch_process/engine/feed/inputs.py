"""The job's input: a map-style dataset or a streaming source, behind one interface that the loop calls without
asking which.

An input gives the plan of the whole dataset, the scheduler of a schedule (a stream's static schedule deals
contiguous blocks), and what the feed reads: the dataset, the order of its batches and the loader's options.

- :class:`MapInput`: a map-style dataset with ``__len__``: contiguous batches (DESIGN §3), or length-bucketed ones
  with ``bucket_by`` (§9); the loader reads it by index in the scheduler's order.
- :class:`StreamInput`: a :class:`~torch_batch_process.sources.Source` (§12): batches are row ranges inside its
  shards, whose row counts are counted once when its metadata does not tell them
  (:mod:`~torch_batch_process.engine.plan.stream_counts`); the loader reads it through
  :class:`~torch_batch_process.engine.feed.streams.StreamDataset`.
"""

from __future__ import annotations

import abc
from typing import Any

from torch_batch_process.arguments import JobArguments
from torch_batch_process.engine.distributed import Collectives, RendezvousStore
from torch_batch_process.engine.feed.stream_order import WorkerAffineOrder
from torch_batch_process.engine.feed.streams import StreamDataset, is_source
from torch_batch_process.engine.plan.bucket_options import planned_max_tokens
from torch_batch_process.engine.plan.plans import Plan, dataset_plan
from torch_batch_process.engine.plan.stream_counts import CountedRows, shard_row_counts
from torch_batch_process.engine.plan.streamed import StreamPlan
from torch_batch_process.engine.schedule.scheduler import Scheduler, make_scheduler, stream_scheduler
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.sources.base import Source
from torch_batch_process.storage.base import Storage

__all__ = ["JobInput", "MapInput", "StreamInput", "open_input"]


class JobInput(abc.ABC):
    """What a job reads (see the module docstring)."""

    plan: Plan
    """The plan of the whole dataset (before ``max_batches``)."""
    dataset_length: int
    """Examples of the dataset (rows of a source): part of the job's fingerprint."""

    @abc.abstractmethod
    def scheduler(
        self,
        kind: str,
        remaining: RangeSet,
        collectives: Collectives,
        interval: int,
        store: RendezvousStore | None,
        units: tuple[int, int] | None = None,
    ) -> Scheduler:
        """This rank's scheduler of ``schedule=kind`` over the batches ``remaining`` (``units``: its replica and the
        number of replicas with ``mesh=``)."""

    @abc.abstractmethod
    def feed_parts(
        self, scheduler: Scheduler, loader_kwargs: dict[str, Any], plan: Plan
    ) -> tuple[Any, Any, dict[str, Any]]:
        """What the feed gets: the dataset the loader reads, the order of this rank's batches (an object with
        ``batch_ids()``, the scheduler or a view of it) and the loader's options. ``plan`` is the job's (a retry's
        plan holds scattered examples)."""

    @abc.abstractmethod
    def examples(self) -> Any:
        """The examples by index in the main process, apart from the loader's reads (``key=``: the rows whose key and
        content hash are stored, DESIGN §21)."""

    def opened(self) -> None:  # noqa: B027 - nothing to keep for most inputs
        """Once the job is open (rank 0 holds the job lock and the fingerprint matched): keeps what a resume reuses."""

    def close(self) -> None:  # noqa: B027 - nothing to release for most inputs
        """Releases what the input holds open in this process (when the call ends)."""


class MapInput(JobInput):
    """A map-style dataset (see the module docstring).

    Args:
        dataset: the user's dataset.
        plan: its plan (contiguous or length-bucketed).
        dataset_length: its ``len()``.
    """

    def __init__(self, dataset: Any, plan: Plan, dataset_length: int) -> None:
        self.dataset = dataset
        self.plan = plan
        self.dataset_length = dataset_length

    def scheduler(
        self,
        kind: str,
        remaining: RangeSet,
        collectives: Collectives,
        interval: int,
        store: RendezvousStore | None,
        units: tuple[int, int] | None = None,
    ) -> Scheduler:
        return make_scheduler(kind, remaining, collectives, interval, store, units)

    def feed_parts(
        self, scheduler: Scheduler, loader_kwargs: dict[str, Any], plan: Plan
    ) -> tuple[Any, Any, dict[str, Any]]:
        return self.dataset, scheduler, loader_kwargs

    def examples(self) -> Any:
        """The dataset itself."""
        return self.dataset


class StreamInput(JobInput):
    """A streaming source on one rank: the plan (from the shards' row counts) and the dataset the loader reads.

    Args:
        source: the user's source.
        batch_size: rows per batch.
        storage: the job's storage (stored row counts).
        coll: the library's collectives (counting shards in parallel over the ranks).
    """

    def __init__(self, source: Source, batch_size: int, storage: Storage, coll: Collectives) -> None:
        self.source = source
        self.storage = storage
        self.rank = coll.rank
        self.rows: CountedRows = shard_row_counts(source, storage, coll)
        self.plan = StreamPlan(source.fingerprint(), self.rows.counts, batch_size)
        self.dataset_length = self.plan.dataset_length
        self.dataset = StreamDataset(source, self.plan)

    def scheduler(
        self,
        kind: str,
        remaining: RangeSet,
        collectives: Collectives,
        interval: int,
        store: RendezvousStore | None,
        units: tuple[int, int] | None = None,
    ) -> Scheduler:
        """The scheduler of a stream job (static: contiguous blocks per rank)."""
        return stream_scheduler(kind, remaining, collectives, interval, store, units)

    def feed_parts(
        self, scheduler: Scheduler, loader_kwargs: dict[str, Any], plan: Plan
    ) -> tuple[StreamDataset, Any, dict[str, Any]]:
        """The dataset, the batch order (:class:`WorkerAffineOrder` with workers, so that they share no decoding)
        and the loader options (without a ``collate_fn``, Parquet batches are collated from their Arrow columns:
        the same result as ``default_collate`` of the rows, faster). ``plan`` is the job's: a ``retry_failed``
        run's plan holds scattered rows (failures), read by row number in the scheduler's order."""
        workers = int(loader_kwargs.get("num_workers") or 0)
        affine = workers > 1 and isinstance(plan, StreamPlan)
        order = WorkerAffineOrder(scheduler, self.plan, self.source, workers) if affine else scheduler
        if loader_kwargs.get("collate_fn") is None and hasattr(self.source, "read_batches"):
            from torch_batch_process.engine.feed.stream_columns import StreamCollate  # pyarrow: only for Parquet

            self.dataset.columnar = True
            loader_kwargs = {**loader_kwargs, "collate_fn": StreamCollate()}
        return self.dataset, order, loader_kwargs

    def examples(self) -> StreamDataset:
        """The rows by global row number, read as Python rows (runs of consecutive rows at once), with their own
        readers: the loader's dataset may collate Parquet batches from Arrow columns."""
        return StreamDataset(self.source, self.plan)

    def opened(self) -> None:
        """Keeps row counts counted now for the resumes."""
        self.rows.save(self.storage, self.rank)

    def close(self) -> None:
        """Closes the readers the source keeps open in this process."""
        self.source.close()


def open_input(args: JobArguments, storage: Storage, collectives: Collectives) -> JobInput:
    """Every rank: the input of the call. A streaming source's shards are counted here, over the ranks (a
    collective), when neither its metadata nor an earlier start of the job tells their rows."""
    if is_source(args.dataset):
        return StreamInput(args.dataset, args.batch_size, storage, collectives)
    plan = dataset_plan(
        args.dataset_length, args.batch_size, args.lengths, args.bucket_window, planned_max_tokens(args.max_tokens)
    )
    return MapInput(args.dataset, plan, args.dataset_length)
