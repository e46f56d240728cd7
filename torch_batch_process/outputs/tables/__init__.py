"""Table outputs: ``context.write()`` rows committed exactly once into a Delta Lake, Iceberg or Lance table.

::

    from torch_batch_process import tables, torch_batch_process

    torch_batch_process(Processor, dataset, table=tables.delta("s3://bucket/embeddings"))
    torch_batch_process(Processor, dataset, table=tables.iceberg("db.embeddings", catalog={...}))
    torch_batch_process(Processor, dataset, table=tables.lance("/data/embeddings.lance"))

Each format is an optional extra (``pip install -e ".[delta]"``, ``[iceberg]``, ``[lance]``);
Parquet/JSONL shards in the job's storage stay the default. The protocol is
:mod:`torch_batch_process.outputs.tables.commits`; :func:`torch_batch_process.read_outputs` reads a table back in
dataset order.
"""

from torch_batch_process.outputs.tables.base import TableTarget
from torch_batch_process.outputs.tables.delta import delta
from torch_batch_process.outputs.tables.iceberg import iceberg
from torch_batch_process.outputs.tables.lance import lance

__all__ = ["TableTarget", "delta", "iceberg", "lance"]
