"""Progress and hyperparameters: the first ETA ignores start-up (the plain lines' and the bar's), and the
hyperparameters that ``tbp run`` sets are logged once per attempt to ``metrics.jsonl`` and TensorBoard."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from torch_batch_process import TorchBatchProcessor, torch_batch_process
from torch_batch_process.observe.options import tensorboard_installed
from torch_batch_process.observe.progress import LogDisplay

needs_tensorboard = pytest.mark.skipif(not tensorboard_installed(), reason="tensorboard is not installed")

HPARAMS = {"lr": 0.25, "model": {"name": "cnn", "layers": [3, 5]}, "note": "a|b", "flag": True}


def _jsonl(storage: Path) -> list[dict]:
    return [json.loads(line) for line in (storage / "metrics.jsonl").read_text().splitlines()]


def _seconds(hms: str) -> int:
    """``H:MM:SS`` or ``MM:SS`` in seconds."""
    seconds = 0
    for part in hms.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


class Quick(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        pass


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_line_counts_rate_and_eta_from_the_end_of_the_first_step(caplog):
    caplog.set_level(logging.INFO, logger="torch_batch_process")
    clock = FakeClock()
    display = LogDisplay(
        interval=1.0, total_examples=400, total_batches=100, initial_examples=0, initial_batches=0, clock=clock
    )
    clock.now += 30.0  # start-up: loader workers, the first batch's warm-up
    display.start_clock(4, 1)
    clock.now += 1.0
    display.show(44, 11)  # 40 examples in the second after the first step: 40 examples/s
    (message,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ")]
    assert "44/400 examples, 11/100 batches" in message
    assert "40.0 examples/s" in message, message
    assert "elapsed 0:00:31" in message, "elapsed still counts from the start"
    assert message.endswith("ETA 0:00:09"), message  # 356 examples left at 40/s, not at 44/31 s


class SlowFirstBatch(TorchBatchProcessor):
    """The first batch takes START_S (a model's warm-up, lazy CUDA initialisation); the others STEP_S."""

    START_S = 1.0
    STEP_S = 0.06

    def __init__(self, context):
        self.context = context
        self.first = True

    def process_batch(self, batch, batch_idx):
        time.sleep(self.START_S if self.first else self.STEP_S)
        self.first = False


N_BATCHES = 31
STEADY_S = (N_BATCHES - 1) * SlowFirstBatch.STEP_S  # 1.8 s after the first batch; a naive first ETA says ~30 s


def test_first_eta_of_the_plain_lines_is_the_steady_state_one(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="torch_batch_process")
    result = torch_batch_process(
        SlowFirstBatch, list(range(4 * N_BATCHES)), batch_size=4, checkpoint_interval=100,
        storage_path=str(tmp_path / "s"), progress="log", progress_interval=0.3, tensorboard=False,
    )
    ended = time.time()
    assert result.finished
    lines = [r for r in caplog.records if r.getMessage().startswith("progress: ")]
    assert lines, "plain progress lines were logged"
    first = lines[0]
    eta = re.search(r"ETA (\d+:\d\d:\d\d)$", first.getMessage())
    assert eta, first.getMessage()
    real_left = ended - first.created
    shown = _seconds(eta.group(1))
    assert real_left / 2 - 1 <= shown <= 2 * real_left + 1, (first.getMessage(), f"real: {real_left:.1f} s")


def test_first_eta_of_the_bar_is_the_steady_state_one(tmp_path, capsys):
    result = torch_batch_process(
        SlowFirstBatch, list(range(4 * N_BATCHES)), batch_size=4, checkpoint_interval=100,
        storage_path=str(tmp_path / "s"), progress="bar", tensorboard=False,
    )
    assert result.finished
    drawn = re.split(r"[\r\n]", capsys.readouterr().err)
    # tqdm: "job:  29%|###   | 36/124 [00:00<00:01, 50.2 examples/s, 9/31 batches]"
    total = 4 * N_BATCHES
    etas = [
        (int(m.group(1)), _seconds(m.group(2)))
        for m in (re.search(rf"\| (\d+)/{total} \[[\d:]+<([\d:]+),", line) for line in drawn)
        if m
    ]
    assert etas, drawn[-5:]
    done, shown = etas[0]
    real_left = (total - done) / 4 * SlowFirstBatch.STEP_S  # the steady-state time of the batches left
    assert real_left / 2 - 1 <= shown <= 2 * real_left + 1, (etas[:3], f"real: {real_left:.1f} s")
    assert shown <= STEADY_S + 2


# ------------------------------------------------------------------------------ item 6: hparams


class FailsOnce(TorchBatchProcessor):
    fail_at: int | None = 5

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        if batch_idx == type(self).fail_at:
            raise RuntimeError("the first attempt fails here")


def _text_summaries(folder: Path) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    if "hparams/text_summary" not in acc.Tags()["tensors"]:
        return []
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("hparams/text_summary")]


