"""The order of a stream job's batches over a rank's DataLoader workers (:class:`WorkerAffineOrder`), so that
parallel readers share no decoding (over ranks: :class:`~torch_batch_process.engine.schedule.scheduler.BlockScheduler`).

``DataLoader`` gives the ``i``-th batch its sampler yields to worker ``i % num_workers``. Dealt in the
scheduler's order, consecutive batches of one Parquet row group would go to different workers, and each of
them would decode the whole row group (Parquet decodes a row group from its start). :class:`WorkerAffineOrder`
looks a little ahead in the scheduler's batches and reorders them so that every *seek unit* (a row group; a
JSONL index mark; a whole shard for formats that cannot seek) goes to one worker: each worker reads its units
front to back, and no two workers decode the same rows.

It only reorders: the same batches, each once, all of them (the buffer is drained when the scheduler's
batches end). With ``schedule="static"`` the look-ahead spans a shard's batches (ids only, no I/O); with
``"dynamic"`` it is a few batches per worker, since looking ahead there means claiming batches early
(a rank that stops leaves them uncommitted, for the next attempt), so workers may then share a unit.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from torch_batch_process.engine.plan.streamed import StreamPlan
from torch_batch_process.engine.schedule.scheduler import Scheduler
from torch_batch_process.sources.base import Source

__all__ = ["WorkerAffineOrder"]

_MAX_LOOKAHEAD = 100_000
_KEYS_KEPT = 64


class WorkerAffineOrder:
    """A view of ``scheduler`` for the feed: :meth:`batch_ids` reordered for ``num_workers`` workers.

    Args:
        scheduler: this rank's scheduler (only its ``batch_ids()`` is used).
        plan: the job's stream plan.
        source: the job's source (its seek units).
        num_workers: the DataLoader's workers (>= 2).
    """

    def __init__(self, scheduler: Scheduler, plan: StreamPlan, source: Source, num_workers: int) -> None:
        self._scheduler = scheduler
        self._plan = plan
        self._source = source
        self._workers = num_workers
        per_shard = max((-(-n // plan.batch_size) for n in plan.counts), default=1)
        ahead = per_shard + 1 if scheduler.kind == "static" else 4
        self.lookahead = min(_MAX_LOOKAHEAD, num_workers * ahead)

    @property
    def kind(self) -> str:
        return self._scheduler.kind

    def _unit(self, batch: int) -> tuple[int, int]:
        shard, start, _ = self._plan.locate(batch)
        return shard, self._source.seek_origin(shard, start)

    def batch_ids(self) -> Iterator[int]:
        nw = self._workers
        source = iter(self._scheduler.batch_ids())
        queues: list[collections.deque[int]] = [collections.deque() for _ in range(nw)]
        owner: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        buffered, exhausted, position = 0, False, 0
        while True:
            worker = position % nw
            while not queues[worker] and not exhausted and buffered < self.lookahead:
                batch = next(source, None)
                if batch is None:
                    exhausted = True
                    break
                unit = self._unit(batch)
                if unit not in owner:  # a new unit: to the worker waiting now, else the least loaded one
                    owner[unit] = worker if not queues[worker] else min(range(nw), key=lambda k: len(queues[k]))
                    if len(owner) > _KEYS_KEPT:
                        owner.popitem(last=False)
                queues[owner[unit]].append(batch)
                buffered += 1
            queue = queues[worker] if queues[worker] else max(queues, key=len)
            if not queue:
                return  # the scheduler's batches ended and every buffered one was given
            buffered -= 1
            position += 1
            yield queue.popleft()
