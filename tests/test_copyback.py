"""Device tensors passed to ``context.write`` are copied back asynchronously (outputs/copyback.py, DESIGN §13).

The CPU tests run everywhere: CPU values take the synchronous path unchanged, and the table built over a copy
that is still landing shares its memory (it never snapshots values before the copy is done). The CUDA tests skip
without a GPU; they check that ``write`` returns while the GPU is still busy, that the stored values equal
``.cpu()`` of the originals for every copied type and layout, and a whole job writing device tensors.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from torch_batch_process import TorchBatchProcessor, read_outputs, torch_batch_process
from torch_batch_process.outputs.columns import _from_numpy, column_to_numpy, rows_to_table
from torch_batch_process.outputs.copyback import DeviceCopies

pa = pytest.importorskip("pyarrow")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_values_are_not_taken_and_need_no_wait() -> None:
    copies = DeviceCopies()
    for value in (torch.ones(3), np.ones(3), [torch.ones(2)] * 3, [1, 2, 3], "x"):
        assert not copies.eligible(value)
    done = copies.done()
    assert not done.pending
    done.wait()


def test_cpu_rows_give_the_same_table_with_or_without_copies() -> None:
    rows = {
        "m": torch.arange(12, dtype=torch.float32).reshape(3, 2, 2),
        "b": torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16),
        "l": [torch.ones(2) * i for i in range(3)],
        "s": ["a", "b", "c"],
    }
    plain = rows_to_table(rows, [7, 8, 9])
    copies = DeviceCopies()
    with_copies = rows_to_table(rows, [7, 8, 9], copies)
    copies.done().wait()
    assert with_copies.equals(plain)
    assert plain.schema.field("b").type == pa.float32()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint8])
def test_a_landing_array_is_wrapped_without_reading_its_values(dtype: Any) -> None:
    array = np.zeros((4, 3), dtype=dtype)
    column = _from_numpy(pa, array, landing=True)
    array[:] = 5  # what the copy writes after the table was built
    assert column_to_numpy(column).tolist() == [[5] * 3] * 4
    assert column.type == pa.list_(pa.from_numpy_dtype(np.dtype(dtype)), 3)


# ------------------------------------------------------------------------------------------------ CUDA only


SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: about half a second on current GPUs


@cuda
def test_cuda_write_does_not_wait_for_the_gpu_and_values_land() -> None:
    device = torch.device("cuda")
    source = torch.arange(64 * 5, dtype=torch.float32, device=device).reshape(64, 5)

    def make_rows() -> dict[str, Any]:
        return {
            "f32": source * 2,
            "bf16": (source / 8).to(torch.bfloat16),
            "f16": (source / 4).half(),
            "i64": source.long(),
            "u8": (source % 200).to(torch.uint8),
            "t": source.t().contiguous().t(),  # non-contiguous
            "per_example": [row + 1 for row in source],
            "flags": source > 10,  # booleans: copied with .cpu(), synchronously
        }

    # Every kernel used below runs once first: CUDA loads a kernel at its first launch (lazy loading), and loading
    # synchronizes the context, which would wait out the sleep before the write and leave no copy pending.
    warm = DeviceCopies()
    rows_to_table({k: v for k, v in make_rows().items() if k != "flags"}, list(range(64)), warm)
    warm.done().wait()
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the values below are made after half a second of GPU work
    rows = make_rows()
    copies = DeviceCopies()
    started = time.perf_counter()
    table = rows_to_table({k: v for k, v in rows.items() if k != "flags"}, list(range(64)), copies)
    done = copies.done()
    elapsed = time.perf_counter() - started
    assert elapsed < 0.2, f"write waited {elapsed:.3f} s for the GPU"
    assert not torch.cuda.current_stream(device).query(), "premise: the half-second sleep has not finished yet"
    assert done.pending
    done.wait()
    assert not done.pending
    for name, value in rows.items():
        if name == "flags":
            continue
        expected = torch.stack(value) if isinstance(value, list) else value
        expected = expected.float() if expected.dtype == torch.bfloat16 else expected
        assert np.array_equal(column_to_numpy(table.column(name)), expected.cpu().numpy()), name
    flags = rows_to_table({"flags": rows["flags"]}, list(range(64)), DeviceCopies())  # booleans: .cpu()
    assert np.array_equal(column_to_numpy(flags.column("flags")), rows["flags"].cpu().numpy())


@cuda
def test_cuda_device_memory_freed_after_write_is_not_reused_before_the_copy() -> None:
    device = torch.device("cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    value = torch.full((1 << 20,), 3.0, device=device)
    copies = DeviceCopies()
    table = rows_to_table({"v": value.reshape(1024, 1024)}, list(range(1024)), copies)
    del value  # its block goes back to the allocator on the same stream, after the copy
    overwrite = torch.full((1 << 20,), -1.0, device=device)  # likely the same block, queued after the copy
    done = copies.done()
    done.wait()
    assert float(overwrite[0]) == -1.0
    assert np.all(column_to_numpy(table.column("v")) == 3.0)


class DeviceWriter(TorchBatchProcessor):
    """Writes its outputs as CUDA tensors (and a CPU column beside them)."""

    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        x = self.context.to_device(batch).float()
        torch.cuda._sleep(SLEEP_CYCLES // 50)  # a GPU that is still busy when write() is called
        tags = [int(v) for v in batch]
        self.context.write({"y": torch.stack([x, x * x], dim=1), "half": (x / 2).half(), "tag": tags})


@cuda
@pytest.mark.parametrize("output_format", ["parquet", "jsonl"])
def test_cuda_job_writing_device_tensors_reads_back_in_order(tmp_path: Any, output_format: str) -> None:
    n = 203
    torch_batch_process(
        DeviceWriter, list(range(n)), batch_size=16, storage_path=str(tmp_path / "s"), progress=False,
        checkpoint_interval=3, output_format=output_format,
    )
    table = read_outputs(str(tmp_path / "s"))
    assert table.column("index").to_pylist() == list(range(n))
    assert table.column("y").to_pylist() == [[float(i), float(i * i)] for i in range(n)]
    assert table.column("half").to_pylist() == [i / 2 for i in range(n)]
    assert table.column("tag").to_pylist() == list(range(n))
