"""Two ranks join the library's process groups (``DistributedEnv``); rank 0 starts a collective on the library's
control group that rank 1, alive and asleep, never joins, and then fails inside the call (an exception leaves the
``with``), drops everything and collects garbage. Rank 0 must exit: freeing a gloo group joins its worker, which waits
on rank 1 forever (notes/43-mesh.md §11). Rank 1 sleeps ``SLEEP_S`` seconds, then exits without the collective."""

import gc
import os
import sys
import time

from torch_batch_process.engine.distributed import DistributedEnv

SLEEP_S = 60.0


def main() -> None:
    env = DistributedEnv()
    try:
        with env:
            if env.info.rank == 1:
                time.sleep(SLEEP_S)
                os._exit(0)
            pending = env.collectives.start_max([1, 2, 3])  # rank 1 never takes part: it stays in flight
            raise RuntimeError(f"rank 0 failed with a collective in flight ({pending!r})")
    except RuntimeError as exc:
        print(f"raised: {exc}", flush=True)
    del env
    gc.collect()
    print("released", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
