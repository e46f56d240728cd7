"""Record segments: each commit's rows made durable cheaply, until a roll-over puts them in a published shard.

The protocol (docs/records.md, "Where the rows go"):

- **Segments.** At each commit a rank writes the rows of its stage ``s`` (the batches the commit covers) as one Arrow
  IPC file, ``_tbp/segments/<s>-rank_<r>-<k>.arrow`` (``k`` > 0 only when the rows' types widened inside the stage),
  before its vote: no Parquet encoding on the commit path, and nothing under ``outputs/``. A segment is *committed*
  when the commit record commits its stage (``record.has_stage(s)``); the record names no segment (it is small: the
  committed stages it already keeps say which segments count). On local storage the rank appends the stage's rows
  to its open *segment log* instead, ``_tbp/segments/<s>-rank_<r>-<k>.arrows`` (``s``: the stage of its first rows;
  one log per shard, see :mod:`torch_batch_process.outputs.segment_log`): each record batch carries its stage, and a
  batch counts iff its stage is committed. A log is shadowed, deleted and rolled over as a whole, like a segment of
  its first stage: every stage it holds belongs to the one shard that rolls over after it.
- **Shards.** The rank keeps one shard open across its commits (a Parquet ``ParquetWriter`` fed row group by row
  group on its encoder thread, or a JSONL file) and *rolls it over* at a commit once it holds
  ``TBP_SHARD_BYTES`` (default 128 MiB) of rows, and at every closing commit (the job finishes, is preempted, or
  stops for a failure elsewhere: its closing commit). The rolled shard holds every row of the rank since its
  previous roll-over, up to and including stage ``t``; it joins stage ``t`` like an ``upload_path()`` file, so it is
  committed by the record of stage ``t`` and then published to
  ``outputs/commit_<t>/rank_<r>/records/part-<t>-rank<r>-00000.<ext>`` (one object: a rename locally, one copy
  on object stores). A rank rolls at most one shard per stage.
- **Shadowing.** A published shard of rank ``r`` at stage ``t`` *shadows* every segment of rank ``r`` with stage
  ``s <= t``: its rows are in the shard. Readers (:func:`live_segments`) count a segment iff it is committed and no
  published shard shadows it. The rank deletes the segments a shard shadows once that shard is published.
- **Leftovers.** A kill (or a failure, whose closing commit is never recorded) leaves committed rows in segments
  only. The next start (rank 0, under the job lock, after the stages the record commits are published:
  :meth:`~torch_batch_process.jobstore.store.JobStore.repair`) deletes segments that are not committed or are
  shadowed, and rolls the remaining ones of each rank ``r`` into one shard written straight to
  ``outputs/commit_<t>/rank_<r>/records/`` (``t``: the rank's newest live stage; an atomic rename or one PUT, the
  roll-over's commit point), then deletes them. Every step is idempotent, whatever the new world size.

Why it is exactly-once: stage numbers of one rank increase (with ``schedule="dynamic"`` too, and across attempts),
and a rank's stages are committed in order (records are cumulative and a rank's votes are merged in order), so the
shard committed with stage ``t`` holds exactly the committed rows of the rank's stages since its previous shard.
So at every moment :func:`read_outputs` (published shards + live segments) sees every committed row exactly once;
a glob over ``outputs/`` sees each row at most once, and exactly once whenever the job is stopped (finished or
preempted; after a kill -9 or a failure, once the next start has run).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch_batch_process import settings
from torch_batch_process.jobstore.layout import JOB_FILE, SCRATCH_DIR, SEGMENTS_DIR, outputs_dir
from torch_batch_process.outputs.segment_log import read_log
from torch_batch_process.outputs.shard_names import published_shards, shard_name
from torch_batch_process.storage.base import Storage

if TYPE_CHECKING:
    from torch_batch_process.jobstore.formats import CommitRecord

__all__ = [
    "LOG_SUFFIX",
    "Segment",
    "is_segment",
    "list_segments",
    "live_segments",
    "newest_shards",
    "read_segment",
    "roll_leftovers",
    "shard_bytes",
]

logger = logging.getLogger(__name__)

LOG_SUFFIX = ".arrows"
"""The suffix of a segment log (a segment file's is ``.arrow``)."""

_SEGMENT = re.compile(r"^(\d{8,})-rank_(\d+)-(\d+)\.arrows?$")
_SHARD_FOLDER = re.compile(r"(?:^|/)outputs/commit_(\d{8,})/rank_(\d+)/records/part-[^/]*$")


def shard_bytes() -> int:
    """The roll-over size: ``TBP_SHARD_BYTES`` (an int > 0, suffixes ``k``, ``M``, ``G`` allowed; the call's settings,
    checked before any work), else 128 MiB."""
    return settings.current().shard_bytes


@dataclass(frozen=True, order=True)
class Segment:
    """A stored segment file: stage, rank and part, and its path relative to the storage."""

    stage: int
    rank: int
    part: int
    rel: str

    @property
    def log(self) -> bool:
        """Whether it is a segment log (its stage is that of its first rows), not a segment file."""
        return self.rel.endswith(LOG_SUFFIX)


def is_segment(rel: str) -> bool:
    """Whether ``rel`` (a path listed for reading) is a segment file or log, not a shard."""
    return rel.endswith((".arrow", LOG_SUFFIX))


def list_segments(storage: Storage) -> list[Segment]:
    """Every segment file stored (committed or not), in (stage, rank, part) order: one listing."""
    found = []
    for name in storage.list(SEGMENTS_DIR):
        match = _SEGMENT.match(name)
        if match:
            stage, rank, part = (int(g) for g in match.groups())
            found.append(Segment(stage, rank, part, f"{SEGMENTS_DIR}/{name}"))
    return sorted(found)


def newest_shards(shards: Iterable[str]) -> dict[int, int]:
    """Rank -> the newest stage at which a shard of that rank is published, from shard paths (relative to the
    storage; retries' shards of earlier versions, in ``retries/<k>/outputs/``, are not the job's and are ignored)."""
    newest: dict[int, int] = {}
    for shard in shards:
        match = _SHARD_FOLDER.search(shard)
        if match is None or not shard.startswith("outputs/"):
            continue
        stage, rank = int(match.group(1)), int(match.group(2))
        newest[rank] = max(newest.get(rank, -1), stage)
    return newest


def live_segments(segments: list[Segment], record: CommitRecord | None, newest: dict[int, int]) -> list[Segment]:
    """The segments whose rows may count: shadowed by no published shard (``newest``), and committed by ``record``
    (a log: its batches of committed stages count, see :func:`read_segment`)."""
    if record is None:
        return []
    return [s for s in segments if (s.log or record.has_stage(s.stage)) and s.stage > newest.get(s.rank, -1)]


def read_segment(storage: Storage, rel: str, committed: Callable[[int], bool]) -> Any:
    """A live segment's rows as a ``pyarrow.Table``: a segment file's, or a log's of the stages ``committed``
    accepts (``None``: a log that holds no whole schema yet)."""
    import pyarrow as pa

    with storage.open_input(rel) as f:
        data = f.read()  # a storage error stays one; any error below is the file's
    if rel.endswith(LOG_SUFFIX):
        return read_log(data, committed, storage.url_of(rel))
    try:
        return pa.ipc.open_file(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError) as exc:  # pyarrow's error names no file ("Not an Arrow file"; garbled: a
        from torch_batch_process.errors import OutputCorruptError  # plain OSError, "Invalid flatbuffers message")

        raise OutputCorruptError(
            f"{storage.url_of(rel)}: this committed record segment cannot be read ({exc}); it is damaged and "
            "committed record rows are lost with it. Restore it from a backup, or start the job afresh with "
            "resume=False (this erases the stored progress and outputs) or a new storage_path"
        ) from exc


def roll_leftovers(storage: Storage, record: CommitRecord | None) -> None:
    """At a job's start (rank 0, under the job lock, after the committed stages are published): deletes segments
    that are not committed or are shadowed, and rolls each rank's live ones into one published shard (see the
    module docstring). Needs pyarrow only when live segments are left."""

    segments = list_segments(storage)
    expected = _expected_rows(record)
    if not segments and not expected:
        return
    newest = newest_shards(published_shards(storage))
    live = live_segments(segments, record, newest)
    for rank, (rows, stage) in sorted(expected.items()):
        if stage > newest.get(rank, -1) and not any(s.rank == rank for s in live):
            _lost(storage, record, rank, rows, 0, "are gone")
    dead = sorted(set(segments) - set(live))
    if dead:
        storage.delete_files([s.rel for s in dead])
    by_rank: dict[int, list[Segment]] = {}
    for segment in live:
        by_rank.setdefault(segment.rank, []).append(segment)
    schema = record.record_schema.schema if record is not None and record.record_schema is not None else None
    output_format = _output_format(storage) if by_rank else "parquet"
    assert record is not None or not by_rank
    for rank, mine in sorted(by_rank.items()):
        rows, stage = expected.get(rank, (0, -1))
        _roll(storage, rank, mine, record, schema, output_format, rows if stage > newest.get(rank, -1) else 0)


def _expected_rows(record: CommitRecord | None) -> dict[int, tuple[int, int]]:
    """Rank -> the rows its segments hold, as ``record`` commits them, and the newest stage with rows (records of
    older versions, and jobs without record rows, say nothing)."""
    kept = record.stats.get("segment_rows") if record is not None else None
    if not isinstance(kept, dict):
        return {}
    return {int(rank): (int(value[0]), int(value[1])) for rank, value in kept.items()}


def _lost(storage: Storage, record: CommitRecord, rank: int, rows: int, found: int, how: str) -> None:
    """Raises :class:`~torch_batch_process.errors.CheckpointCorruptError`: rank ``rank``'s segments hold fewer
    committed rows than ``record`` commits (deleted, cut short: a torn tail cannot tell). Nothing is published."""
    from torch_batch_process.errors import CORRUPT_HINT, CheckpointCorruptError
    from torch_batch_process.jobstore.layout import record_file

    raise CheckpointCorruptError(
        f"{storage.url_of(SEGMENTS_DIR)}: the record segments of rank {rank} {how}: they hold {found} of the {rows} "
        f"committed record rows (context.write()) that {storage.url_of(record_file(record.commit))} says are in "
        f"them and in no published shard; resuming would finish the job with those rows missing. {CORRUPT_HINT}."
    )


def _roll(
    storage: Storage,
    rank: int,
    segments: list[Segment],
    record: CommitRecord,
    schema: Any,
    output_format: str,
    expected: int = 0,
) -> None:
    """Writes one rank's live segments as one shard at its newest committed stage, publishes it in one step, deletes
    them (when they hold no committed rows, e.g. logs of stages never committed, they are only deleted). One segment
    is in memory at a time, unless the record keeps no schema (an older version's)."""
    from torch_batch_process.outputs.shard_file import ShardFile

    stages = [s.stage for s in segments if not s.log]  # a segment file is committed as a whole

    def committed(stage: int) -> bool:
        if record.has_stage(stage):
            stages.append(stage)
            return True
        return False

    def rows() -> Any:
        for segment in segments:
            table = read_segment(storage, segment.rel, committed)
            if table is not None and table.num_rows:
                yield table

    tables = list(rows()) if schema is None else None
    if tables is not None and tables:  # records of older versions keep no schema: the segments' own, unified
        import pyarrow as pa

        schema = pa.unify_schemas([t.schema for t in tables], promote_options="permissive")
    folder = storage.scratch_folder(SCRATCH_DIR, f"roll-rank_{rank}")
    try:
        shard = None
        try:
            for table in tables if tables is not None else rows():
                if shard is None:
                    shard = ShardFile(folder / f"rolled.{output_format}", schema, output_format)
                shard.write(table.select(schema.names).cast(schema))
        finally:
            if shard is not None:
                shard.close()
        if (shard.rows if shard is not None else 0) < expected:
            _lost(storage, record, rank, expected, shard.rows if shard is not None else 0, "are damaged or cut short")
        if shard is not None:
            stage = max(stages)
            name = f"{outputs_dir(stage, rank)}/{shard_name(stage, rank, 0, output_format)}"
            logger.info(
                "rolling %d committed record segment(s) of rank %d (%d rows) into %s, left by an earlier attempt",
                len(segments), rank, shard.rows, storage.url_of(name),
            )
            storage.put_file(shard.path, name)  # the roll-over's commit point
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    storage.delete_files([s.rel for s in segments])


def _output_format(storage: Storage) -> str:
    """The job's ``output_format`` (its job file's fingerprint keeps it when it is not the default)."""
    try:
        spec = storage.read_json(JOB_FILE).get("spec", {})
    except FileNotFoundError:
        return "parquet"
    return str(spec.get("output_format") or "parquet")
