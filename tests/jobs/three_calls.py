"""Three torch_batch_process() calls in a row in one script (argv[1]: a folder for their storage)."""

import sys

from torch_batch_process import TorchBatchProcessor, torch_batch_process


class Echo(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.total = context.wrap_reducer(lambda values: sum(values), name="total")

    def process_batch(self, batch, batch_idx):
        self.total.update(int(sum(batch)))


for call in range(3):
    n = 50 * (call + 1)
    result = torch_batch_process(
        Echo, list(range(n)), batch_size=5, storage_path=f"{sys.argv[1]}/call{call}", progress=False, tensorboard=False
    )
    assert result.finished and result.metrics == {"total": n * (n - 1) // 2}, result
    print(f"call {call} ok", flush=True)
