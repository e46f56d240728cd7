"""Jobs stored by the previous version of the library resume with this one (the stored JSON keeps its names).

``fixtures/previous_<name>.tar.gz`` were made by ``fixtures/make_previous_jobs.py`` with main at 53da99d (before
capabilities became commit participants): tests/jobs/previous_job.py SIGKILLed half-way, with every capability that
stores something with a commit (record rows and segments, a table's pending files, memory limits, failing examples,
the reducers' summaries, the processor's state, ``upload_path()`` files). Each is resumed here and must end with
every example once, each failure listed once and exact metrics.
"""

from __future__ import annotations

import json
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from harness import JOBS, base_env, committed_values, read_reports, spawn_ranks, wait_all

from torch_batch_process import read_outputs

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PREVIOUS_JOB = JOBS / "previous_job.py"


def _unpack(name: str, tmp_path: Path) -> dict:
    """The fixture's files under ``tmp_path``, with its absolute paths put back; returns its spec."""
    with tarfile.open(FIXTURES / f"previous_{name}.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl"):
            text = path.read_text()
            if "@ROOT@" in text:
                path.write_text(text.replace("@ROOT@", str(tmp_path)))
    return json.loads((tmp_path / "spec.json").read_text())


def _resume(spec: dict) -> dict:
    """Runs the stored job again on as many ranks as it had, to its end; returns rank 0's report."""
    world = spec["world"]
    spec = {k: v for k, v in spec.items() if k not in ("kill_after", "world")} | {"attempt": 2, "sleep": 0}
    outcomes = wait_all(spawn_ranks(world, PREVIOUS_JOB, json.dumps(spec), env=base_env()), timeout=180)
    assert [rc for rc, _, _ in outcomes] == [0] * len(outcomes), outcomes
    reports = read_reports(spec, attempt=2)
    return reports[0]


def _failures(storage: str) -> list[int]:
    indices = []
    for path in Path(storage, "failures").glob("*.jsonl"):
        indices += [json.loads(line)["index"] for line in path.read_text().splitlines() if line.strip()]
    return sorted(indices)


def _check_finished(spec: dict, report: dict, *, rows: list[int]) -> None:
    result = report["result"]
    good = [i for i in range(spec["n"]) if i not in spec.get("bad", [])]
    assert result["finished"] and not result["preempted"], result
    assert sorted(rows) == good  # every committed row once
    assert result["metrics"] == {"sum": sum(good), "total": sum(good), "count": len(good)}  # exact, across the resume
    assert report["restored"] is not None  # the processor's state came back from the stored job
    assert _failures(spec["storage"]) == sorted(spec.get("bad", []))  # each failure listed once
    assert result["failed_examples"] == len(spec.get("bad", []))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["static", "dynamic"])
def test_a_job_stored_by_the_previous_version_resumes_with_every_example_once(tmp_path, name):
    spec = _unpack(name, tmp_path)
    report = _resume(spec)
    storage = spec["storage"]
    _check_finished(spec, report, rows=read_outputs(storage).column("index").to_pylist())
    values = committed_values(storage)  # the upload_path() files: each good example once
    assert values == Counter(i for i in range(spec["n"]) if i not in spec["bad"])
    # the memory limits the previous version learned were restored: the resumed run never ran out of memory
    assert report["ooms"] == 0 and report["result"]["memory_limits"] is not None


@pytest.mark.slow
def test_a_table_job_stored_by_the_previous_version_adds_its_pending_rows_once(tmp_path):
    pytest.importorskip("deltalake")
    from deltalake import DeltaTable

    spec = _unpack("table", tmp_path)
    before = DeltaTable(spec["table"]).to_pyarrow_table().column("index").to_pylist()
    assert before and len(before) < spec["n"]  # the latest record's pending group is not in the table yet
    report = _resume(spec)
    rows = DeltaTable(spec["table"]).to_pyarrow_table().column("index").to_pylist()
    _check_finished(spec, report, rows=rows)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
