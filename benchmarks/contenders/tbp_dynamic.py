"""torch_batch_process with ``schedule="dynamic"``: each rank takes the next batch when it is free (DESIGN §8).

Otherwise the same job as :mod:`benchmarks.contenders.tbp`; with one process the schedule is the static one.
"""

from __future__ import annotations

from benchmarks.common import parse_options
from benchmarks.contenders import tbp

if __name__ == "__main__":
    tbp.run(parse_options(), schedule="dynamic")