def _hparams_tab(root: Path) -> dict[str, dict[str, object]]:
    """What TensorBoard's HParams tab reads: each run's session start info, decoded."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import plugin_data_pb2

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    runs = {}
    for run, tags in mux.PluginRunToTagToContent("hparams").items():
        data = plugin_data_pb2.HParamsPluginData.FromString(tags["_hparams_/session_start_info"])
        values = {}
        for key, value in data.session_start_info.hparams.items():
            values[key] = value.string_value if value.HasField("string_value") else value.number_value
        runs[run] = values
    return runs


@needs_tensorboard
def test_hparams_are_logged_once_per_attempt_to_jsonl_and_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setenv("TBP_HPARAMS", json.dumps(HPARAMS))  # what tbp run sets from the config
    storage = tmp_path / "s"
    kwargs = dict(batch_size=2, checkpoint_interval=2, storage_path=str(storage), tensorboard=True, progress=False)
    with pytest.raises(Exception, match="the first attempt fails here"):
        torch_batch_process(FailsOnce, list(range(20)), **kwargs)
    monkeypatch.setattr(FailsOnce, "fail_at", None)
    assert torch_batch_process(FailsOnce, list(range(20)), **kwargs).finished

    records = [r for r in _jsonl(storage) if r["group"] == "hparams"]
    assert [(r["attempt"], r["steps_completed"], r["rank"]) for r in records] == [(1, 0, 0), (2, 4, 0)]
    assert all(r["metrics"] == HPARAMS for r in records), "as get_hparams() returns them, nested"

    texts = _text_summaries(storage / "tensorboard" / "rank_0")
    assert [step for step, _ in texts] == [0, 4], "one table per attempt, at the batches committed then"
    table = texts[-1][1]
    assert table.startswith("| hyperparameter | value |\n|---|---|\n")
    rows = ("| lr | 0.25 |", "| model/name | cnn |", "| model/layers | [3, 5] |", "| note | a\\|b |", "| flag | true |")
    for row in rows:
        assert row in table.splitlines(), table
    tab = _hparams_tab(storage / "tensorboard")
    expected = {"lr": 0.25, "model/name": "cnn", "model/layers": "[3, 5]", "note": "a|b", "flag": "true"}
    assert tab == {"rank_0": expected}, "the HParams tab sees rank 0's run with the flattened values"


def test_the_observer_reads_the_hparams_that_tbp_run_sets(tmp_path, monkeypatch):
    from torch_batch_process.launch.config import load_config
    from torch_batch_process.launch.job_launch import job_environment
    from torch_batch_process.observe.hparams import read_hparams

    config = tmp_path / "job.yaml"
    config.write_text(
        "entrypoint: python3 job.py\nhyperparameters:\n  lr: {type: const, val: 0.25}\n  model: {name: cnn}\n"
    )
    env, _ = job_environment(load_config(config))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert read_hparams() == {"lr": 0.25, "model": {"name": "cnn"}}


@needs_tensorboard
@pytest.mark.parametrize("raw", [None, "{}", "[1, 2]", "not json"])
def test_no_hparams_no_record_and_a_bad_value_does_not_fail_the_job(tmp_path, monkeypatch, raw, caplog):
    if raw is not None:
        monkeypatch.setenv("TBP_HPARAMS", raw)
    storage = tmp_path / "s"
    result = torch_batch_process(
        Quick, list(range(8)), batch_size=2, storage_path=str(storage), tensorboard=True, progress=False
    )
    assert result.finished
    assert not [r for r in _jsonl(storage) if r["group"] == "hparams"]
    assert _text_summaries(storage / "tensorboard" / "rank_0") == []
    warned = any("hyperparameters are not logged" in r.getMessage() for r in caplog.records)
    assert warned == (raw in ("[1, 2]", "not json"))


# ------------------------------------------------------------------------------ item 9: tbp CLI
