"""Record outputs (DESIGN §10): context.write(), Parquet/JSONL shards committed exactly once, ordered read-back
(read_outputs, iter_outputs), external readers, kill -9 and resume with another world size, and predict()."""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import (
    JOBS,
    assert_exactly_once,
    base_env,
    committed_batches,
    free_port,
    read_reports,
    run_torchrun,
    spawn_ranks,
    start_process,
    wait_all,
)

from torch_batch_process import (
    InvalidArgumentError,
    JobMismatchError,
    OutputCorruptError,
    SchemaConflictError,
    TorchBatchProcessor,
    iter_outputs,
    predict,
    read_outputs,
    torch_batch_process,
)
from torch_batch_process.outputs.columns import column_to_numpy
from torch_batch_process.outputs.readback import OUTPUTS_GLOB, RETRY_OUTPUTS_GLOB

pa = pytest.importorskip("pyarrow")

RECORDS_JOB = JOBS / "records_job.py"
FORMATS = ["parquet", "jsonl"]


class Rich(TorchBatchProcessor):
    """Writes columns of every kind the docs promise: tensors of several shapes, strings, ints, floats, lists."""

    fail_at: int | None = None

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        self.context.write(
            {
                "matrix": torch.stack([torch.arange(6, dtype=torch.float32).reshape(3, 2) + i for i in ids]),
                "vector": np.array([[i, -i, 2 * i, 0] for i in ids], dtype=np.int32),
                "score": torch.tensor([i / 4 for i in ids], dtype=torch.float64),
                "count": [i * 10 for i in ids],
                "name": [f"n{i}" for i in ids],
                "nested": [[[i] * (i % 3)] for i in ids],
                "ragged": [torch.ones(i % 4) * i for i in ids],
            }
        )
        if batch_idx == Rich.fail_at:
            raise RuntimeError(f"fail at {batch_idx}")


def _run(tmp_path, processor=Rich, n=37, batch_size=5, **kwargs):
    kwargs.setdefault("storage_path", str(tmp_path / "storage"))
    kwargs.setdefault("checkpoint_interval", 2)
    return torch_batch_process(processor, list(range(n)), batch_size=batch_size, progress=False, **kwargs)


