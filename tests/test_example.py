"""The README's main job (examples/digits) runs as one process and under torchrun, with its real accuracy, and says
that it had finished when it is run again."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, base_env, run_process, run_torchrun

EXAMPLE = REPO / "examples" / "digits"
sys.path.insert(0, str(EXAMPLE))

from model import load_trained_model  # noqa: E402
from model import test_dataset as held_out_dataset  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def true_predictions() -> dict[int, tuple[int, int]]:
    """index -> (label, prediction), computed directly with the shipped model."""
    dataset = held_out_dataset()
    model = load_trained_model().eval()
    with torch.no_grad():
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        predictions = model(images).argmax(1).tolist()
    return {i: (dataset[i][1], predictions[i]) for i in range(len(dataset))}


def read_predictions(outputs: Path) -> list[tuple[int, int, int]]:
    rows = []
    for path in sorted(outputs.rglob("predictions_*.csv")):
        with open(path, newline="") as f:
            rows += [tuple(int(v) for v in row) for row in list(csv.reader(f))[1:]]
    return rows


def check_run(output: str, storage: Path, truth: dict[int, tuple[int, int]]) -> None:
    accuracy = sum(label == pred for label, pred in truth.values()) / len(truth)
    assert accuracy > 0.95, "the shipped model is a real classifier"
    assert f"Accuracy: {accuracy:.4f} over {len(truth)} held-out digits" in output
    assert str(storage / "outputs") in output
    rows = read_predictions(storage / "outputs")
    assert sorted(r[0] for r in rows) == sorted(truth), "every held-out digit predicted exactly once"
    assert {r[0]: (r[1], r[2]) for r in rows} == truth


ONE_PROCESS = [sys.executable, str(EXAMPLE / "batch_inference.py"), "--batch-size", "50", "--storage"]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The example run once as one process (shared: the rerun test runs the same command again on its storage)."""
    storage = tmp_path_factory.mktemp("one_process") / "run"
    proc = run_process([*ONE_PROCESS, str(storage)], base_env(), 180)
    return proc, storage


def test_example_one_process(one_process_run, true_predictions):
    proc, storage = one_process_run
    assert proc.returncode == 0, proc.stderr
    check_run(proc.stdout, storage, true_predictions)


def test_example_two_processes_with_loader_workers(tmp_path, true_predictions):
    storage = tmp_path / "run"
    proc = run_torchrun(2, EXAMPLE / "batch_inference.py", "--storage", str(storage), "--workers", "1", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("Accuracy:") == 1, "printed once, by rank 0"
    check_run(proc.stdout, storage, true_predictions)


def test_example_rerun_says_it_had_finished_instead_of_processed_0(one_process_run):
    first, storage = one_process_run  # the first run of the command (shared with test_example_one_process)
    assert first.returncode == 0, first.stderr[-3000:]
    accuracy = re.search(r"Accuracy: (\d\.\d{4}) over (\d+) held-out digits", first.stdout)
    assert accuracy and "Processed " in first.stdout
    again = run_process([*ONE_PROCESS, str(storage)], base_env(), 300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Processed " not in again.stdout, again.stdout
    expected = f"Already finished earlier: {accuracy.group(2)} examples, accuracy {accuracy.group(1)}"
    assert expected in again.stdout, again.stdout
