"""One record shard being written: a Parquet file (pyarrow's ``ParquetWriter``) or a JSONL file, row group by row group.

Shared by the rank's record writer (:mod:`torch_batch_process.outputs.records`), which keeps a shard open across
commits, and by the roll-over of leftover segments at a job's start (:mod:`torch_batch_process.outputs.segments`),
so that both write shards the same way (dictionary-encoded text, statistics of flat columns only, snappy).
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch_batch_process.errors import StorageError
from torch_batch_process.storage.errors import file_error

__all__ = ["ShardFile"]


class ShardFile:
    """A shard file being written.

    Args:
        path: the local file to write.
        schema: the rows' Arrow schema (Parquet: fixed for the file; JSONL: not stored).
        output_format: ``"parquet"`` or ``"jsonl"``.
    """

    def __init__(self, path: str | os.PathLike[str], schema: Any, output_format: str) -> None:
        self.path = os.fspath(path)
        self.schema = schema
        self.format = output_format
        self.rows = 0
        self._text: Any = None
        self._parquet: Any = None
        try:
            if output_format == "jsonl":
                self._text = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
                return
            import pyarrow as pa
            import pyarrow.parquet as pq

            dictionary = [f.name for f in schema if _is_text(f.type)]
            flat = [f.name for f in schema if not pa.types.is_nested(f.type)]
            self._parquet = pq.ParquetWriter(  # statistics of flat columns only: min/max of tensors cost ~15%
                self.path, schema, use_dictionary=dictionary, write_statistics=flat, compression="snappy",
                write_page_checksum=True,  # a CRC per page: the read side finds bytes changed in storage
            )
        except OSError as exc:
            raise _error("create", self.path, exc) from exc

    def write(self, table: Any) -> None:
        """Appends ``table``'s rows (Parquet: one row group)."""
        if table.num_rows == 0:
            return
        try:
            if self._parquet is not None:
                self._parquet.write_table(table, row_group_size=table.num_rows)
            else:
                self._text.write("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
        except OSError as exc:  # e.g. a full disk
            raise _error("write rows to", self.path, exc) from exc
        self.rows += table.num_rows

    def close(self) -> None:
        """Finishes the file (the Parquet footer)."""
        try:
            if self._parquet is not None:
                writer, self._parquet = self._parquet, None
                writer.close()
            elif self._text is not None:
                text, self._text = self._text, None
                text.close()
        except OSError as exc:
            raise _error("finish", self.path, exc) from exc


def _error(action: str, path: str, exc: OSError) -> OSError:
    """A failed write of the shard: a :class:`StorageError` naming it (pyarrow's own error names no file)."""
    return exc if isinstance(exc, StorageError) else file_error(path, f"{action} the record shard", exc)


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    types = pa.types
    return bool(types.is_string(arrow_type) or types.is_large_string(arrow_type) or types.is_dictionary(arrow_type))
