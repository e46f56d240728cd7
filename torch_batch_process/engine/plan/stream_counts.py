"""Row counts of a streaming source's shards, for its plan (:mod:`~torch_batch_process.engine.plan.streamed`).

A plan numbers batches by rows inside shards, so it needs every shard's row count before the first batch.
Sources that know them from metadata (Parquet footers, JSONL with ``count_rows=True``,
``Sharded(num_rows=...)``) cost nothing here. For the others (Hugging Face iterable datasets, JSONL without
counts, ``Sharded`` without ``num_rows``) the shards are read once (``Source.count_rows``: JSONL lines are
counted, not parsed), in parallel over the ranks (shard ``s`` by rank ``s % W``), at the job's first start;
the counts are stored with the job (``_tbp/source_rows/<digest of the source's fingerprint>.json``) and every
resume, with any world size, reads them back instead of counting again. The counting pass is logged with its
cost. Its writes never touch a stored job: the file is named by the source's fingerprint, so a job over other
data gets its own file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.errors import InvalidArgumentError, WorkerFailedError
from torch_batch_process.jobstore.layout import source_rows_file
from torch_batch_process.sources.base import Source
from torch_batch_process.storage.base import Storage

__all__ = ["CountedRows", "shard_row_counts"]

logger = logging.getLogger(__name__)


class CountedRows:
    """The row counts of a source's shards and how they were obtained.

    Attributes:
        counts: rows of each shard, in shard order.
        how: ``"metadata"``, ``"stored"`` (counted by an earlier start of the job) or ``"counted"`` (now).
        seconds: time spent getting them.
    """

    def __init__(self, counts: list[int], how: str, seconds: float, stored_as: str | None = None) -> None:
        self.counts = counts
        self.how = how
        self.seconds = seconds
        self._stored_as = stored_as

    def save(self, storage: Storage, rank: int) -> None:
        """Rank 0 stores counts counted now, for the resumes (called once the job is open: a job refused
        for another fingerprint leaves its storage untouched)."""
        if self.how == "counted" and rank == 0 and self._stored_as is not None:
            storage.write_json(self._stored_as, self.counts)


def _digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:24]


def shard_row_counts(source: Source, storage: Storage, coll: Collectives) -> CountedRows:
    """Every rank: the row counts of ``source``'s shards (see the module docstring).

    Raises:
        InvalidArgumentError: the source has no shard.
        WorkerFailedError: a rank failed to count its shards (raised on every rank, with its message).
    """
    t0 = time.perf_counter()
    infos = source.shards()
    if not infos:
        raise InvalidArgumentError(f"dataset: the {source.kind} source has no shard; give it at least one")
    known = [info.num_rows for info in infos]
    if all(n is not None for n in known):
        return CountedRows([int(n) for n in known], "metadata", time.perf_counter() - t0)  # type: ignore[arg-type]
    rel = source_rows_file(_digest(source.fingerprint()))
    stored: Any = None
    if coll.rank == 0:
        try:
            stored = storage.read_json(rel) if storage.exists(rel) else None
        except Exception:  # noqa: BLE001 - unreadable or damaged: count again (a cache of the data); a storage
            stored = None  # that cannot be reached fails clearly, on every rank, when the job opens
    stored = coll.broadcast(stored)
    if isinstance(stored, list) and len(stored) == len(infos) and all(isinstance(n, int) for n in stored):
        return CountedRows(stored, "stored", time.perf_counter() - t0)
    mine: dict[int, int] | str = {}
    try:
        for shard, n in enumerate(known):
            if shard % coll.world_size == coll.rank:
                mine[shard] = int(n) if n is not None else source.count_rows(shard)  # type: ignore[index]
    except Exception as exc:  # noqa: BLE001 - sent to every rank, raised everywhere
        mine = (
            f"rank {coll.rank} could not count the rows of its shards of the {source.kind} source: "
            f"{type(exc).__name__}: {exc}"
        )
    parts = coll.all_gather(mine)
    errors = [part for part in parts if isinstance(part, str)]
    if errors:
        raise WorkerFailedError(errors[0])
    counts = [0] * len(infos)
    for part in parts:
        for shard, n in part.items():
            counts[shard] = n
    seconds = time.perf_counter() - t0
    if coll.rank == 0:
        logger.info(
            "counted the rows of %d shard(s) of the %s source once (%d rows, %.2f s on %d rank(s)); "
            "kept in %s for resumes",
            len(infos), source.kind, sum(counts), seconds, coll.world_size, storage.url_of(rel),
        )
    return CountedRows(counts, "counted", seconds, rel)
