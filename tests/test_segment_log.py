"""The segment log's format (torch_batch_process/outputs/segment_log.py): a plain Arrow IPC stream whose record
batches carry their stage; a cut-off last batch counts nothing and fails no read, damage before the end raises.

Real files, real pyarrow readers; the job-level kill tests (a kill -9 halfway through an append, a roll-over, a
resume with another world size) are in tests/test_record_shards.py."""

from __future__ import annotations

import glob
import os
import struct

import pytest

from torch_batch_process import TorchBatchProcessor, iter_outputs, read_outputs, torch_batch_process
from torch_batch_process.errors import OutputCorruptError
from torch_batch_process.outputs.segment_log import CRC_KEY, STAGE_KEY, SegmentLog, read_log, read_log_batch, scan_log

pa = pytest.importorskip("pyarrow")


def _rows(first: int, n: int = 3):
    return pa.table({"index": pa.array(range(first, first + n), pa.int64()), "x": [float(i) for i in range(n)]})


def _write_log(path, stages=(1, 2, 3, 4), close=True) -> bytes:
    log = SegmentLog(str(path))
    for stage in stages:
        log.append(_rows(stage * 10), stage)
    if close:
        log.close()
    return path.read_bytes()


def _index(table) -> list[int]:
    return [] if table is None else table.column("index").to_pylist()


def test_a_log_keeps_the_rows_of_the_committed_stages_only(tmp_path):
    data = _write_log(tmp_path / "segments" / "00000001-rank_0-0.arrows")
    assert _index(read_log(data, lambda stage: stage != 3, "log")) == [10, 11, 12, 20, 21, 22, 40, 41, 42]
    assert read_log(data, lambda stage: False, "log").num_rows == 0  # the schema, no rows


def test_a_closed_log_is_a_plain_arrow_stream_with_each_batch_stage(tmp_path):
    data = _write_log(tmp_path / "log.arrows")
    reader = pa.ipc.open_stream(data)
    stages = []
    while True:
        try:
            batch, metadata = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            break
        stages.append((int(metadata[STAGE_KEY]), batch.num_rows, CRC_KEY in metadata))
    # each append: its rows, then its seal (no rows; the CRC-32 of the append's messages)
    assert stages == [(stage, rows, seal) for stage in (1, 2, 3, 4) for rows, seal in ((3, False), (0, True))]
    assert pa.ipc.open_stream(data).read_all().num_rows == 12


def test_a_log_cut_anywhere_keeps_every_whole_batch_and_never_raises(tmp_path):
    data = _write_log(tmp_path / "log.arrows", close=False)  # a log being appended: no end-of-stream marker
    whole = pa.BufferReader(data)
    reader = pa.ipc.open_stream(whole)
    ends = []  # where each append (its rows and its seal) ends
    for _ in range(4):
        reader.read_next_batch()
        reader.read_next_batch()
        ends.append(whole.tell())
    assert ends[-1] == len(data)
    for cut in range(len(data) + 1):
        whole_appends = sum(1 for end in ends if end <= cut)  # the one being appended at the cut is not committed
        kept = _index(read_log(data[:cut], lambda stage, whole=whole_appends: stage <= whole, "log"))
        assert kept == [i for stage in range(1, whole_appends + 1) for i in range(stage * 10, stage * 10 + 3)], cut


def test_damage_before_the_end_of_a_log_raises_naming_it(tmp_path):
    data = _write_log(tmp_path / "log.arrows")
    whole = pa.BufferReader(data)
    reader = pa.ipc.open_stream(whole)
    reader.read_next_batch()
    second = whole.tell()  # where the second batch's message starts
    for damaged in (
        data[:second] + b"\xfe\xff\xff\xff" + data[second + 4 :],  # its continuation marker
        data[:second] + b"\xff\xff\xff\xff\x00\x00\x00\x00" + data[second + 8 :],  # an end of stream before the end
        data[:second] + b"\xff\xff\xff\xff" + (7).to_bytes(4, "little") + data[second + 8 :],  # its metadata length
    ):
        with pytest.raises(OutputCorruptError, match="my-log.arrows.*damaged"):
            read_log(damaged, lambda stage: True, "my-log.arrows")


