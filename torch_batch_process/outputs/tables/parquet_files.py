"""Parquet data files written straight into a table's folder (Delta Lake and Iceberg keep their rows in Parquet).

The file is encoded as the rank's record shards are (:mod:`torch_batch_process.outputs.records`: dictionary
encoding for text, statistics for flat columns, snappy) into an output stream at its final place in the table:
a local file, or a multipart upload to an object store. Until a table transaction adds it, no reader of the
table sees it.
"""

from __future__ import annotations

from typing import Any

from torch_batch_process.outputs.columns import INDEX_COLUMN
from torch_batch_process.outputs.tables.base import DataFileWriter
from torch_batch_process.storage.errors import file_error

__all__ = ["ParquetDataFile", "parquet_options"]


def parquet_options(schema: Any) -> dict[str, Any]:
    """The ``ParquetWriter`` options of record shards (see :mod:`torch_batch_process.outputs.records`)."""
    import pyarrow as pa

    text = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    flat = [f.name for f in schema if not pa.types.is_nested(f.type)]
    return {"use_dictionary": text, "write_statistics": flat, "compression": "snappy"}


class ParquetDataFile(DataFileWriter):
    """A Parquet data file written into an output stream.

    Args:
        stream: the output stream (closed by :meth:`close`).
        path: the file's path as the table names it (relative to a Delta table's root, a full URI for Iceberg).
        schema: the file's Arrow schema.
        stage: the stage whose rows it holds.
        shown: the file as errors name it (default ``path``; a Delta table's: in its table).
    """

    def __init__(self, stream: Any, path: str, schema: Any, stage: int, *, shown: str | None = None) -> None:
        import pyarrow.parquet as pq

        self._stream = stream
        self._path = path
        self._shown = shown or path
        self._stage = stage
        try:
            self._writer = pq.ParquetWriter(stream, schema, **parquet_options(schema))
        except OSError as exc:  # e.g. a full disk: a StorageError naming the file (pyarrow's names none)
            raise file_error(self._shown, "create the table's data file", exc) from exc
        self._rows = 0
        self._low: int | None = None
        self._high: int | None = None

    def write_table(self, table: Any, row_group_size: int | None = None) -> None:
        import pyarrow.compute as pc

        try:
            self._writer.write_table(table, row_group_size=row_group_size or table.num_rows)
        except OSError as exc:
            raise file_error(self._shown, "write rows to the table's data file", exc) from exc
        if table.num_rows:
            bounds = pc.min_max(table.column(INDEX_COLUMN))
            low, high = bounds["min"].as_py(), bounds["max"].as_py()
            self._low = low if self._low is None else min(self._low, low)
            self._high = high if self._high is None else max(self._high, high)
        self._rows += table.num_rows

    def close(self) -> list[dict[str, Any]]:
        try:
            self._writer.close()
            size = self._stream.tell()
            self._stream.close()
        except OSError as exc:
            raise file_error(self._shown, "finish the table's data file", exc) from exc
        return [
            {"path": self._path, "size": size, "rows": self._rows, "stage": self._stage, "low": self._low,
             "high": self._high}
        ]
