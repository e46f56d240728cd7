"""The plan of a streaming source (DESIGN §12): batches are row ranges inside shards.

Each shard of a :class:`~torch_batch_process.sources.Source` is cut into batches of ``batch_size`` rows
(the last batch of a shard may be shorter: **a batch never spans two shards**, so it is one contiguous
row range that a reader can seek to). Global batch ids number the batches shard after shard::

    shard 0: batches 0 .. b0-1      rows [0, B), [B, 2B), ... of shard 0
    shard 1: batches b0 .. b0+b1-1  ...

so the set of committed batch ids (the job's progress, a :class:`~torch_batch_process.jobstore.ranges.RangeSet`)
is exactly a set of per-shard row offsets, valid for any world size and both schedules, and a batch id
names the same rows forever. The plan needs every shard's row count: from the source's metadata (Parquet
footers, JSONL with ``count_rows``, ``Sharded(num_rows=...)``), else counted once per job
(:mod:`~torch_batch_process.engine.plan.stream_counts`).

``context.batch_indices`` and the ``index`` of record outputs are **global row numbers**: the rows of the
shards before the batch's shard, plus the row's offset inside its shard (shards in the source's order).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.jobstore.ranges import RangeSet

__all__ = ["StreamPlan", "rows_digest"]


def rows_digest(counts: Sequence[int]) -> str:
    """A short digest of the row counts of the shards (part of the fingerprint)."""
    return hashlib.sha256(json.dumps([int(n) for n in counts]).encode()).hexdigest()[:16]


class StreamPlan(Plan):
    """Batches of ``batch_size`` rows inside the shards of a source (see the module docstring).

    Args:
        source_fingerprint: the source's :meth:`~torch_batch_process.sources.Source.fingerprint`.
        counts: the rows of each shard, in shard order.
        batch_size: rows per batch (the last batch of a shard may hold fewer).
        num_batches: keep only the first ``num_batches`` batches (``max_batches``); ``None``: all.
    """

    def __init__(
        self, source_fingerprint: dict[str, Any], counts: Sequence[int], batch_size: int, num_batches: int | None = None
    ) -> None:
        self.source_fingerprint = source_fingerprint
        self.counts = [int(n) for n in counts]
        self.batch_size = batch_size
        self.row_offsets = [0]
        self.batch_offsets = [0]
        for n in self.counts:
            self.row_offsets.append(self.row_offsets[-1] + n)
            self.batch_offsets.append(self.batch_offsets[-1] + -(-n // batch_size))
        self.dataset_length = self.row_offsets[-1]
        total = self.batch_offsets[-1]
        self.num_batches = total if num_batches is None else min(num_batches, total)

    @property
    def num_shards(self) -> int:
        return len(self.counts)

    def cut(self, num_batches: int) -> StreamPlan:
        return StreamPlan(self.source_fingerprint, self.counts, self.batch_size, num_batches)

    def locate(self, batch: int) -> tuple[int, int, int]:
        """``(shard, start, stop)``: the rows of global batch ``batch`` inside its shard."""
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"batch {batch} is not in the plan (0..{self.num_batches - 1})")
        shard = bisect.bisect_right(self.batch_offsets, batch) - 1
        start = (batch - self.batch_offsets[shard]) * self.batch_size
        return shard, start, min(start + self.batch_size, self.counts[shard])

    def row_of(self, index: int) -> tuple[int, int]:
        """``(shard, row in shard)`` of global row number ``index``."""
        if not 0 <= index < self.dataset_length:
            raise IndexError(f"row {index} is not in the source (0..{self.dataset_length - 1})")
        shard = bisect.bisect_right(self.row_offsets, index) - 1
        return shard, index - self.row_offsets[shard]

    def batch_indices(self, batch: int) -> range:
        shard, start, stop = self.locate(batch)
        base = self.row_offsets[shard]
        return range(base + start, base + stop)

    def _rows_before(self, batch: int) -> int:
        """Rows in global batches ``[0, batch)``."""
        if batch >= self.batch_offsets[-1]:
            return self.dataset_length
        shard = bisect.bisect_right(self.batch_offsets, batch) - 1
        k = batch - self.batch_offsets[shard]
        return self.row_offsets[shard] + min(k * self.batch_size, self.counts[shard])

    def count_examples(self, batches: RangeSet) -> int:
        total = 0
        for start, stop in batches.ranges():
            stop = min(stop, self.num_batches)
            if start < stop:
                total += self._rows_before(stop) - self._rows_before(start)
        return total

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "stream", "source": self.source_fingerprint, "rows": rows_digest(self.counts)}

    def describe(self) -> str:
        return (
            f"{self.num_examples} rows of {self.num_shards} shard(s) in {self.num_batches} batches of at most "
            f"{self.batch_size} (a batch never spans two shards)"
        )
