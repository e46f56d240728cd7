"""Table targets for ``context.write()`` rows: ``torch_batch_process(..., table=tables.delta(uri))``.

The public face of :mod:`torch_batch_process.outputs.tables` (see there, and docs/tables.md).
"""

from torch_batch_process.outputs.tables import TableTarget, delta, iceberg, lance

__all__ = ["TableTarget", "delta", "iceberg", "lance"]
