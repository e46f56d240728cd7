"""A streaming source as a job's dataset (DESIGN §12): its checks, its plan and the dataset the loader reads.

The engine treats a :class:`~torch_batch_process.sources.Source` like a map-style dataset whose examples are
numbered by global row (:mod:`~torch_batch_process.engine.plan.streamed`): the batch sampler hands the loader
the row numbers of one batch, always a contiguous range inside one shard, and :class:`StreamDataset` turns
them into one ``source.read(shard, start, stop)``. So the feed, the schedulers, the committer, ``batch_idx``,
``context.batch_indices`` and ``context.write`` work unchanged, with the user's ``collate_fn``, workers and
pinned memory:

- a resume (any world size) reads only the batches not committed; each read seeks to its range where the
  format can (Parquet row groups, an indexed JSONL file) instead of reading the rows before it;
- a reader (a rank, or a DataLoader worker) that reads consecutive ranges of a shard continues one open
  cursor; different readers read different batches, and DataLoader workers get whole row groups
  (:mod:`~torch_batch_process.engine.feed.stream_order`), so they decode no row twice. Ranks interleave: a rank
  whose next batch starts further on in the same Parquet row group decodes the rows in between (without
  converting them to Python), so row groups about a batch long suit jobs of many ranks;
- without a ``collate_fn``, Parquet batches are collated from their Arrow columns
  (:mod:`~torch_batch_process.engine.feed.stream_columns`);
- the source's fingerprint and the shards' row counts are part of the plan's fingerprint, so a resume over
  other files or other rows is refused;
- with ``on_error="skip"`` the halves of a failing batch are read again by row number through the same
  :class:`StreamDataset` (:mod:`~torch_batch_process.engine.feed.failing_examples`), and a ``retry_failed`` run's
  plan of scattered failed rows is read in the scheduler's order
  (:meth:`~torch_batch_process.engine.feed.inputs.StreamInput.feed_parts`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch_batch_process.engine.plan.streamed import StreamPlan
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.sources.base import Source, SourceChangedError

if TYPE_CHECKING:
    from torch_batch_process.engine.feed.stream_columns import ArrowRows

__all__ = ["StreamDataset", "is_source", "validate_source"]


def is_source(dataset: Any) -> bool:
    """Whether ``dataset`` is a streaming source."""
    return isinstance(dataset, Source)


def validate_source(source: Source, bucket_by: Any) -> int:
    """Checks a source given as ``dataset``; returns its rows when its metadata tells them, else ``-1``."""
    if bucket_by is not None:
        raise InvalidArgumentError(
            "bucket_by is not supported with a streaming source (a batch is a row range inside one shard); "
            "remove bucket_by, or load the data as a map-style dataset to bucket it by length"
        )
    total = source.num_rows
    return -1 if total is None else int(total)


class StreamDataset:
    """The rows of a source by global row number, read a batch (a contiguous range of one shard) at a time.

    ``DataLoader`` calls :meth:`__getitems__` with the row numbers of one batch (torch's batched fetch);
    :meth:`__getitem__` reads one row (for completeness: the engine never asks for single rows). With
    ``columnar`` (a Parquet source and the default ``collate_fn``) a batch is read as one Arrow table and
    collated from its columns (:mod:`~torch_batch_process.engine.feed.stream_columns`).
    """

    def __init__(self, source: Source, plan: StreamPlan) -> None:
        self.source = source
        self.plan = plan
        self.columnar = False

    def __len__(self) -> int:
        return self.plan.dataset_length

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Any] | ArrowRows:
        if self.columnar and indices:
            shard, start = self.plan.row_of(indices[0])
            want = len(indices)
            if indices[-1] - indices[0] == want - 1 and start + want <= self.plan.counts[shard]:
                import pyarrow as pa

                from torch_batch_process.engine.feed.stream_columns import ArrowRows

                parts = list(self.source.read_batches(shard, start, start + want, want))  # type: ignore[attr-defined]
                table = pa.Table.from_batches(parts, schema=self.source.schema)  # type: ignore[attr-defined]
                self._check(shard, start, want, table.num_rows)
                return ArrowRows(table)
        rows: list[Any] = []
        i = 0
        while i < len(indices):
            shard, start = self.plan.row_of(indices[i])
            j = i + 1  # the run of consecutive rows of one shard from indices[i]
            limit = self.plan.row_offsets[shard + 1]
            while j < len(indices) and indices[j] == indices[j - 1] + 1 and indices[j] < limit:
                j += 1
            want = j - i
            got = list(self.source.read(shard, start, start + want))
            self._check(shard, start, want, len(got))
            rows.extend(got)
            i = j
        return rows

    def _check(self, shard: int, start: int, want: int, got: int) -> None:
        if got != want:
            name = self.source.shards()[shard].name
            raise SourceChangedError(
                f"shard {shard} ({name}) of the {self.source.kind} source ended after {start + got} rows, "
                f"but the job counted {self.plan.counts[shard]} rows in it: the data changed since the job "
                "started; restore it, or start afresh (resume=False) to process the data as it is now"
            )
