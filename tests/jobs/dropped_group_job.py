"""Two ranks join the library's process groups (``DistributedEnv``); rank 0 starts a collective on the library's
control group and then fails inside the call (an exception leaves the ``with``), drops everything, collects garbage
and exits with code 3. Rank 1, alive, never joins that collective (it sleeps ``SLEEP_S`` seconds, then exits), or with
``JOIN_AFTER_S`` set joins it that late. Freeing a gloo group joins its worker, which would wait on rank 1: rank 0
must neither hang there nor at its exit (engine/pending_collectives.py, notes/43-mesh.md §11)."""

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
                if "JOIN_AFTER_S" not in os.environ:
                    time.sleep(SLEEP_S)
                    os._exit(0)
                time.sleep(float(os.environ["JOIN_AFTER_S"]))
                print(f"joined: {env.collectives.start_max([0, 0, 0]).wait()}", flush=True)
                return
            pending = env.collectives.start_max([1, 2, 3])  # in flight: rank 1 takes part late or never
            raise RuntimeError(f"rank 0 failed with a collective in flight ({pending!r})")
    except RuntimeError as exc:
        print(f"raised: {exc}", flush=True)
    del env
    gc.collect()
    print("released", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