def _check_rich(table, n):
    assert table.column("index").to_pylist() == list(range(n))
    rows = table.to_pylist()
    for i, row in enumerate(rows):
        assert row["matrix"] == [[2 * k + i, 2 * k + 1 + i] for k in range(3)]
        assert row["vector"] == [i, -i, 2 * i, 0]
        assert row["score"] == i / 4 and row["count"] == i * 10 and row["name"] == f"n{i}"
        assert row["nested"] == [[i] * (i % 3)]
        assert row["ragged"] == [float(i)] * (i % 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_and_read_back_every_kind_of_column(tmp_path, fmt):
    result = _run(tmp_path, output_format=fmt)
    assert result.finished
    table = read_outputs(result.storage_path)
    assert table.column_names[0] == "index"
    _check_rich(table, 37)
    streamed = list(iter_outputs(result.storage_path, batch_rows=4))
    assert all(b.num_rows <= 4 for b in streamed)
    assert pa.Table.from_batches(streamed).to_pylist() == table.to_pylist()
    only = read_outputs(result.storage_path, columns=["name"])
    assert only.column_names == ["index", "name"] and only.column("name").to_pylist() == [f"n{i}" for i in range(37)]
    shards = glob.glob(os.path.join(result.storage_path, OUTPUTS_GLOB + "." + fmt))
    assert len(shards) == 1  # one shard per rank and TBP_SHARD_BYTES, rolled over at the closing commit
    assert not list(Path(result.storage_path, "_tbp", "segments").glob("*"))  # the segments it holds are deleted
    # types and per-example shapes come back exactly, from JSONL too (cast to the schema the commit records keep)
    matrix = column_to_numpy(table.column("matrix"))
    assert matrix.shape == (37, 3, 2) and matrix.dtype == np.float32
    vector = column_to_numpy(table.column("vector"))
    assert vector.shape == (37, 4) and vector.dtype == np.int32
    assert pa.types.is_float64(table.schema.field("score").type)
    assert pa.types.is_list(table.schema.field("ragged").type)  # written as a list of per-example tensors
    assert streamed[0].schema == table.schema


class ReusedBuffers(TorchBatchProcessor):
    """Writes from buffers it reuses for every batch (a tensor, a numpy array, a 2-d tensor), changed in place after
    each write() returns: the rows must hold the values of the call, not the buffers' last ones. Without the 2-d
    column (``plain``), the batches take ``context.write``'s short way (outputs/plain_columns.py)."""

    plain = False

    def __init__(self, context):
        self.context = context
        self.tensor = torch.zeros(4, dtype=torch.int64)
        self.array = np.zeros(4, dtype=np.float32)
        self.matrix = torch.zeros(4, 3)

    def process_batch(self, batch, batch_idx):
        n = len(batch)
        self.tensor[:n] = batch * 10
        self.array[:n] = batch.numpy() / 2
        self.matrix[:n] = batch[:, None].float()
        rows = {"t": self.tensor[:n], "a": self.array[:n]}
        self.context.write(rows if ReusedBuffers.plain else dict(rows, m=self.matrix[:n]))
        self.tensor.fill_(-1)  # what a processor may do before its next batch
        self.array.fill(-1)
        self.matrix.fill_(-1)


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_hold_the_values_of_the_call_when_the_processor_reuses_its_buffers(tmp_path, fmt, plain, monkeypatch):
    monkeypatch.setattr(ReusedBuffers, "plain", plain)
    result = torch_batch_process(
        ReusedBuffers, torch.arange(38), batch_size=4, checkpoint_interval=3, storage_path=str(tmp_path / "s"),
        progress=False, output_format=fmt,
    )  # fmt: skip
    rows = read_outputs(result.storage_path).to_pylist()
    assert [row["index"] for row in rows] == list(range(38))
    assert [row["t"] for row in rows] == [10 * i for i in range(38)]
    assert [row["a"] for row in rows] == [i / 2 for i in range(38)]
    if not plain:
        assert [row["m"] for row in rows] == [[float(i)] * 3 for i in range(38)]


def test_jsonl_and_parquet_outputs_read_back_as_the_same_table(tmp_path):
    tables = {}
    for fmt in FORMATS:
        result = _run(tmp_path, storage_path=str(tmp_path / fmt), output_format=fmt)
        tables[fmt] = read_outputs(result.storage_path)
    parquet, jsonl = tables["parquet"], tables["jsonl"]
    assert [f.type for f in jsonl.schema] == [f.type for f in parquet.schema]
    assert jsonl.to_pylist() == parquet.to_pylist()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("damage", ["cut", "folder"])
def test_a_damaged_shard_is_named_when_reading_back(tmp_path, monkeypatch, fmt, damage):
    monkeypatch.setenv("TBP_SHARD_BYTES", "1")  # a shard per commit
    result = _run(tmp_path, output_format=fmt)
    shard = sorted(glob.glob(os.path.join(result.storage_path, OUTPUTS_GLOB + "." + fmt)))[1]
    if damage == "folder":  # a bad restore
        os.remove(shard)
        os.mkdir(shard)
    else:
        with open(shard, "r+b") as f:  # cut off in the middle: a disk or a copy that lost its end
            f.truncate(os.path.getsize(shard) // 2 + 3)  # mid-line for JSONL (rows may have equal lengths)
    for read in (read_outputs, lambda path: list(iter_outputs(path))):
        with pytest.raises(OutputCorruptError, match="cannot be read.*damaged") as caught:
            read(result.storage_path)
        assert os.path.basename(shard) in str(caught.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_missing_or_extra_shard_is_an_error_not_a_table_with_rows_missing_or_repeated(tmp_path, monkeypatch, fmt):
    monkeypatch.setenv("TBP_SHARD_BYTES", "1")  # a shard per commit
    result = _run(tmp_path, output_format=fmt)
    record = json.loads(next(Path(result.storage_path, "_tbp", "commits").glob("*.json")).read_text())
    assert record["stats"]["record_rows"] == 37  # the final record counts the committed rows
    shards = sorted(glob.glob(os.path.join(result.storage_path, OUTPUTS_GLOB + "." + fmt)))
    spare = tmp_path / "spare"
    os.rename(shards[1], spare)  # lost (deleted by hand, or a copy that missed it)
    for read in (read_outputs, lambda path: list(iter_outputs(path))):
        missing = r"committed 37 record rows, but its shards hold 27: shards are missing"
        with pytest.raises(OutputCorruptError, match=missing):
            read(result.storage_path)
    os.rename(spare, shards[1])
    _check_rich(read_outputs(result.storage_path), 37)
    copy = Path(shards[1]).with_name("part-99999999-rank0-00000." + fmt)
    copy.write_bytes(Path(shards[1]).read_bytes())  # the same rows twice
    for read in (read_outputs, lambda path: list(iter_outputs(path))):
        with pytest.raises(OutputCorruptError, match="shards were added"):
            read(result.storage_path)


def test_outputs_of_a_job_killed_while_publishing_read_back_without_a_false_alarm(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TBP_SHARD_BYTES", "1")  # a shard per commit
    result = _run(tmp_path)
    # as if killed between the final record and the publication of stage 3: it is still staged
    staged = Path(result.storage_path, "_tbp", "staging", "00000003")
    staged.mkdir(parents=True)
    os.rename(Path(result.storage_path, "outputs", "commit_00000003", "rank_0"), staged / "rank_0")
    table = read_outputs(result.storage_path)  # what is published, with a warning; no completeness error
    assert table.num_rows == 37 - 10 and "still staged" in caplog.text
    again = _run(tmp_path)  # the next start publishes it
    assert again.finished and again.already_finished
    _check_rich(read_outputs(result.storage_path), 37)


def test_jsonl_outputs_stay_readable_when_the_commit_record_is_damaged(tmp_path, caplog):
    result = _run(tmp_path, output_format="jsonl")
    for record in Path(result.storage_path, "_tbp", "commits").glob("*.json"):
        record.write_text("{ damaged")
    table = read_outputs(result.storage_path)  # the published shards are whole: read with JSON's own types
    _check_rich(table, 37)
    assert pa.types.is_float64(table.schema.field("matrix").type.value_type.value_type)
    assert "not the written ones" in caplog.text and "corrupt" in caplog.text


def test_shards_are_read_by_pandas_and_datasets_with_the_documented_glob(tmp_path):
    pd = pytest.importorskip("pandas")
    storage = str(tmp_path / "storage")
    _run(tmp_path, storage_path=storage)
    pattern = os.path.join(storage, OUTPUTS_GLOB + ".parquet")
    df = pd.concat([pd.read_parquet(p) for p in glob.glob(pattern)]).sort_values("index")
    assert df["index"].tolist() == list(range(37)) and df["name"].tolist() == [f"n{i}" for i in range(37)]
    assert [list(map(list, m)) for m in df["matrix"].iloc[:2]] == [[[0, 1], [2, 3], [4, 5]], [[1, 2], [3, 4], [5, 6]]]
    jsonl = str(tmp_path / "jsonl")
    _run(tmp_path, storage_path=jsonl, output_format="jsonl")
    lines = pd.concat([pd.read_json(p, lines=True) for p in glob.glob(os.path.join(jsonl, OUTPUTS_GLOB + ".jsonl"))])
    assert sorted(lines["index"]) == list(range(37))
    try:
        import datasets
    except ImportError:
        return
    ds = datasets.load_dataset("parquet", data_files=pattern, split="train").sort("index")
    assert ds["index"] == list(range(37)) and ds["count"] == [i * 10 for i in range(37)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_bucketed_batches_interleave_and_come_back_in_dataset_order(tmp_path, fmt):
    n = 400
    lengths = np.random.default_rng(0).integers(1, 50, size=n)
    result = _run(tmp_path, n=n, batch_size=8, bucket_by=lengths, bucket_window=10, checkpoint_interval=3, output_format=fmt)
    table = read_outputs(result.storage_path)
    assert table.column("index").to_pylist() == list(range(n))
    assert table.column("count").to_pylist() == [10 * i for i in range(n)]
    merged = pa.Table.from_batches(list(iter_outputs(result.storage_path, batch_rows=7)))
    assert merged.to_pylist() == table.to_pylist()


def test_a_batch_that_raises_contributes_no_rows_and_a_resume_writes_each_row_once(tmp_path):
    Rich.fail_at = 3
    try:
        with pytest.raises(RuntimeError, match="fail at 3"):
            _run(tmp_path, checkpoint_interval=1)
        partial = read_outputs(str(tmp_path / "storage"))
        assert partial.column("index").to_pylist() == list(range(15))  # batches 0-2 committed, not 3
    finally:
        Rich.fail_at = None
    result = _run(tmp_path, checkpoint_interval=1)
    assert result.finished
    _check_rich(read_outputs(result.storage_path), 37)


def test_a_resume_in_another_output_format_is_refused(tmp_path):
    Rich.fail_at = 2
    try:
        with pytest.raises(RuntimeError):
            _run(tmp_path, checkpoint_interval=1)
    finally:
        Rich.fail_at = None
    with pytest.raises(JobMismatchError, match="output_format"):
        _run(tmp_path, checkpoint_interval=1, output_format="jsonl")


class Misuse(TorchBatchProcessor):
    rows = None

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        self.context.write(Misuse.rows(batch))


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (lambda b: {"x": b[:-1]}, "first dimension"),
        (lambda b: {"index": b}, "reserved"),
        (lambda b: {"x": 3}, "one value per example"),
        (lambda b: [{"a": 1}] * len(b) + [{"a": 2}], "row dicts"),
        (lambda b: "text", "dict of columns"),
        (lambda b: {"z": torch.zeros(len(b), dtype=torch.complex64)}, r"column 'z' holds complex numbers.*view_as_real"),
        (lambda b: {"z": [torch.zeros(2, dtype=torch.complex64)] * len(b)}, "column 'z' holds complex numbers"),
        (lambda b: {1: b}, "column names must be non-empty str, got 1"),  # was stored as the column '1'
        (lambda b: {"": b}, "column names must be non-empty str, got ''"),
    ],
)
def test_bad_rows_are_clear_errors(tmp_path, rows, match):
    Misuse.rows = rows
    with pytest.raises(InvalidArgumentError, match=match):
        _run(tmp_path, processor=Misuse, n=10)


def test_bad_output_format_is_refused_before_any_write(tmp_path):
    with pytest.raises(InvalidArgumentError, match="output_format"):
        _run(tmp_path, output_format="csv")
    assert not (tmp_path / "storage").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_unknown_columns_and_bad_storage_options_are_clear_errors_when_reading_back(tmp_path, fmt):
    Misuse.rows = lambda b: {"score": [float(x) for x in b]}
    result = _run(tmp_path, processor=Misuse, n=10, batch_size=3, output_format=fmt)
    readers = [read_outputs, lambda path, **kw: list(iter_outputs(path, **kw))]
    unknown = r"columns: unknown column\(s\) \['scroe'\].*\['index', 'score'\]"  # the argument, the names, the columns
    for read in readers:
        with pytest.raises(InvalidArgumentError, match=unknown):
            read(result.storage_path, columns=["score", "scroe"])
        with pytest.raises(InvalidArgumentError, match="storage_options must be a dict"):
            read(result.storage_path, storage_options=[1])
        assert read(result.storage_path, columns=["score"], storage_options={}) is not None


def test_read_back_arguments_are_checked_when_called_and_a_generator_of_columns_is_read_once(tmp_path):
    """columns=(c for c in ...) was used up by its own type check and read back the index alone; iter_outputs checked
    its arguments only once iterated; batch_rows=True read batches of one row."""
    Misuse.rows = lambda b: {"score": [float(x) for x in b], "other": [1] * len(b)}
    result = _run(tmp_path, processor=Misuse, n=10, batch_size=3)
    assert read_outputs(result.storage_path, columns=(c for c in ["score"])).column_names == ["index", "score"]
    streamed = list(iter_outputs(result.storage_path, columns=(c for c in ["score"])))
    assert streamed[0].schema.names == ["index", "score"]
    for bad, needle in ((0, "batch_rows"), (True, "batch_rows"), (2.0, "batch_rows")):
        with pytest.raises(InvalidArgumentError, match=needle):
            iter_outputs(result.storage_path, batch_rows=bad)  # not iterated: refused at the call
    for bad in ("score", 5, {"score": 1}):
        with pytest.raises(InvalidArgumentError, match="columns must be a list"):
            iter_outputs(result.storage_path, columns=bad)
    with pytest.raises(InvalidArgumentError, match="storage_path"):
        iter_outputs(None)
    with pytest.raises(InvalidArgumentError, match="Did you mean 's3://bucket/x'"):
        iter_outputs("s3:/bucket/x")


def test_list_of_row_dicts_and_write_outside_process_batch(tmp_path):
    Misuse.rows = lambda b: [{"v": int(x), "t": torch.tensor([int(x), 1])} for x in b]
    result = _run(tmp_path, processor=Misuse, n=10, batch_size=3)
    table = read_outputs(result.storage_path)
    assert table.column("v").to_pylist() == list(range(10))
    assert column_to_numpy(table.column("t")).tolist() == [[i, 1] for i in range(10)]

    class Early(TorchBatchProcessor):
        def __init__(self, context):
            context.write({"x": [1]})

        def process_batch(self, batch, batch_idx):
            pass

    with pytest.raises(RuntimeError, match="only available inside process_batch"):
        _run(tmp_path / "early", processor=Early, n=4)


def test_predict_in_one_process_returns_outputs_in_order_and_resumes(tmp_path):
    calls = []

    def fn(batch):
        calls.append(len(batch))
        return batch.float()[:, None] * torch.ones(1, 3)

    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "tbp-predict-*")))
    out = predict(fn, list(range(23)), 4, progress=False)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "tbp-predict-*"))) <= before  # temporary folder removed
    assert sum(calls) == 23
    assert out.shape == (23, 3) and out[:, 0].tolist() == [float(i) for i in range(23)]

    def named(batch):
        return {"double": batch * 2, "text": [f"t{int(v)}" for v in batch]}

    storage = str(tmp_path / "pred")
    first = predict(named, list(range(10)), 3, storage_path=storage, progress=False, collate_fn=lambda xs: torch.tensor(xs))
    assert first["double"].tolist() == [2 * i for i in range(10)] and first["text"] == [f"t{i}" for i in range(10)]
    again = predict(named, list(range(10)), 3, storage_path=storage, progress=False, collate_fn=lambda xs: torch.tensor(xs))
    assert again["double"].tolist() == first["double"].tolist()  # a finished job: read back, not recomputed
    with pytest.raises(JobMismatchError):  # another function is another job
        predict(fn, list(range(10)), 3, storage_path=storage, progress=False)



