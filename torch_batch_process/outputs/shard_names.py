"""Where record shards live: their names inside a stage's folder and the listing of the published ones.

The record writer (:mod:`~torch_batch_process.outputs.records`) names the shards it rolls over, the segment protocol
(:mod:`~torch_batch_process.outputs.segments`) lists the published ones to know which segments they shadow, and the
read-back (:mod:`~torch_batch_process.outputs.readback`) lists them to read; the three share this module, so that
none of them imports another for a name.
"""

from __future__ import annotations

from torch_batch_process.jobstore.layout import OUTPUTS_DIR, number_name
from torch_batch_process.storage.base import Storage

__all__ = ["OUTPUT_FORMATS", "RECORDS_DIR", "SHARD_SUFFIXES", "committed_shards", "published_shards", "shard_name"]

OUTPUT_FORMATS = {"parquet": "parquet", "jsonl": "jsonl"}
"""``output_format`` -> the shards' file extension."""

RECORDS_DIR = "records"
"""The folder of record shards inside each ``outputs/commit_<s>/rank_<r>/``."""

SHARD_SUFFIXES = (".parquet", ".jsonl")


def shard_name(stage: int, rank: int, part: int, output_format: str) -> str:
    """Name of a shard inside its ``outputs/commit_<s>/rank_<r>/`` folder (unique across ranks and stages)."""
    return f"{RECORDS_DIR}/part-{number_name(stage)}-rank{rank}-{part:05d}.{OUTPUT_FORMATS[output_format]}"


def published_shards(storage: Storage) -> list[str]:
    """The record shards published in the job's own ``outputs/`` (its retries' among them), in commit and rank
    order."""
    return committed_shards(storage, "")


def committed_shards(storage: Storage, root: str) -> list[str]:
    """The shards published below ``root`` (the job's folder, or a retry's of an earlier version)."""
    shards: list[str] = []
    for commit in storage.list(f"{root}{OUTPUTS_DIR}"):
        if not commit.startswith("commit_"):
            continue
        for rank in storage.list(f"{root}{OUTPUTS_DIR}/{commit}"):
            if not rank.startswith("rank_"):
                continue
            folder = f"{root}{OUTPUTS_DIR}/{commit}/{rank}/{RECORDS_DIR}"
            shards += [
                f"{folder}/{n}" for n in storage.list(folder) if n.startswith("part-") and n.endswith(SHARD_SUFFIXES)
            ]
    return shards
