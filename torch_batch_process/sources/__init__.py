"""Streaming sources: sharded streams of examples that ``torch_batch_process(dataset=...)`` reads
by row ranges inside shards, so that a resume (with any world size) seeks past committed rows
instead of reading them again (DESIGN §12).

- :func:`parquet`: Parquet files (local or any fsspec URL, globs), totals from the footers,
  seeking by row group.
- :func:`jsonl`: JSON Lines files (``.jsonl``, ``.jsonl.gz``...), totals and seeking with
  ``count_rows=True``.
- :func:`from_hf`: a Hugging Face ``datasets.IterableDataset``, by its shards.
- :class:`Sharded`: any list of shard descriptors and a function that opens one.

Every source implements :class:`Source`: ``shards()``, ``read(shard, start, stop)``,
``fingerprint()``, and counts the rows it decodes (``rows_read``, ``on_rows_read``,
:class:`RowsReadLog`).
"""

from torch_batch_process.sources.base import ShardInfo, Source, SourceChangedError, SourceDataError
from torch_batch_process.sources.hf import HFSource, from_hf
from torch_batch_process.sources.jsonl import JsonlSource, jsonl
from torch_batch_process.sources.parquet import ParquetSource, parquet
from torch_batch_process.sources.reads_log import RowsReadLog
from torch_batch_process.sources.sharded import Sharded

__all__ = [
    "HFSource",
    "JsonlSource",
    "ParquetSource",
    "RowsReadLog",
    "ShardInfo",
    "Sharded",
    "Source",
    "SourceChangedError",
    "SourceDataError",
    "from_hf",
    "jsonl",
    "parquet",
]