def test_a_preempted_predict_raises_instead_of_returning_the_outputs_committed_so_far(tmp_path):
    """A SIGTERM during predict(): the call raised nothing and returned the committed rows only (a tensor of 16 rows
    for a dataset of 40, rows of uncommitted batches missing). It raises PreemptedError; the same call again resumes
    and returns every output in dataset order."""
    import signal

    from torch_batch_process import PreemptedError

    calls = []

    def fn(batch):
        calls.append(batch.tolist())
        if len(calls) == 4 and not preempted:
            signal.raise_signal(signal.SIGTERM)  # the library's handler: the job commits and stops at the step's end
        return batch.float()[:, None]

    storage = str(tmp_path / "pred")
    preempted = False
    with pytest.raises(PreemptedError, match="preempted with 4 of 10 batches committed.*run the same command again"):
        predict(fn, torch.arange(40), 4, storage_path=storage, progress=False, checkpoint_interval=1)
    preempted = True
    out = predict(fn, torch.arange(40), 4, storage_path=storage, progress=False, checkpoint_interval=1)
    assert out[:, 0].tolist() == [float(i) for i in range(40)] and len(calls) == 10, "only the 6 batches left ran"
    with pytest.raises(PreemptedError, match="temporary storage is removed: give storage_path="):
        calls.clear()
        preempted = False
        predict(fn, torch.arange(40), 4, progress=False, checkpoint_interval=1)

