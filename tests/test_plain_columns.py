"""``context.write()``'s short way for plain batches (outputs/plain_columns.py): the same rows and types as the long
way, taken only while a batch looks like the rank's checked ones; anything else is checked and raises as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_batch_process import InvalidArgumentError, TorchBatchProcessor, read_outputs, torch_batch_process
from torch_batch_process.outputs import records
from torch_batch_process.outputs.columns import rows_to_table
from torch_batch_process.outputs.plain_columns import PlainColumns

pa = pytest.importorskip("pyarrow")


def _count_long_way(monkeypatch) -> list[int]:
    """Counts the batches whose table the long way (``rows_to_table``) made."""
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return rows_to_table(*args, **kwargs)

    monkeypatch.setattr(records, "rows_to_table", counted)
    return calls


def _columns(ids: list[int]) -> dict:
    base = torch.tensor(ids)
    return {
        "i64": base * 2,
        "f32": base.float() * 0.5,
        "u8": (base % 200).to(torch.uint8),
        "f16": np.asarray(ids, dtype=np.float16),
        "f64": np.asarray(ids, dtype=np.float64) / 4,
    }


class Plain(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        self.context.write(_columns([int(v) for v in batch]))


def _run(tmp_path, processor, n=23, batch_size=4, **kwargs):
    kwargs.setdefault("checkpoint_interval", 2)
    kwargs.setdefault("storage_path", str(tmp_path / "storage"))
    return torch_batch_process(processor, list(range(n)), batch_size=batch_size, progress=False, **kwargs)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_plain_batches_take_the_short_way_and_store_what_the_long_way_stores(tmp_path, monkeypatch, fmt):
    long_way = _count_long_way(monkeypatch)
    result = _run(tmp_path, Plain, output_format=fmt)
    assert result.finished
    assert len(long_way) == 1  # the first batch only: the others have its signature
    table = read_outputs(tmp_path / "storage")
    expected = rows_to_table(_columns(list(range(23))), range(23))
    assert table.column_names == expected.column_names
    if fmt == "parquet":
        assert table.schema.equals(expected.schema)  # the types the long way gives
    assert table.to_pylist() == expected.to_pylist()


class Varied(TorchBatchProcessor):
    """Plain batches, with in between batches that differ from them in one thing each."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        x = torch.tensor(ids, dtype=torch.int32)
        y = torch.tensor(ids, dtype=torch.float32) / 2
        if batch_idx == 2:  # a wider type: the rank's schema widens (int64), the short way must not keep int32
            x = x.long() + 2**40
        elif batch_idx == 3:  # requires grad
            y = y.clone().requires_grad_(True)
        elif batch_idx == 4:  # not contiguous
            y = torch.stack([y, y], 1)[:, 0]
        elif batch_idx == 5:  # a numpy array where a tensor was
            y = y.numpy()
        elif batch_idx == 6:  # the columns in another order
            self.context.write({"y": y, "x": x})
            return
        elif batch_idx == 7:  # a list of values (Python floats: y widens to float64)
            y = y.tolist()
        self.context.write({"x": x, "y": y})


def test_a_batch_unlike_the_plain_ones_takes_the_long_way_and_a_wider_type_ends_the_short_one(tmp_path, monkeypatch):
    long_way = _count_long_way(monkeypatch)
    result = _run(tmp_path, Varied, n=48, batch_size=4)  # 12 batches
    assert result.finished
    table = read_outputs(tmp_path / "storage")
    assert table.schema.field("x").type == pa.int64() and table.schema.field("y").type == pa.float64()
    assert table.column("x").to_pylist() == [i + (2**40 if 8 <= i < 12 else 0) for i in range(48)]
    assert table.column("y").to_pylist() == [i / 2 for i in range(48)]
    # batches 0 and 1 (the first and its twin on the short way), 2 (wider), then each batch of int32 rows is cast to
    # the rank's int64 on the long way (none is kept as it came, so none starts a short way of int32 rows)
    assert len(long_way) == 11