def test_a_flipped_byte_inside_a_value_of_a_log_raises_instead_of_reading_another_value(tmp_path):
    """Arrow checks no checksum: without the seals' CRC-32, a flipped byte of a committed value read back (and rolled
    into a published shard) as another value."""
    log = SegmentLog(str(tmp_path / "log.arrows"))
    for stage in (1, 2):
        log.append(pa.table({"index": pa.array([stage], pa.int64()), "x": [1234.5 * stage]}), stage)
    log.close()
    data = (tmp_path / "log.arrows").read_bytes()
    assert read_log(data, lambda stage: True, "log").column("x").to_pylist() == [1234.5, 2469.0]
    for value in (1234.5, 2469.0):  # a value of the first append, then of the second
        at = data.index(struct.pack("<d", value))
        damaged = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
        assert pa.ipc.open_stream(damaged).read_all().column("x").to_pylist() != [1234.5, 2469.0]  # Arrow reads it
        with pytest.raises(OutputCorruptError, match="my-log.arrows.*damaged.*CRC-32"):
            read_log(damaged, lambda stage: True, "my-log.arrows")


def test_a_log_without_seals_from_an_earlier_version_is_read_as_before(tmp_path):
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, _rows(0).schema) as writer:
        for stage in (1, 2, 3):
            for batch in _rows(stage * 10).to_batches():
                writer.write_batch(batch, custom_metadata={STAGE_KEY: str(stage).encode()})
    data = sink.getvalue().to_pybytes()
    assert _index(read_log(data, lambda stage: stage != 2, "log")) == [10, 11, 12, 30, 31, 32]


def test_each_batch_of_a_log_decodes_from_its_own_bytes_and_the_schema(tmp_path):
    data = _write_log(tmp_path / "log.arrows", close=False)
    scan = scan_log(data, lambda stage: stage % 2 == 0, "log")
    assert scan.self_contained and [start < end for start, end, _ in scan.batches] == [True, True]
    for start, end, batch in scan.batches:  # what iter_outputs loads per run: one batch, not the log
        assert read_log_batch(scan.schema, data[start:end]).equals(batch)
    assert [b.column(0)[0].as_py() for _, _, b in scan.batches] == [20, 40]
    dictionary = pa.table({"index": pa.array([1, 2], pa.int64()), "d": pa.array(["a", "b"]).dictionary_encode()})
    log = SegmentLog(str(tmp_path / "dict.arrows"))
    log.append(dictionary, 1)
    log.close()
    assert not scan_log((tmp_path / "dict.arrows").read_bytes(), lambda stage: True, "log").self_contained


def test_a_log_is_never_opened_twice_nor_given_rows_of_another_schema(tmp_path):
    path = tmp_path / "log.arrows"
    _write_log(path, stages=(1,))
    with pytest.raises(FileExistsError):
        SegmentLog(str(path)).append(_rows(0), 5)  # never appends to (or truncates) a log it did not open
    log = SegmentLog(str(tmp_path / "other.arrows"))
    log.append(_rows(0), 1)
    with pytest.raises(ValueError, match="another schema"):
        log.append(pa.table({"index": [1], "y": ["a"]}), 1)
    log.close()


class _Writes(TorchBatchProcessor):
    fail_at: int | None = 5

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        self.context.write({"x": [float(v) for v in batch]})
        if batch_idx == _Writes.fail_at:
            raise RuntimeError("boom")


def test_a_job_on_local_storage_appends_one_log_per_shard_and_a_damaged_log_fails_the_read(tmp_path, monkeypatch):
    storage = str(tmp_path / "storage")
    run = dict(batch_size=2, checkpoint_interval=1, storage_path=storage, progress=False)
    with pytest.raises(RuntimeError, match="boom"):
        torch_batch_process(_Writes, list(range(20)), **run)
    (log,) = glob.glob(os.path.join(storage, "_tbp", "segments", "*.arrows"))  # 5 commits, one file
    assert os.path.basename(log) == "00000001-rank_0-0.arrows"
    assert read_outputs(storage).column("index").to_pylist() == list(range(10))
    data = open(log, "rb").read()
    whole = pa.BufferReader(data)
    pa.ipc.open_stream(whole).read_next_batch()
    second = whole.tell()
    with open(log, "r+b") as f:  # the second commit's batch: its continuation marker damaged
        f.seek(second)
        f.write(b"\xfe\xff\xff\xff")
    with pytest.raises(OutputCorruptError, match="00000001-rank_0-0.arrows"):
        read_outputs(storage)
    with open(log, "r+b") as f:
        f.seek(second)
        f.write(b"\xff\xff\xff\xff")
    monkeypatch.setattr(_Writes, "fail_at", None)
    assert torch_batch_process(_Writes, list(range(20)), **run).finished
    assert read_outputs(storage).column("index").to_pylist() == list(range(20))
    assert not os.listdir(os.path.join(storage, "_tbp", "segments"))