@pytest.mark.parametrize("option", [{"on_error": "skip"}, {"retry_failed": True}])
def test_predict_refuses_skipping_examples(tmp_path, option):
    """predict() returns one output per example in dataset order: a skipped example would shift every later one,
    so on_error="skip" (and retry_failed) are refused before any work."""
    storage = tmp_path / "pred"
    with pytest.raises(InvalidArgumentError, match="shift every later output"):
        predict(lambda batch: batch, list(range(10)), 3, storage_path=str(storage), progress=False, **option)
    assert not storage.exists()


def test_predict_refuses_a_table_a_key_and_a_collate_fn_given_twice_before_any_work(tmp_path):
    """predict(table=...) ran the whole job into the table, then failed reading shards that were never written;
    collate_fn given both ways silently dropped one."""
    from torch_batch_process import tables

    storage = tmp_path / "pred"
    with pytest.raises(InvalidArgumentError, match="predict\\(\\) does not take table="):
        predict(lambda b: b, list(range(4)), 2, storage_path=str(storage), table=tables.delta(str(tmp_path / "t")))
    # key= (DESIGN §21): the outputs were read from the incremental run's folder (OutputCorruptError), and a keyed
    # job's rows carry its key columns, not fn's outputs only
    with pytest.raises(InvalidArgumentError, match="predict\\(\\) does not take key="):
        predict(lambda b: b, [{"id": i} for i in range(4)], 2, storage_path=str(storage), key="id", incremental=True)
    with pytest.raises(InvalidArgumentError, match="collate_fn is given both"):
        predict(
            lambda b: b, list(range(4)), 2, storage_path=str(storage), collate_fn=torch.utils.data.default_collate,
            dataloader_kwargs={"collate_fn": torch.utils.data.default_collate},
        )
    with pytest.raises(InvalidArgumentError, match="dataloader_kwargs must be a dict"):
        predict(lambda b: b, list(range(4)), 2, storage_path=str(storage), dataloader_kwargs=[("num_workers", 0)])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda batch: batch.sum(), r"its output has shape \(\)"),
        (lambda batch: batch[:-1], r"its output has shape \(2,\); its first dimension must be the batch's 3"),
        (lambda batch: None, "its output is one NoneType value"),
        (lambda batch: {"a": batch, "b": 1.5}, "column 'b' is one float value"),
    ],
)
def test_predict_names_fn_when_its_output_is_not_one_value_per_example(tmp_path, fn, match):
    with pytest.raises(InvalidArgumentError, match=r"predict\(fn=\.\.\.\): fn\(batch\) must return .*" + match):
        predict(fn, torch.arange(9), 3, storage_path=str(tmp_path / "pred"), progress=False)


# ----------------------------------------------------------------------------- multi-process

def _spec(tmp_path, **extra):
    spec = {"n": 240, "batch_size": 4, "checkpoint_interval": 3, "storage": str(tmp_path / "storage"),
            "report_dir": str(tmp_path / "reports")}
    spec.update(extra)
    return spec


def _check_job_outputs(storage: str, n: int) -> None:
    table = read_outputs(storage)
    counts = Counter(table.column("index").to_pylist())
    assert_exactly_once(counts, n)
    assert table.column("index").to_pylist() == list(range(n))
    assert table.column("label").to_pylist() == [f"ex{i}" for i in range(n)]
    assert [row[0] for row in table.column("emb").to_pylist()] == [float(i) for i in range(n)]
    assert table.column("parts").to_pylist() == [[i] * (i % 3) for i in range(n)]
    assert pa.Table.from_batches(list(iter_outputs(storage, batch_rows=50))).equals(table)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "schedule"), [("parquet", "static"), ("jsonl", "dynamic")])
def test_two_processes_ordered_read_back(tmp_path, fmt, schedule):
    spec = _spec(tmp_path, kwargs={"output_format": fmt, "schedule": schedule})
    outcomes = wait_all(spawn_ranks(2, RECORDS_JOB, json.dumps(spec)), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    _check_job_outputs(spec["storage"], spec["n"])
    ranks = {Path(p).parent.parent.name for p in glob.glob(os.path.join(spec["storage"], OUTPUTS_GLOB + "." + fmt))}
    assert ranks == {"rank_0", "rank_1"}


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "schedule"), [("parquet", "static"), ("jsonl", "static"), ("parquet", "dynamic")])
def test_kill9_then_resume_with_another_world_size_every_index_once(tmp_path, fmt, schedule):
    progress = tmp_path / "progress"
    kwargs = {"output_format": fmt, "schedule": schedule}
    spec = _spec(tmp_path, n=600, kwargs=kwargs, sleep=0.02, progress_file=str(progress))
    procs = spawn_ranks(2, RECORDS_JOB, json.dumps(spec))
    segments = os.path.join(spec["storage"], "_tbp", "segments", "*.arrow*")  # rows not rolled into a shard yet
    deadline = time.monotonic() + 90
    # some commits are durable (a record: segments alone may precede rank 0's first record), the others under way
    while not (committed_batches(spec["storage"]) and glob.glob(segments)):
        assert time.monotonic() < deadline, "the job never published a commit"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.02)
    time.sleep(0.2)
    os.kill(procs[1].pid, signal.SIGKILL)
    outcomes = wait_all(procs, timeout=60)
    assert outcomes[1][0] == -signal.SIGKILL and outcomes[0][0] not in (0, None), outcomes
    committed = read_outputs(spec["storage"]).column("index").to_pylist()
    assert 0 < len(committed) < spec["n"] and len(set(committed)) == len(committed)  # partial, no duplicate
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, json.dumps(dict(spec, attempt=2, sleep=0))), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0], outcomes
    assert read_reports(spec, 2)[0]["result"]["finished"]
    _check_job_outputs(spec["storage"], spec["n"])