class BadLater(TorchBatchProcessor):
    """Plain batches, then in batch 3 a column of the wrong length (or a reserved name)."""

    bad: dict = {}

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        x = torch.tensor([int(v) for v in batch])
        self.context.write(BadLater.bad if batch_idx == 3 else {"x": x})


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"x": torch.arange(3)}, "column 'x' has shape \\(3,\\); its first dimension must be the batch's 4"),
        ({"x": torch.zeros(4, dtype=torch.complex64)}, "column 'x' holds complex numbers"),
        ({"x": torch.zeros(4, 2)}, "per-example shape"),
        ({"index": torch.arange(4)}, "reserved"),
    ],
)
def test_a_bad_batch_after_plain_ones_is_refused_as_before_and_its_rows_are_not_stored(tmp_path, bad, match):
    BadLater.bad = bad
    with pytest.raises(InvalidArgumentError, match=match):
        _run(tmp_path, BadLater, n=40, batch_size=4, checkpoint_interval=1)
    assert read_outputs(tmp_path / "storage").column("x").to_pylist() == list(range(12))


class StopsAt6(Plain):
    def process_batch(self, batch, batch_idx):
        if batch_idx == 6:
            raise RuntimeError("stops at batch 6")
        super().process_batch(batch, batch_idx)


def test_plain_rows_reach_the_segment_log_as_a_record_batch_per_stage(tmp_path):
    """The short way makes a table per few batches: a stage's plain rows are one record batch of the segment log, tagged
    with its stage, and a failed job's committed rows read back from it."""
    import glob
    import os

    storage = tmp_path / "storage"
    with pytest.raises(RuntimeError, match="stops at batch 6"):
        _run(tmp_path, StopsAt6, n=40, batch_size=4)  # stages 1-3 of 2 batches each, then the failure
    stages, rows = [], []
    for path in sorted(glob.glob(os.path.join(storage, "_tbp", "segments", "*.arrows"))):
        with open(path, "rb") as file:
            reader = pa.ipc.open_stream(file.read())
        for batch, metadata in iter(reader.read_next_batch_with_custom_metadata, None):
            if b"tbp_crc32" not in metadata:  # each append's seal (no rows, its checksum) left out
                stages.append(int(metadata[b"tbp_stage"]))
                rows.append(batch.num_rows)
    # the job's first batch takes the long way (a table of its own), the others of its signature the short one; the long
    # way alone gives a record batch per batch, [1, 1, 2, 2, 3, 3]
    assert stages == [1, 1, 2, 3] and rows == [4, 4, 8, 8]
    expected = rows_to_table(_columns(list(range(24))), range(24))
    assert read_outputs(storage).to_pylist() == expected.to_pylist()


def test_plain_rows_on_an_object_store_read_back_from_segment_files_and_shards(tmp_path, memory_url):
    """An object store keeps a segment file per commit (no appends): plain rows read back the same from them (a failed
    job's committed rows) and from the shards of a finished job."""
    failed, done = f"{memory_url}/failed", f"{memory_url}/done"
    with pytest.raises(RuntimeError, match="stops at batch 6"):
        _run(tmp_path, StopsAt6, n=40, batch_size=4, storage_path=failed)
    assert read_outputs(failed).to_pylist() == rows_to_table(_columns(list(range(24))), range(24)).to_pylist()
    assert _run(tmp_path, Plain, storage_path=done).finished
    assert read_outputs(done).to_pylist() == rows_to_table(_columns(list(range(23))), range(23)).to_pylist()


@pytest.mark.parametrize(
    "indices",
    [
        [range(0, 3), range(3, 6), range(6, 9)],  # a contiguous plan's batches of one rank: one arange
        [range(0, 3), range(6, 9)],  # another rank's batch between them
        [range(0, 6, 2), range(6, 9)],  # a range with a step
        [[5, 1, 7], range(3, 6)],  # a bucketed plan's indices
        [range(4, 7)],
    ],
)
def test_a_join_of_plain_batches_has_each_batch_s_indices_and_values_in_order(indices):
    first = _columns([0, 1, 2])
    plain = PlainColumns(*PlainColumns.signature(first, 3), rows_to_table(first, [0, 1, 2]).schema)
    batches = [plain.arrays(_columns(list(part)), part) for part in indices]
    table = plain.join(batches)
    flat = [i for part in indices for i in part]
    expected = pa.concat_tables([rows_to_table(_columns(list(part)), part) for part in indices])
    assert table.schema.equals(expected.schema) and table.to_pylist() == expected.to_pylist()
    assert table.column("index").to_pylist() == flat
    assert sum(PlainColumns.nbytes(arrays) for arrays in batches) == table.get_total_buffer_size()
