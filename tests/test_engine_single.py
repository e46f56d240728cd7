"""The loop in one plain process: calls, commits, resume, reducers, outputs, state, inference mode."""

from __future__ import annotations

import json
import os
from pathlib import Path

import fsspec
import pytest
import torch
from harness import read_outputs, tree_digest

from torch_batch_process import (
    CheckpointCorruptError,
    InvalidArgumentError,
    JobMismatchError,
    MetricReducer,
    TorchBatchProcessor,
    torch_batch_process,
)
from torch_batch_process import read_outputs as torch_batch_process_read_outputs

LOG: dict[str, list] = {}


def reset_log() -> None:
    LOG.clear()
    LOG.update(init=[], calls=[], checkpoints=[], finishes=[], grad=[], loaded=[])


class Recorder(TorchBatchProcessor):
    fail_at: int | None = None

    def __init__(self, context):
        self.context = context
        LOG["init"].append(context.get_distributed_rank())
        self.total = context.wrap_reducer(lambda values: sum(values), name="total")

    def process_batch(self, batch, batch_idx):
        LOG["calls"].append(batch_idx)
        LOG["grad"].append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        self.total.update(int(sum(batch)))
        with self.context.upload_path() as path:
            (path / f"b{batch_idx}.json").write_text(json.dumps([int(v) for v in batch]))
        if batch_idx == type(self).fail_at:
            raise RuntimeError(f"boom at {batch_idx}")

    def on_checkpoint_start(self):
        LOG["checkpoints"].append(len(LOG["calls"]))

    def on_finish(self):
        LOG["finishes"].append(1)


class FailsAt7(Recorder):
    fail_at = 7


FailsAt7.__qualname__ = "Recorder"  # the same job, as if the user fixed the bug and re-ran


def outputs(storage: str | Path) -> list[int]:
    values = []
    for data in read_outputs(storage, "*.json").values():
        values += json.loads(data)
    return sorted(values)


@pytest.fixture
def storage(tmp_path):
    """A local storage folder."""
    reset_log()
    return tmp_path / "store"


@pytest.fixture
def store(storage_url):
    """The storage URL on every backend: local folder, memory:// and s3:// (moto)."""
    reset_log()
    return storage_url


@pytest.mark.parametrize("n,b,calls", [(50, 10, 5), (50, 20, 3), (7, 2, 4)])
def test_single_process_call_counts(store, n, b, calls):
    result = torch_batch_process(Recorder, list(range(n)), batch_size=b, storage_path=store)
    assert LOG["calls"] == list(range(calls))
    assert LOG["finishes"] == [1]
    assert result.finished and not result.preempted
    assert result.metrics == {"total": sum(range(n))}
    assert result.batches_processed == calls and result.examples_processed == n
    assert result.storage_path == store
    assert outputs(store) == list(range(n))