@pytest.mark.slow
def test_predict_under_torchrun_every_rank_gets_the_full_ordered_list(tmp_path):
    spec = {"mode": "predict", "n": 50, "batch_size": 4, "report_dir": str(tmp_path / "reports")}
    proc = run_torchrun(2, RECORDS_JOB, json.dumps(spec), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = read_reports(spec)
    expected = [[float(i), 2.0 * i] for i in range(50)]
    assert sorted(reports) == [0, 1]
    assert all(reports[r]["predicted"] == expected for r in reports)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["launcher", "tbp run"])
def test_predict_without_storage_path_on_two_processes_of_one_machine(tmp_path, how):
    """Issue 26 item 3: under the library's launcher and ``tbp run`` each worker has a parent of its own, so a
    temporary folder named after the parent's pid differed between the ranks (StorageError, "not shared by all
    ranks"). Rank 0 now makes it and tells the others; it is removed afterwards."""
    import subprocess

    import yaml
    from harness import launcher_cmd, tbp_cmd

    spec = {"mode": "predict", "n": 30, "batch_size": 4, "report_dir": str(tmp_path / "reports")}
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "tbp-predict-*")))
    if how == "launcher":
        command = launcher_cmd("--nproc-per-node", "2", "python3", str(RECORDS_JOB), json.dumps(spec))
    else:
        config = {"name": "predict", "entrypoint": ["python3", str(RECORDS_JOB), json.dumps(spec)],
                  "resources": {"slots_per_trial": 2}}
        (tmp_path / "predict.yaml").write_text(yaml.safe_dump(config))
        command = tbp_cmd("run", str(tmp_path / "predict.yaml"))
    proc = subprocess.run(command, env=base_env(), capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = read_reports(spec)
    assert sorted(reports) == [0, 1]
    assert all(reports[r]["predicted"] == [[float(i), 2.0 * i] for i in range(30)] for r in reports)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "tbp-predict-*"))) <= before, "the folder is removed"