def test_a_flipped_byte_in_a_committed_value_of_a_job_s_log_fails_the_read_and_the_resume(tmp_path, monkeypatch):
    storage = str(tmp_path / "storage")
    run = dict(batch_size=2, checkpoint_interval=1, storage_path=storage, progress=False)
    with pytest.raises(RuntimeError, match="boom"):
        torch_batch_process(_Writes, list(range(20)), **run)
    (log,) = glob.glob(os.path.join(storage, "_tbp", "segments", "*.arrows"))
    data = open(log, "rb").read()
    at = data.index(struct.pack("<d", 7.0))  # example 7's value, committed by the fourth commit
    with open(log, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x40]))
    with pytest.raises(OutputCorruptError, match="00000001-rank_0-0.arrows.*damaged"):
        read_outputs(storage)
    monkeypatch.setattr(_Writes, "fail_at", None)
    with pytest.raises(OutputCorruptError, match="00000001-rank_0-0.arrows.*damaged"):
        torch_batch_process(_Writes, list(range(20)), **run)  # never rolled into a published shard as another value
    with open(log, "r+b") as f:  # the copy restored: the job resumes, every value as computed
        f.seek(at)
        f.write(bytes([data[at]]))
    assert torch_batch_process(_Writes, list(range(20)), **run).finished
    assert read_outputs(storage).column("x").to_pylist() == [float(i) for i in range(20)]


_FAILED_APPEND = r"""
import os, resource, signal, sys
import pyarrow as pa
from torch_batch_process.outputs.segment_log import SegmentLog, read_log

path = sys.argv[1]
rows = lambda first: pa.table({"index": pa.array(range(first, first + 500), pa.int64()), "x": [0.5] * 500})
log = SegmentLog(path)
for stage in (1, 2, 3):
    log.append(rows(stage * 1000), stage)
whole = os.path.getsize(path)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (whole + 3000, resource.RLIM_INFINITY))
try:
    log.append(rows(4000), 4)
    log.append(rows(5000), 5)
except OSError as exc:
    print("append failed:", exc)
else:
    sys.exit("the appends fit the limit: the test proves nothing")
assert os.path.getsize(path) == whole, (os.path.getsize(path), whole)  # cut back to the last whole append
try:
    log.append(rows(6000), 6)
except RuntimeError as exc:
    print("refused:", exc)
log.close()
assert os.path.getsize(path) == whole
table = read_log(open(path, "rb").read(), lambda stage: True, path)
print(sorted(set(v // 1000 for v in table.column("index").to_pylist())))
"""


def test_a_failed_append_cuts_the_log_back_to_its_last_whole_append(tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "00000001-rank_0-0.arrows")
    out = subprocess.run([sys.executable, "-c", _FAILED_APPEND, path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "append failed:" in out.stdout and "refused:" in out.stdout, out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[1, 2, 3]"  # the failed stage left nothing; no error reading


def test_iter_outputs_reads_a_live_log_batch_by_batch_in_index_order(tmp_path, monkeypatch):
    storage = str(tmp_path / "storage")
    run = dict(batch_size=2, checkpoint_interval=1, storage_path=storage, progress=False)
    monkeypatch.setattr(_Writes, "fail_at", 15)
    with pytest.raises(RuntimeError, match="boom"):
        torch_batch_process(_Writes, list(range(40)), **run)
    assert glob.glob(os.path.join(storage, "_tbp", "segments", "*.arrows"))  # the rows are only in the log
    loaded = []
    import torch_batch_process.outputs.readback as readback

    read_batch = readback.read_log_batch
    monkeypatch.setattr(
        readback, "read_log_batch", lambda schema, message: loaded.append(1) or read_batch(schema, message)
    )
    streamed = [b.column("index").to_pylist() for b in iter_outputs(storage, batch_rows=7)]
    assert [i for b in streamed for i in b] == list(range(30)) and all(len(b) <= 7 for b in streamed)
    assert len(loaded) == 15  # one load per committed batch (15 commits of one batch), never the whole log
    assert read_outputs(storage, columns=["x"]).column("x").to_pylist() == [float(i) for i in range(30)]