class FilesAndRows(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        with self.context.upload_path() as path:
            (path / f"batch_{batch_idx}.json").write_text(json.dumps(batch.tolist()))
        self.context.write({"x": batch})


def test_a_finished_job_leaves_nothing_staged_on_any_backend(store, caplog):
    """memory:// keeps a folder after its files have moved: a published stage must not look still staged
    (read-back of a finished job warned that it was killed while publishing)."""
    torch_batch_process(FilesAndRows, list(range(9)), batch_size=2, checkpoint_interval=2, storage_path=store)
    with caplog.at_level("WARNING"):
        table = torch_batch_process_read_outputs(store)
    assert table.column("index").to_pylist() == list(range(9))
    assert outputs(store) == list(range(9))
    assert "still staged" not in caplog.text
    fs, root = fsspec.core.url_to_fs(store)
    below = [path for path in fs.find(f"{root}/_tbp/staging", withdirs=True) if "/_tbp/staging/" in path]
    assert below == []  # the staging folder itself may stay; nothing below it


def test_checkpoint_interval_commits_and_final_commit_is_not_repeated(store):
    torch_batch_process(Recorder, list(range(12)), batch_size=1, checkpoint_interval=4, storage_path=store)
    assert LOG["checkpoints"] == [4, 8, 12]  # 12 steps: the last step just committed, no extra one
    reset_log()
    torch_batch_process(Recorder, list(range(10)), batch_size=1, checkpoint_interval=4, storage_path=f"{store}/b")
    assert LOG["checkpoints"] == [4, 8, 10]
    reset_log()
    torch_batch_process(Recorder, list(range(5)), batch_size=1, checkpoint_interval=1, storage_path=f"{store}/c")
    assert LOG["checkpoints"] == [1, 2, 3, 4, 5]  # exactly once per step, as in Determined


def test_max_batches_caps_and_too_large_warns(storage):
    result = torch_batch_process(Recorder, list(range(50)), batch_size=5, max_batches=2, storage_path=str(storage))
    assert LOG["calls"] == [0, 1] and result.num_batches == 2 and result.finished
    reset_log()
    with pytest.warns(UserWarning, match="max_batches"):
        result = torch_batch_process(Recorder, list(range(50)), batch_size=5, max_batches=99,
                                     storage_path=str(storage / "x"))
    assert LOG["calls"] == list(range(10)) and result.num_batches == 10


def test_empty_dataset_completes_normally(storage):
    result = torch_batch_process(Recorder, [], batch_size=4, storage_path=str(storage))
    assert result.finished and result.num_batches == 0 and LOG["calls"] == [] and LOG["finishes"] == [1]
    assert result.metrics == {"total": 0}


def test_resume_processes_only_uncommitted_batches(store):
    with pytest.raises(RuntimeError, match="boom at 7"):
        torch_batch_process(FailsAt7, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=store)
    assert LOG["calls"] == list(range(8))
    assert LOG["finishes"] == []
    assert outputs(store) == list(range(24))  # commits after steps 3 and 6; batch 6 and 7 not committed
    reset_log()
    result = torch_batch_process(Recorder, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=store)
    assert LOG["calls"] == [6, 7, 8, 9]  # only what was not committed; skipped batches are not loaded
    assert result.batches_skipped == 6 and result.batches_processed == 4 and result.attempt == 2
    assert result.metrics == {"total": sum(range(40))}  # exact across the resume
    assert outputs(store) == list(range(40))  # every example exactly once


def test_skipped_batches_are_not_loaded(storage):
    loaded = []

    class Tracking(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            loaded.append(i)
            return i

    with pytest.raises(RuntimeError):
        torch_batch_process(FailsAt7, Tracking(), batch_size=2, checkpoint_interval=2, storage_path=str(storage))
    loaded.clear()
    torch_batch_process(Recorder, Tracking(), batch_size=2, checkpoint_interval=2, storage_path=str(storage))
    assert sorted(loaded) == list(range(12, 20))


def test_finished_job_rerun_does_no_work_and_returns_stored_result(store):
    first = torch_batch_process(Recorder, list(range(9)), batch_size=2, storage_path=store)
    reset_log()
    before = tree_digest(store)
    again = torch_batch_process(Recorder, list(range(9)), batch_size=2, storage_path=store)
    assert LOG["init"] == [] and LOG["calls"] == []
    assert again.already_finished and again.finished and again.metrics == first.metrics
    assert again.batches_processed == 0 and again.batches_committed == 5
    assert tree_digest(store) == before


def test_fingerprint_mismatch_is_refused_and_storage_unchanged(store):
    with pytest.raises(RuntimeError):
        torch_batch_process(FailsAt7, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=store)
    before = tree_digest(store)
    for kwargs in (dict(batch_size=8), dict(batch_size=4, max_batches=3)):
        with pytest.raises(JobMismatchError, match="resume=False") as info:
            torch_batch_process(Recorder, list(range(40)), checkpoint_interval=3, storage_path=store, **kwargs)
        assert "batch_size" in str(info.value) or "max_batches" in str(info.value)
    with pytest.raises(JobMismatchError, match="dataset_length"):
        torch_batch_process(Recorder, list(range(41)), batch_size=4, storage_path=store)

    class Other(Recorder):
        pass

    with pytest.raises(JobMismatchError, match="processor"):
        torch_batch_process(Other, list(range(40)), batch_size=4, storage_path=store)
    assert tree_digest(store) == before


def test_corrupt_record_is_an_error_naming_the_file_and_storage_unchanged(store):
    with pytest.raises(RuntimeError):
        torch_batch_process(FailsAt7, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=store)
    fs, root = fsspec.core.url_to_fs(store)
    record = sorted(fs.find(f"{root}/_tbp/commits"))[-1]
    fs.pipe_file(record, b'{"format": "torch_batch_process/commit/1", "commit": ')
    before = tree_digest(store)
    with pytest.raises(CheckpointCorruptError) as info:
        torch_batch_process(Recorder, list(range(40)), batch_size=4, storage_path=store)
    assert record.rsplit("/", 1)[-1] in str(info.value)
    assert LOG["calls"] == list(range(8))  # nothing more was processed
    assert tree_digest(store) == before


class WithState(Recorder):
    """A processor whose ``state_dict()`` holds a tensor: a flipped byte in it loads as another value."""

    def state_dict(self):
        return {"weights": torch.arange(256, dtype=torch.float32)}

    def load_state_dict(self, state):
        LOG["loaded"].append(state["weights"].tolist())


class WithStateFailsAt7(WithState):
    fail_at = 7


WithStateFailsAt7.__qualname__ = "WithState"


def test_a_flipped_byte_in_a_state_file_is_an_error_naming_it_not_another_state(storage):
    import zipfile

    store = str(storage)
    with pytest.raises(RuntimeError):
        torch_batch_process(WithStateFailsAt7, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=store)
    state = sorted((storage / "_tbp" / "states").rglob("rank_0.pt"))[-1]
    raw = bytearray(state.read_bytes())
    with zipfile.ZipFile(state) as archive:  # the tensor's bytes: torch.load reads them back without their CRC-32
        entry = next(info for info in archive.infolist() if info.filename.endswith("/data/0"))
        with archive.open(entry) as opened:
            start = opened._orig_compress_start  # where the entry's bytes begin in the file
    raw[start + 4 * 100 + 3] ^= 0x01  # weights[100] = 100.0 becomes another float
    state.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match="damaged") as info:
        torch_batch_process(WithState, list(range(40)), batch_size=4, checkpoint_interval=3, storage_path=store)
    assert str(state.relative_to(storage)) in str(info.value)
    assert LOG["loaded"] == [] and LOG["calls"] == list(range(8))  # nothing loaded, nothing more processed


def test_resume_false_starts_afresh(store):
    torch_batch_process(Recorder, list(range(10)), batch_size=2, storage_path=store)
    reset_log()
    result = torch_batch_process(Recorder, list(range(10)), batch_size=5, storage_path=store, resume=False)
    assert LOG["calls"] == [0, 1] and result.attempt == 1 and not result.already_finished
    assert outputs(store) == list(range(10))
    fs, root = fsspec.core.url_to_fs(store)
    reduced = [json.loads(line) for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]
    reduced_metrics = [r["metrics"] for r in reduced if r["group"] == "reduced"]
    assert reduced_metrics == [{"total": 45}], "the old job's metrics are gone"
    has_tensorboard = fs.exists(f"{root}/tensorboard")
    event_files = [p for p in fs.find(f"{root}/tensorboard") if "tfevents" in p] if has_tensorboard else []
    assert len(event_files) <= 1, f"the old job's TensorBoard files are gone: {event_files}"


def test_inference_mode_by_default_and_opt_out(storage):
    torch_batch_process(Recorder, list(range(4)), batch_size=2, storage_path=str(storage))
    assert LOG["grad"] == [(True, False)] * 2
    reset_log()
    torch_batch_process(Recorder, list(range(4)), batch_size=2, storage_path=str(storage / "b"), inference_mode=False)
    assert LOG["grad"] == [(False, True)] * 2



class UpdatesInHooks(TorchBatchProcessor):
    """Determined-style code: a tensor made in ``process_batch``, updated in place in the hooks."""

    seen: list = []

    def __init__(self, context):
        self.total = None

    def process_batch(self, batch, batch_idx):
        total = batch.sum()
        self.total = total if self.total is None else self.total + total

    def on_checkpoint_start(self):
        self.total += 1  # in place, on a tensor process_batch made
        UpdatesInHooks.seen.append(("on_checkpoint_start", torch.is_inference_mode_enabled()))

    def on_finish(self):
        self.total.mul_(2)
        UpdatesInHooks.seen.append(("on_finish", torch.is_inference_mode_enabled(), int(self.total)))


@pytest.mark.parametrize("inference_mode", [True, False])
def test_the_hooks_run_in_the_mode_process_batch_runs_in(tmp_path, inference_mode):
    """Tensors made in ``process_batch`` under ``torch.inference_mode()`` can be updated in place in
    ``on_checkpoint_start``/``on_finish`` (they raised "Inplace update to inference tensor outside InferenceMode")."""
    UpdatesInHooks.seen = []
    result = torch_batch_process(
        UpdatesInHooks, torch.arange(6), batch_size=2, checkpoint_interval=2, storage_path=str(tmp_path / "job"),
        inference_mode=inference_mode,
    )
    assert result.finished
    # commits after steps 2 and 3; total = 15, +1 at each commit, then doubled
    assert UpdatesInHooks.seen == [("on_checkpoint_start", inference_mode)] * 2 + [("on_finish", inference_mode, 34)]

class CountingReducer(MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.n = 0

    def update(self, k):
        self.n += k

    def per_slot_reduce(self):
        return self.n

    def cross_slot_reduce(self, per_slot_metrics):
        return sum(per_slot_metrics)


class Stateful(TorchBatchProcessor):
    fail_at: int | None = 5

    def __init__(self, context):
        self.context = context
        self.seen = 0
        self.counter = context.wrap_reducer(CountingReducer(), name="examples")

    def process_batch(self, batch, batch_idx):
        self.seen += len(batch)
        self.counter.update(len(batch))
        if batch_idx == type(self).fail_at:
            raise RuntimeError("stop")

    def state_dict(self):
        return {"seen": self.seen, "tensor": torch.arange(3)}

    def load_state_dict(self, state):
        LOG["loaded"].append(state["seen"])
        assert torch.equal(state["tensor"], torch.arange(3))
        self.seen = state["seen"]

    def on_finish(self):
        LOG["finishes"].append(self.seen)


class StatefulFixed(Stateful):
    fail_at = None


StatefulFixed.__qualname__ = "Stateful"


def test_processor_state_and_metric_reducer_survive_resume(store):
    with pytest.raises(RuntimeError):
        torch_batch_process(Stateful, list(range(30)), batch_size=3, checkpoint_interval=2, storage_path=store)
    result = torch_batch_process(
        StatefulFixed, list(range(30)), batch_size=3, checkpoint_interval=2, storage_path=store
    )
    assert LOG["loaded"] == [12]  # state of the last commit (4 batches of 3)
    assert LOG["finishes"] == [30]
    assert result.metrics == {"examples": 30}


def test_upload_path_rules(store):
    class Writer(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context

        def process_batch(self, batch, batch_idx):
            with self.context.upload_path() as path:
                assert isinstance(path, Path) and list(path.iterdir()) == []  # fresh and empty
                (path / "sub").mkdir()
                (path / "sub" / f"{batch_idx}.txt").write_text("x")
            with pytest.raises(KeyError):
                with self.context.upload_path() as path:
                    (path / f"discarded_{batch_idx}.txt").write_text("y")
                    raise KeyError("the block failed")
            if batch_idx == 1:
                with self.context.upload_path() as path:
                    (path / "sub" ).mkdir()
                    (path / "sub" / "0.txt").write_text("clash")

    with pytest.raises(FileExistsError, match="sub/0.txt"):
        torch_batch_process(Writer, list(range(4)), batch_size=1, checkpoint_interval=10, storage_path=store)
    assert read_outputs(store) == {}
    torch_batch_process(Writer, list(range(1)), batch_size=1, storage_path=f"{store}/ok")
    assert read_outputs(f"{store}/ok") == {"commit_00000001/rank_0/sub/0.txt": b"x"}


@pytest.mark.parametrize(
    "misuse",
    [
        lambda path: Path(path),
        lambda path: os.path.join(path, "x.txt"),
        lambda path: path / "x.txt",
        lambda path: f"{path}/x.txt",
    ],
)
def test_upload_path_used_as_a_path_is_a_clear_error(store, misuse):
    """upload_path() without 'with' gave a path named '<..._Block object at 0x...>' and a FileNotFoundError."""

    class Misuse(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context

        def process_batch(self, batch, batch_idx):
            misuse(self.context.upload_path())

    with pytest.raises(InvalidArgumentError, match=r"upload_path\(\) is a context manager, not a path: write 'with"):
        torch_batch_process(Misuse, list(range(2)), storage_path=store, progress=False)


@pytest.mark.parametrize(
    ("metrics", "needle"),
    [
        ({"x": object()}, r"metrics\['x'\] is a object, which JSON cannot hold"),
        ({"x": [1, {2, 3}]}, r"metrics\['x'\]\[1\] is a set"),
        ({"x": {1: 2}}, r"metrics\['x'\] has a key that is not a str"),
        ({3: 1.0}, "keys must be str"),
    ],
)
def test_report_metrics_refuses_values_json_cannot_hold(store, metrics, needle):
    """Such values were stored as their repr ('<object object at 0x...>'); the JSON check after the conversion could
    never fail."""

    class Reporter(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context

        def process_batch(self, batch, batch_idx):
            self.context.report_metrics("m", batch_idx + 1, metrics)

    with pytest.raises(InvalidArgumentError, match=needle):
        torch_batch_process(Reporter, list(range(2)), storage_path=store, progress=False)


def test_context_api(store):
    seen = {}

    class Inspect(TorchBatchProcessor):
        def __init__(self, context):
            model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
            model.train()
            seen["model_training"] = context.prepare_model_for_inference(model).training
            seen["device"] = context.device
            seen["ranks"] = (
                context.get_distributed_rank(),
                context.get_distributed_size(),
                context.distributed.get_rank(),
                context.distributed.get_size(),
                context.distributed.get_local_rank(),
            )
            seen["hparams"] = context.get_hparams()
            seen["tb"] = context.get_tensorboard_path()
            self.context = context

        def process_batch(self, batch, batch_idx):
            self.context.report_metrics("inference", batch_idx + 1, {"n": len(batch), "t": torch.tensor(0.5)})

    os.environ["TBP_HPARAMS"] = json.dumps({"lr": 0.1})
    try:
        torch_batch_process(Inspect, list(range(6)), batch_size=2, storage_path=store)
    finally:
        del os.environ["TBP_HPARAMS"]
    assert seen["model_training"] is False
    assert seen["device"] == torch.device("cpu")
    assert seen["ranks"] == (0, 1, 0, 1, 0)
    assert seen["hparams"] == {"lr": 0.1}
    if "://" not in store:
        assert seen["tb"].is_dir()  # <storage_path>/tensorboard/rank_0 itself
    else:
        assert not seen["tb"].exists()  # a local temporary folder, uploaded then removed when the job returned
    fs, root = fsspec.core.url_to_fs(store)
    lines = [json.loads(line) for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]
    reported = [line for line in lines if line["group"] == "inference"]
    assert [line["steps_completed"] for line in reported] == [1, 2, 3]
    assert reported[0]["metrics"] == {"n": 2, "t": 0.5}


def test_reuses_a_process_group_the_user_initialized(storage, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        result = torch_batch_process(Recorder, list(range(4)), batch_size=2, storage_path=str(storage))
        assert result.finished
        assert dist.is_initialized(), "a group the user created is left alone"
    finally:
        dist.destroy_process_group()


def test_default_storage_path_is_under_tbp_runs(tmp_path, monkeypatch):
    reset_log()
    monkeypatch.chdir(tmp_path)
    result = torch_batch_process(Recorder, list(range(4)), batch_size=2, job_name="my-job")
    assert Path(result.storage_path) == tmp_path / "tbp_runs" / "my-job"
    monkeypatch.setenv("TBP_STORAGE_PATH", str(tmp_path / "from_env"))
    result = torch_batch_process(Recorder, list(range(4)), batch_size=2)
    assert Path(result.storage_path) == tmp_path / "from_env"


def test_files_written_in_on_finish_are_committed(storage):
    class Summary(TorchBatchProcessor):
        def __init__(self, context):
            self.context = context
            self.count = 0

        def process_batch(self, batch, batch_idx):
            self.count += len(batch)

        def on_finish(self):
            with self.context.upload_path() as path:
                (path / "summary.json").write_text(json.dumps({"count": self.count}))

    result = torch_batch_process(Summary, list(range(10)), batch_size=3, checkpoint_interval=1,
                                 storage_path=str(storage))
    summaries = list((storage / "outputs").rglob("summary.json"))
    assert len(summaries) == 1 and json.loads(summaries[0].read_text()) == {"count": 10}
    assert result.commits == 5  # 4 steps with checkpoint_interval=1, then the commit of on_finish's files


def test_distributed_context_is_checked_against_the_job(storage):
    from torch_batch_process import DistributedInfo

    with pytest.raises(InvalidArgumentError, match="distributed_context says rank 0 of 2"):
        torch_batch_process(Recorder, list(range(4)), 2, None, 5, None, DistributedInfo(0, 2, 0, 2, 0, 1),
                            storage_path=str(storage))
    assert not storage.exists(), "refused before any write"
    with pytest.raises(InvalidArgumentError, match="get_rank"):
        torch_batch_process(Recorder, list(range(4)), batch_size=2, distributed_context=object(),
                            storage_path=str(storage))
    result = torch_batch_process(Recorder, list(range(4)), 2, None, 5, None, DistributedInfo(0, 1, 0, 1, 0, 1),
                                 storage_path=str(storage))
    assert result.finished


class _SeesInference(TorchBatchProcessor):
    seen: list[tuple[bool, bool]] = []

    def __init__(self, context):
        pass

    def process_batch(self, batch, batch_idx):
        _SeesInference.seen.append((batch.is_inference(), torch.is_inference_mode_enabled()))


@pytest.mark.parametrize("inference_mode", [True, False])
def test_batches_are_loaded_in_the_mode_process_batch_runs_in(tmp_path: Path, inference_mode: bool) -> None:
    _SeesInference.seen = []
    torch_batch_process(
        _SeesInference, list(range(10)), batch_size=4, storage_path=str(tmp_path / "s"), progress=False,
        inference_mode=inference_mode,
    )
    assert _SeesInference.seen == [(inference_mode, inference_mode)] * 3


class _WorkerMode(torch.utils.data.Dataset):
    """Each example is whether its loader worker made it under ``torch.inference_mode()``."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(torch.is_inference_mode_enabled())


class _SeesWorkerMode(TorchBatchProcessor):
    seen: list[bool] = []

    def __init__(self, context):
        pass

    def process_batch(self, batch, batch_idx):
        _SeesWorkerMode.seen.extend(bool(flag) for flag in batch)


@pytest.mark.parametrize("inference_mode", [True, False])
def test_loader_workers_load_in_the_mode_process_batch_runs_in(tmp_path: Path, inference_mode: bool) -> None:
    """As in a hand loop whose loader iterator is made under ``torch.inference_mode()``: the workers (forked then)
    load under it too, which makes each tensor op of ``__getitem__``/``collate_fn`` cheaper."""
    _SeesWorkerMode.seen = []
    torch_batch_process(
        _SeesWorkerMode, _WorkerMode(), batch_size=4, storage_path=str(tmp_path / "s"), progress=False,
        inference_mode=inference_mode, dataloader_kwargs={"num_workers": 1},
    )
    assert _SeesWorkerMode.seen == [inference_mode] * 6