@pytest.mark.slow
def test_predict_without_storage_path_on_several_machines_says_to_give_a_shared_one(tmp_path):
    spec = {"mode": "predict", "n": 10, "batch_size": 4, "report_dir": str(tmp_path / "reports")}
    env = base_env()
    procs = []
    port = str(free_port())
    for rank in range(2):  # two "machines" of one process each, as torchrun describes them to the workers
        rank_env = dict(env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(start_process([sys.executable, str(RECORDS_JOB), json.dumps(spec)], rank_env))
    outcomes = wait_all(procs, timeout=120)
    for rc, _, err in outcomes:
        assert rc != 0 and "InvalidArgumentError" in err, err[-3000:]
        assert "runs on 2 machines: give storage_path=" in err and "object store URL" in err, err[-3000:]


_THREADS_SCRIPT = """
import json, os, sys, threading, time
import torch
from torch_batch_process import TorchBatchProcessor, iter_outputs, read_outputs, torch_batch_process

def threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:
            pass
    return sorted(names)

class P(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
    def process_batch(self, batch, batch_idx):
        self.context.write({"x": batch.float() * 2, "v": torch.stack([batch.float(), -batch.float()], 1)})

before = threads()
for fmt in ("parquet", "jsonl"):
    result = torch_batch_process(P, list(range(10)), batch_size=3, storage_path=sys.argv[1] + fmt, progress=False,
                                 output_format=fmt)
    assert read_outputs(result.storage_path).num_rows == 10
    assert sum(b.num_rows for b in iter_outputs(result.storage_path, batch_rows=4)) == 10
deadline = time.monotonic() + 5
while threads() != before and time.monotonic() < deadline:  # a thread that is ending
    time.sleep(0.1)
print(json.dumps({"before": before, "after": threads(), "python": [t.name for t in threading.enumerate()]}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads with /proc")
def test_a_call_and_the_read_back_leave_no_thread_running(tmp_path):
    """Issue 26 item 6: a 1-process job with context.write() and read_outputs() died at interpreter exit now and
    then (SIGABRT, "terminate called without an active exception"): a thread of pyarrow's pool, still releasing a
    buffer that held a Python object, took the GIL while the interpreter was exiting. Every thread the call and the
    read-back start is ended before they return (pyarrow's pools are not even started)."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT, str(tmp_path / "s")], env=base_env(), capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = json.loads(proc.stdout.strip().splitlines()[-1])
    assert threads["after"] == threads["before"], threads
    assert threads["python"] == ["MainThread"], threads


class FilesOnly(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        with self.context.upload_path() as path:
            (path / f"pred_{batch_idx}.json").write_text(json.dumps([int(v) for v in batch]))


def test_read_outputs_of_a_job_without_records_says_so_and_where_its_files_are(tmp_path, caplog):
    """Issue 26 item 7: a job that wrote only upload_path() files (the digits example) read back an empty table
    without a word."""
    result = _run(tmp_path, processor=FilesOnly, n=10, batch_size=4)
    table = read_outputs(result.storage_path)
    assert table.num_rows == 0 and table.column_names == ["index"]
    assert list(iter_outputs(result.storage_path)) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings
    for message in warnings:
        assert "the job wrote no records (context.write())" in message, message
        assert os.path.join(result.storage_path, "outputs") in message, message


@pytest.mark.parametrize("fmt", FORMATS)
def test_small_row_groups_and_rolled_shards_read_back_in_order(tmp_path, monkeypatch, fmt):
    from torch_batch_process.outputs import records

    monkeypatch.setattr(records, "ROW_GROUP_BYTES", 300)  # a row group every few batches
    monkeypatch.setenv("TBP_SHARD_BYTES", "1500")  # a shard every few commits
    result = _run(tmp_path, n=90, batch_size=4, checkpoint_interval=2, output_format=fmt)
    shards = glob.glob(os.path.join(result.storage_path, OUTPUTS_GLOB + "." + fmt))
    assert 1 < len(shards) < 12  # rolled over by size at commits (12 commits)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        assert max(pq.ParquetFile(p).metadata.num_row_groups for p in shards) > 1
    table = read_outputs(result.storage_path)
    _check_rich(table, 90)
    assert pa.Table.from_batches(list(iter_outputs(result.storage_path, batch_rows=5))).to_pylist() == table.to_pylist()


@pytest.mark.parametrize("backend", ["memory", pytest.param("s3", marks=pytest.mark.s3)])
def test_object_store_outputs_read_back_in_order(tmp_path, request, backend):
    url = request.getfixturevalue("memory_url" if backend == "memory" else "s3_url")
    result = _run(tmp_path, storage_path=url, n=23, batch_size=4, checkpoint_interval=2)
    assert result.finished
    table = read_outputs(url)
    _check_rich(table, 23)
    assert pa.Table.from_batches(list(iter_outputs(url, batch_rows=6))).to_pylist() == table.to_pylist()


class LateTypes(TorchBatchProcessor):
    """A column that is all None (and lists that are all empty) in the first batches, typed later."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        late = batch_idx >= 3
        self.context.write({"maybe": [f"m{i}" if late else None for i in ids], "items": [[i] if late else [] for i in ids]})


@pytest.mark.parametrize("fmt", FORMATS)
def test_columns_typed_only_in_later_batches_are_stored(tmp_path, fmt):
    result = _run(tmp_path, processor=LateTypes, n=30, batch_size=4, checkpoint_interval=10, output_format=fmt)
    table = read_outputs(result.storage_path)
    assert table.column("maybe").to_pylist() == [None] * 12 + [f"m{i}" for i in range(12, 30)]
    assert table.column("items").to_pylist() == [[]] * 12 + [[i] for i in range(12, 30)]
    assert pa.Table.from_batches(list(iter_outputs(result.storage_path, batch_rows=7))).to_pylist() == table.to_pylist()


class SkipsBadExamples(Rich):
    """Writes its rows, then raises for a batch holding a bad example (after the write: its rows must go)."""

    bad = {3, 17, 18, 30}

    def process_batch(self, batch, batch_idx):
        super().process_batch(batch, batch_idx)
        bad = self.bad & set(self.context.batch_indices)
        if bad:
            raise ValueError(f"bad examples {sorted(bad)}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_with_on_error_skip_the_rows_of_every_good_example_are_kept_once_and_no_bad_one(tmp_path, fmt):
    result = _run(tmp_path, processor=SkipsBadExamples, on_error="skip", output_format=fmt, bucket_by=[i % 7 for i in range(37)])
    assert result.finished and result.failed_examples == len(SkipsBadExamples.bad)
    table = read_outputs(result.storage_path)
    good = [i for i in range(37) if i not in SkipsBadExamples.bad]
    assert table.column("index").to_pylist() == good  # the split parts' rows, each once, in dataset order
    assert table.column("name").to_pylist() == [f"n{i}" for i in good]


class Empty(TorchBatchProcessor):
    """Columns whose per-example values have no elements: a (N, 0) and a (N, 2, 0) tensor, and a list of
    per-example tensors that are all empty in some batches (Arrow has no fixed-size list of size 0)."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        self.context.write(
            {
                "none": torch.zeros(len(ids), 0),
                "pairs_of_none": np.zeros((len(ids), 2, 0), dtype=np.int64),
                "ragged": [torch.arange(i % 4 if batch_idx % 2 else 0) for i in ids],
            }
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_example_values_with_no_elements_are_stored_as_empty_lists(tmp_path, fmt):
    result = _run(tmp_path, processor=Empty, n=12, batch_size=3, output_format=fmt)
    assert result.finished
    rows = read_outputs(result.storage_path).to_pylist()
    assert [row["index"] for row in rows] == list(range(12))
    for row in rows:
        i, batch_idx = row["index"], row["index"] // 3
        assert row["none"] == [] and row["pairs_of_none"] == [[], []]
        assert row["ragged"] == (list(range(i % 4)) if batch_idx % 2 else [])


# ----------------------------------------------------------------------------- one schema for the whole job


class Shapes(TorchBatchProcessor):
    """``vector``: a (N, d) tensor whose d changes at batch 2 (``as_list``: a list of per-example tensors)."""

    as_list = False
    fail_at: int | None = None

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        width = 3 if batch_idx < 2 else 4
        vector = torch.stack([torch.full((width,), float(i)) for i in ids])
        self.context.write({"vector": list(vector) if Shapes.as_list else vector})
        if batch_idx == Shapes.fail_at:
            raise RuntimeError(f"fail at {batch_idx}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tensor_whose_per_example_shape_changes_is_refused_naming_both_batches(tmp_path, fmt, monkeypatch):
    monkeypatch.setattr(Shapes, "as_list", False)
    with pytest.raises(InvalidArgumentError, match=r"'vector' is float of per-example shape \(4,\) in batch 2 \(rank 0\), "
                       r"float of per-example shape \(3,\) in batch 0 \(rank 0\)"):
        _run(tmp_path, processor=Shapes, n=20, batch_size=3, checkpoint_interval=1, output_format=fmt)
    table = read_outputs(tmp_path / "storage")  # what was committed stays readable
    assert table.column("index").to_pylist() == list(range(6))
    assert table.column("vector").to_pylist() == [[float(i)] * 3 for i in range(6)]
    if fmt == "parquet":  # with its exact shape
        assert column_to_numpy(table.column("vector")).shape == (6, 3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_list_of_per_example_tensors_may_change_shape(tmp_path, fmt, monkeypatch):
    monkeypatch.setattr(Shapes, "as_list", True)
    result = _run(tmp_path, processor=Shapes, n=20, batch_size=3, checkpoint_interval=1, output_format=fmt)
    assert result.finished
    rows = read_outputs(result.storage_path).to_pylist()
    assert [row["vector"] for row in rows] == [[float(i)] * (3 if i < 6 else 4) for i in range(20)]


class HugeInt(TorchBatchProcessor):
    """``value``: floats, then in batch 2 an int that a float64 cannot hold exactly."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        self.context.write({"value": [2**60 + 1] * len(ids) if batch_idx == 2 else [i + 0.5 for i in ids]})


def test_rows_whose_values_do_not_fit_the_widened_type_are_a_schema_conflict(tmp_path):
    with pytest.raises(SchemaConflictError, match=r"the rows of batch 2 \(rank 0\) do not fit the types of earlier"):
        _run(tmp_path, processor=HugeInt, n=20, batch_size=3, checkpoint_interval=1)
    table = read_outputs(tmp_path / "storage")
    assert table.column("value").to_pylist() == [i + 0.5 for i in range(6)]


class Bytes(TorchBatchProcessor):
    """``payload``: the bytes of each example (JSON has no bytes)."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        self.context.write({"payload": [bytes([int(v), 0xFF]) for v in batch]})


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_bytes_in_jsonl_outputs_fail_the_job_naming_the_column_even_when_skipping(tmp_path, on_error):
    with pytest.raises(SchemaConflictError, match=r"column 'payload' as binary.*output_format='parquet'"):
        _run(tmp_path, processor=Bytes, n=20, batch_size=3, output_format="jsonl", on_error=on_error)
    assert not glob.glob(os.path.join(tmp_path, "storage", "failures", "*"))  # no example was blamed
    result = _run(tmp_path, processor=Bytes, n=20, batch_size=3, storage_path=str(tmp_path / "parquet"))
    assert read_outputs(result.storage_path).column("payload").to_pylist() == [bytes([i, 0xFF]) for i in range(20)]


class Labels(TorchBatchProcessor):
    """``label`` as strings, or as ints (``as_int``)."""

    as_int = False

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        self.context.write({"label": ids if Labels.as_int else [f"ex{i}" for i in ids]})
        if batch_idx == 3 and not Labels.as_int:
            raise RuntimeError("stop after some commits")


def test_a_resume_whose_rows_do_not_unify_with_the_committed_ones_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(Labels, "as_int", False)
    with pytest.raises(RuntimeError, match="stop after some commits"):
        _run(tmp_path, processor=Labels, n=20, batch_size=3, checkpoint_interval=1)
    monkeypatch.setattr(Labels, "as_int", True)
    with pytest.raises(InvalidArgumentError, match=r"'label' is int64 in batch 3 \(rank 0\), string in batch 0 "
                       r"\(rank 0\), committed by an earlier run"):
        _run(tmp_path, processor=Labels, n=20, batch_size=3, checkpoint_interval=1)
    table = read_outputs(tmp_path / "storage")
    assert table.column("label").to_pylist() == [f"ex{i}" for i in range(9)]  # nothing of the refused run


def test_a_damaged_schema_in_the_commit_record_is_reported_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(Labels, "as_int", False)
    with pytest.raises(RuntimeError, match="stop after some commits"):
        _run(tmp_path, processor=Labels, n=20, batch_size=3, checkpoint_interval=1)
    commits = sorted(glob.glob(str(tmp_path / "storage" / "_tbp" / "commits" / "*.json")))
    record = json.loads(Path(commits[-1]).read_text())
    record["record_schema"]["arrow"] = "not base64!"
    Path(commits[-1]).write_text(json.dumps(record))
    from torch_batch_process import CheckpointCorruptError

    with pytest.raises(CheckpointCorruptError, match="record outputs' schema is damaged"):
        _run(tmp_path, processor=Labels, n=20, batch_size=3, checkpoint_interval=1)


@pytest.mark.parametrize(
    ("earlier", "later", "ragged", "expected"),
    [
        (pa.null(), pa.int64(), False, pa.int64()),
        (pa.string(), pa.null(), False, pa.string()),
        (pa.int32(), pa.int64(), False, pa.int64()),
        (pa.int64(), pa.float32(), False, pa.float64()),
        (pa.list_(pa.null()), pa.list_(pa.float32(), 3), False, pa.list_(pa.float32(), 3)),
        (pa.list_(pa.float32(), 3), pa.list_(pa.float32(), 3), False, pa.list_(pa.float32(), 3)),
        (pa.list_(pa.float32(), 3), pa.list_(pa.float32(), 4), True, pa.list_(pa.float32())),
        (pa.list_(pa.float32(), 3), pa.list_(pa.float64()), True, pa.list_(pa.float64())),
        (pa.struct([("a", pa.int64())]), pa.struct([("b", pa.string())]), False,
         pa.struct([("a", pa.int64()), ("b", pa.string())])),
        (pa.list_(pa.float32(), 3), pa.list_(pa.float32(), 4), False, "per-example shape changed"),
        (pa.list_(pa.float32(), 3), pa.list_(pa.float32()), False, "per-example shape changed"),
        (pa.string(), pa.int64(), False, "is int64 in b, string in a"),
        (pa.bool_(), pa.int64(), False, "is int64 in b, bool in a"),
    ],
)
def test_the_unification_rules(earlier, later, ragged, expected):
    from torch_batch_process.jobstore.schema import RecordSchema, unify

    first = RecordSchema(pa.schema([("index", pa.int64()), ("c", earlier)]), frozenset({"c"} if ragged else ()), "a")
    second = RecordSchema(pa.schema([("index", pa.int64()), ("c", later)]), frozenset(), "b")
    if isinstance(expected, str):
        with pytest.raises(InvalidArgumentError, match=expected):
            unify(first, second)
    else:
        unified = unify(first, second)
        assert unified.schema.field("c").type == expected and unified.origin == "a"
        assert RecordSchema.from_json(unified.to_json(), "x").schema.equals(unified.schema)


def test_tensors_that_need_a_copy_and_strided_arrays_are_stored_with_their_values():
    """The table of a batch's rows: tensors that require grad or hold bfloat16, and numpy views that are not
    contiguous, keep their values (the common case, a contiguous CPU tensor, is taken without a copy)."""
    from torch_batch_process.outputs.columns import rows_to_table

    base = np.arange(12, dtype=np.float64)
    weights = torch.arange(3, dtype=torch.float32, requires_grad=True) * 2
    table = rows_to_table(
        {
            "grad": weights,
            "bf16": torch.tensor([1.5, 2.5, -3.0], dtype=torch.bfloat16),
            "strided": base[::4],
            "transposed": base.reshape(2, 6).T[:3],
            "plain": torch.tensor([7, 8, 9]),
        },
        range(10, 13),
    )
    assert table.column("index").to_pylist() == [10, 11, 12]
    assert table.column("grad").to_pylist() == [0.0, 2.0, 4.0]
    assert table.column("bf16").to_pylist() == [1.5, 2.5, -3.0] and pa.types.is_float32(table.schema.field("bf16").type)
    assert table.column("strided").to_pylist() == [0.0, 4.0, 8.0]
    assert table.column("transposed").to_pylist() == [[0.0, 6.0], [1.0, 7.0], [2.0, 8.0]]
    assert table.column("plain").to_pylist() == [7, 8, 9]


def test_numeric_columns_wrapped_in_place_equal_what_pyarrow_builds():
    """Plain numbers (native byte order, aligned) are wrapped as Arrow arrays without ``pa.array``'s dispatch: the
    same types, values and nulls (a NaN stays a value) as ``pa.array``; other dtypes still go through it."""
    from torch_batch_process.outputs.columns import rows_to_table

    columns = {
        "i8": np.array([-1, 0, 1], dtype=np.int8),
        "u16": np.array([0, 1, 65535], dtype=np.uint16),
        "f16": np.array([0.5, -1.0, 2.0], dtype=np.float16),
        "f32": torch.tensor([float("nan"), 1.0, -0.0]),
        "flags": np.array([True, False, True]),  # Arrow packs booleans in bits: not wrapped
        "when": np.array(["2026-01-01", "2026-01-02", "2026-01-03"], dtype="datetime64[D]"),
    }
    table = rows_to_table(columns, [5, 3, 9])
    assert table.column("index").to_pylist() == [5, 3, 9] and table.schema.field("index").type == pa.int64()
    for name, value in columns.items():
        expected = pa.array(np.asarray(value))
        assert table.schema.field(name).type == expected.type, name
        assert table.column(name).chunk(0).equals(expected) or name == "f32", name
    f32 = table.column("f32").chunk(0)
    assert f32.null_count == 0 and np.isnan(f32.to_numpy()[0]) and f32.to_pylist()[1:] == [1.0, -0.0]
    with pytest.raises(InvalidArgumentError, match=r"column 'big' \(>i4\) cannot be stored"):  # as pa.array says
        rows_to_table({"big": np.array([1, 2, 3], dtype=">i4")}, [0, 1, 2])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_ranks_whose_rows_do_not_unify_fail_the_job_and_commit_nothing_unreadable(tmp_path, schedule):
    """Rank 1 writes ``label`` as ints, rank 0 as strings: each rank alone is consistent. Rank 0 refuses to commit
    the conflicting stages, every rank raises, what was committed reads back, and a resume with the fix finishes
    with every row once."""
    spec = _spec(tmp_path, n=120, conflict=True, kwargs={"schedule": schedule})
    outcomes = wait_all(spawn_ranks(2, RECORDS_JOB, json.dumps(spec)), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [1, 1], outcomes
    reports = read_reports(spec, 1)
    assert reports[0]["error"]["type"] == "SchemaConflictError", reports
    assert reports[1]["error"]["type"] == "WorkerFailedError", reports
    for report in reports.values():
        assert "column 'label' is" in report["error"]["message"] and "(rank 1)" in report["error"]["message"]
    committed = read_outputs(spec["storage"]).to_pylist()  # readable: one type (whichever rank committed first)
    records = sorted(glob.glob(os.path.join(spec["storage"], "_tbp", "commits", "*.json")))
    examples = json.loads(Path(records[-1]).read_text())["stats"]["examples_committed"] if records else 0
    assert len(committed) == examples  # every committed row is published before the ranks raise
    strings = all(row["label"] == f"ex{row['index']}" for row in committed)
    assert strings or all(row["label"] == row["index"] for row in committed), committed
    fixed = json.dumps(dict(spec, attempt=2, conflict=False))  # every rank writes strings
    outcomes = wait_all(spawn_ranks(1, RECORDS_JOB, fixed), timeout=120)
    if not strings:  # rank 1's ints were committed first (dynamic): the earlier run's type holds
        assert [rc for rc, _, _ in outcomes] == [1], outcomes
        error = read_reports(spec, 2)[0]["error"]
        assert error["type"] == "SchemaConflictError" and "committed by an earlier run" in error["message"], error
        return
    assert [rc for rc, _, _ in outcomes] == [0], (outcomes, read_reports(spec, 2))
    _check_job_outputs(spec["storage"], spec["n"])


class FlakyExamples(TorchBatchProcessor):
    """Writes a row per example; raises for a batch holding an example of ``bad`` (``on_error="skip"`` records it)."""

    bad: set[int] = set()
    int_labels = False

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        ids = [int(v) for v in batch]
        failing = FlakyExamples.bad & set(ids)
        if failing:
            raise ValueError(f"bad examples {sorted(failing)}")
        labels = ids if FlakyExamples.int_labels else [f"ex{i}" for i in ids]
        self.context.write({"label": labels, "vector": torch.tensor([[i, -i] for i in ids])})


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_outputs_includes_the_rows_that_retry_failed_runs_recovered(tmp_path, fmt, monkeypatch, caplog):
    options = dict(n=40, batch_size=4, on_error="skip", output_format=fmt)
    monkeypatch.setattr(FlakyExamples, "bad", {3, 17, 18, 30})
    assert _run(tmp_path, processor=FlakyExamples, **options).failed_examples == 4
    monkeypatch.setattr(FlakyExamples, "bad", {17})  # the first retry recovers 3, 18, 30
    assert _run(tmp_path, processor=FlakyExamples, retry_failed=True, **options).failed_examples == 1
    rows = read_outputs(tmp_path / "storage").to_pylist()
    assert [row["index"] for row in rows] == [i for i in range(40) if i != 17]
    monkeypatch.setattr(FlakyExamples, "bad", set())  # the second recovers 17
    assert _run(tmp_path, processor=FlakyExamples, retry_failed=True, **options).failed_examples == 0
    table = read_outputs(tmp_path / "storage")
    assert table.to_pylist() == [{"index": i, "label": f"ex{i}", "vector": [i, -i]} for i in range(40)]
    streamed = pa.Table.from_batches(list(iter_outputs(tmp_path / "storage", batch_rows=7)))
    assert streamed.to_pylist() == table.to_pylist()
    # the documented glob sees every row exactly once, the retries' among them (issue 26 item 2); the glob of the
    # retries of earlier versions finds nothing
    import pyarrow.parquet as pq

    shards = glob.glob(str(tmp_path / "storage" / f"{OUTPUTS_GLOB}.{fmt}"))
    read = pa.concat_tables(
        [pq.read_table(s) if fmt == "parquet" else pa.Table.from_pylist(_jsonl_rows(s)) for s in shards],
        promote_options="default",
    )
    assert sorted(read.column("index").to_pylist()) == list(range(40))
    assert glob.glob(str(tmp_path / "storage" / f"{RETRY_OUTPUTS_GLOB}.{fmt}")) == []
    caplog.clear()  # the retries' outputs/commit_* folders are theirs: no warning of folders the job did not write
    assert _run(tmp_path, processor=FlakyExamples, **options).already_finished
    assert _run(tmp_path, processor=FlakyExamples, retry_failed=True, **options).num_examples == 0
    assert not [r for r in caplog.records if r.levelname == "WARNING"], [r.getMessage() for r in caplog.records]
    assert read_outputs(tmp_path / "storage").to_pylist() == table.to_pylist()


def _jsonl_rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_a_retry_whose_rows_do_not_unify_with_the_job_is_refused(tmp_path, monkeypatch):
    options = dict(n=40, batch_size=4, on_error="skip")
    monkeypatch.setattr(FlakyExamples, "bad", {3, 17})
    assert _run(tmp_path, processor=FlakyExamples, **options).failed_examples == 2
    monkeypatch.setattr(FlakyExamples, "bad", set())
    monkeypatch.setattr(FlakyExamples, "int_labels", True)  # the "fixed" code writes labels as ints
    with pytest.raises(SchemaConflictError, match=r"'label' is int64 in batch 10 \(rank 0\), string in .*committed by "
                       "an earlier run"):
        _run(tmp_path, processor=FlakyExamples, retry_failed=True, **options)
    assert [row["index"] for row in read_outputs(tmp_path / "storage").to_pylist()] == [
        i for i in range(40) if i not in (3, 17)
    ]
