"""A tiny job for the tests of joining (tests/test_engine_distributed.py), run as plain processes with the env contract.

argv[1]: the storage path. Environment: ``TBP_TEST_EXIT_BEFORE`` (this rank exits with status 3 before calling the
library), ``TBP_TEST_DIE_IN_JOIN`` (this rank SIGKILLs itself once it has joined, while it waits for the others; rank 0
once every rank joined),
``TBP_TEST_START_AFTER`` (seconds this rank sleeps before calling). Prints ``RESULT <finished>`` or
``RAISED <type>: <message>`` (exit status 1) and ``AT <unix time>`` when the call returned or raised.
"""

import faulthandler
import os
import signal
import sys
import time

from torch_batch_process import TorchBatchProcessor, torch_batch_process

faulthandler.register(signal.SIGUSR1, all_threads=True)
RANK = os.environ["RANK"]


class Processor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        with self.context.upload_path() as path:
            (path / f"b{batch_idx}.txt").write_text(str([int(v) for v in batch]))


if os.environ.get("TBP_TEST_DIE_IN_JOIN") == RANK:
    from torch_batch_process.engine import join

    def die(self, started):
        if RANK == "0":  # once the others are connected to the store it hosts (before, they only wait to connect)
            while self.store.add(self._key("joined"), 0) < self.world_size:
                time.sleep(0.05)
        print("JOINED", time.time(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(join._Rendezvous, "_lead" if RANK == "0" else "_follow", die)

if os.environ.get("TBP_TEST_EXIT_BEFORE") == RANK:
    sys.exit(3)
time.sleep(float(os.environ.get("TBP_TEST_START_AFTER", "0")))
try:
    result = torch_batch_process(Processor, list(range(12)), batch_size=2, storage_path=sys.argv[1], progress=False)
    print("RESULT", result.finished, flush=True)
    print("AT", time.time(), flush=True)
except Exception as exc:  # noqa: BLE001 - reported to the test
    print(f"RAISED {type(exc).__name__}: {exc}", flush=True)
    print("AT", time.time(), flush=True)
    sys.exit(1)
