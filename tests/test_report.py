"""``tbp report`` and ``tbp dashboard`` (DESIGN §17), the timeline they read, and failing examples in ``tbp status``.

The pages are opened in a real headless Chromium (the distribution's package; ``.ci/run`` installs it): the tests
wait for the page's script to draw every plot, fail on any console message, and compare the numbers the plots and
tables show with what the job stored. Without Chromium those tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import (
    GENERIC_JOB,
    REPO,
    base_env,
    job_spec,
    run_generic,
    spawn_ranks,
    stop_with_stacks,
    tbp_cmd,
    wait_all,
    wait_for,
)

from torch_batch_process import TorchBatchProcessor, torch_batch_process
from torch_batch_process.engine.plan.bucketing import bucket_layout, contiguous_padded_tokens, token_stats
from torch_batch_process.engine.work import Part
from torch_batch_process.launch import cli
from torch_batch_process.observe import histogram
from torch_batch_process.observe.status import read_status
from torch_batch_process.observe.timeline import POINTS_PER_LEVEL, RankActivity, Timeline

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium installed (Debian/Ubuntu: apt-get install chromium; .ci/run installs it): the report's "
    "browser tests open the page in it",
)
needs_plotly = pytest.mark.skipif(
    importlib.util.find_spec("plotly") is None, reason="plotly is not installed (pip install -e '.[report]')"
)


# ------------------------------------------------------------------------------------------ browser


def browse(url: str, tmp_path: Path, budget_ms: int = 20000) -> tuple[str, list[str]]:
    """Opens ``url`` in headless Chromium; returns the DOM once its scripts ran (virtual time ``budget_ms``) and
    the page's console messages."""
    assert CHROMIUM is not None
    profile = tmp_path / f"chromium-{uuid.uuid4().hex[:8]}"
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
        "--enable-logging=stderr", "--v=0", f"--virtual-time-budget={budget_ms}", "--dump-dom", url,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180)
    shutil.rmtree(profile, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console


class Page(HTMLParser):
    """What a rendered page shows: each plot's title and labels, the summary's cells, the tables' rows."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.titles: dict[str, str] = {}
        self.texts: dict[str, list[str]] = {}  # per plot: annotations, legend entries, bar labels
        self.cells: dict[str, str] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self.hidden_plots: set[str] = set()
        self._plot: str | None = None
        self._cell: str | None = None
        self._table: str | None = None
        self._row: list[str] | None = None
        self._td: list[str] | None = None
        self._svg_text: bool = False
        self._th = False
        self._errors = False
        self.errors = ""
        self._row_has_td = False
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {key: value or "" for key, value in attrs}
        if tag == "body":
            self.body = a
        if a.get("id") == "tbp-errors":
            self._errors = True
        if a.get("id", "").startswith("plot-"):
            self._plot = a["id"][5:]
            self.texts.setdefault(self._plot, [])
            if "hidden" in a:
                self.hidden_plots.add(self._plot)
        if a.get("id", "").startswith("text-") or tag == "section":
            self._plot = None if tag == "section" else self._plot
        if self._plot and tag == "text":
            classes = a.get("class", "")
            if "gtitle" in classes:
                self.titles[self._plot] = a.get("data-unformatted", "")
            elif "annotation-text" in classes or "legendtext" in classes or "bartext" in classes:
                self._svg_text = True
        if tag == "td" and "data-key" in a:
            self._cell = a["data-key"]
            self.cells[self._cell] = ""
        if tag == "table" and a.get("id"):
            self._table = a["id"]
            self.rows[self._table] = []
        if tag == "tr" and self._table:
            self._row = []
            self._row_has_td = False
        if tag in ("td", "th") and self._row is not None:
            self._td = []
            self._th = tag == "th"

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None
        if tag in ("td", "th") and self._td is not None and self._row is not None:
            self._row.append("".join(self._td).strip())
            self._row_has_td = self._row_has_td or tag == "td"
            self._td = None
        if tag == "tr" and self._row is not None and self._table:
            if self._row_has_td:  # not a header row
                self.rows[self._table].append(self._row)
            self._row = None
        if tag == "table":
            self._table = None
        if tag == "text":
            self._svg_text = False

    def handle_data(self, data: str) -> None:
        if self._errors:
            self.errors += data
            self._errors = False
        if self._cell:
            self.cells[self._cell] += data
        if self._td is not None:
            self._td.append(data)
        if self._svg_text and self._plot:
            self.texts[self._plot].append(data)


def check_clean(page: Page, console: list[str]) -> None:
    """The page's script drew every plot, with no error and no console message at all."""
    assert not console, console
    assert page.body.get("data-errors") == "0", page.errors
    assert page.body.get("data-plots") == "drawn", page.body


# --------------------------------------------------------------------------------------------- units


def test_histogram_bins_and_quantiles_are_within_a_bin_of_the_exact_values():
    rng = np.random.default_rng(3)
    seconds = np.exp(rng.normal(-4, 1.2, size=5000))
    found: dict[int, int] = {}
    for value in seconds:
        histogram.add_seconds(found, float(value))
    assert histogram.total(found) == 5000 and len(found) < 60
    for q in (0.1, 0.5, 0.9, 0.99):
        exact = float(np.quantile(seconds, q))
        assert exact / 1.2 < histogram.quantile(found, q) < exact * 1.2
    low, high = histogram.bin_bounds(histogram.bin_of(0.003))
    assert low <= 0.003 < high and high / low == pytest.approx(2**0.25)
    assert histogram.bin_of(0.0) == histogram.FLOOR_BIN and histogram.quantile({}, 0.5) is None
    assert histogram.from_json(json.loads(json.dumps(histogram.to_json(found)))) == found
    assert histogram.to_json({-22: 40, -20: 3, -19: 0}) == [-22, 40, 0, 3] and histogram.to_json({}) == []
    assert histogram.from_json([-22, 40, 0, 3]) == {-22: 40, -20: 3}
    assert histogram.from_json("junk") == {} == histogram.from_json({"x": 1})
    assert histogram.from_json({"3": 2}) == {3: 2}


def test_a_part_counts_whole_batches_in_its_histogram():
    part = Part()
    part.add_batch(0, 4, 0.01)
    part.add_batch(1, 4, 0.0101)
    part.add_batch(2, 3)  # a batch split by on_error="skip": no single time
    assert part.examples == 11 and part.num_batches == 3
    assert part.batch_times == {histogram.bin_of(0.01): 2}
    for k, seconds in enumerate((0.0, 1e-7, 2.0**-20, 3e-6, 0.5, 1.0, 7.3, 5000.0)):  # the inlined binning
        one = Part()
        one.add_batch(k, 1, seconds)
        expected: dict[int, int] = {}
        histogram.add_seconds(expected, seconds)
        assert one.batch_times == expected == {histogram.bin_of(seconds): 1}


def test_timeline_points_double_their_interval_and_carry_the_ranks_work():
    timeline = Timeline(first_interval_s=0.01, per_level=3)
    intervals = []
    for _ in range(7):
        intervals.append(timeline.interval_s())
        timeline.point(
            RankActivity(2), attempt_started=1.0, elapsed_s=2.0, batches_committed=1, examples_committed=4,
            failed_examples=0, preempted=False, finished=False, last=False,
        )
    assert intervals == [0.01, 0.01, 0.01, 0.02, 0.02, 0.02, 0.04]
    assert Timeline(2 * POINTS_PER_LEVEL).interval_s() == 4.0, "the count goes on across resumes"
    timeline = Timeline(first_interval_s=60)
    assert not timeline.due(last=False) and timeline.due(last=True)
    activity = RankActivity(2)
    activity.add_vote(1, 3, 12, {"data": 0.5, "process": 1.5, "commit": 0.1}, {-20: 3})
    activity.add_vote(1, 1, 4, {"data": 0.1, "process": 0.4, "commit": 0.1}, {-20: 1, -18: 0})
    activity.add_record_write(0.004, 0.02)
    activity.add_record_write(0.006, 0.01)
    timeline.count_record()
    line = timeline.point(
        activity, attempt_started=10.0, elapsed_s=5.0, batches_committed=8, examples_committed=32, failed_examples=1,
        preempted=True, finished=False, last=True,
    )
    assert line["group"] == "timeline" and line["steps_completed"] == 8
    point = line["metrics"]
    assert point["ranks"]["batches"] == [0, 4] and point["ranks"]["examples"] == [0, 16]
    assert point["ranks"]["process_s"] == [0.0, 1.9] and point["ranks"]["votes"] == [0, 2]
    assert point["ranks"]["batch_times"] == [[], [-20, 4]]
    assert point["commits"] == 1 and point["record_writes"] == 2 and sum(point["commit_latency"][1:]) == 2
    assert point["record_write_s"] == 0.01 and point["record_write_max_s"] == 0.006
    assert point["preempted"] and point["last"] and point["failed_examples"] == 1
    assert len(json.dumps(line)) < 700


def test_token_stats_count_real_and_padded_tokens_of_the_plan_and_of_dataset_order():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, size=1003)
    layout = bucket_layout(lengths, 8, 4, None)
    stats = token_stats(layout, lengths, 8, layout.num_batches())
    assert stats["real"] == int(lengths.sum()) and stats["examples"] == 1003
    assert stats["padded"] == layout.padded_tokens(lengths)
    assert stats["padded_in_order"] == contiguous_padded_tokens(lengths, 8)
    assert sum(stats["fill"]) == sum(stats["fill_in_order"]) == layout.num_batches() == 126
    first = token_stats(layout, lengths, 8, 10)  # max_batches: only the planned batches
    examples = np.concatenate([layout.batch_indices(g) for g in range(10)])
    assert first["examples"] == len(examples) and first["real"] == int(lengths[examples].sum())
    assert first["padded_in_order"] == contiguous_padded_tokens(lengths[np.sort(examples)], 8)


# ------------------------------------------------------------------------------------- a real job

N = 400
BATCH = 4
LENGTHS = [(i * 37) % 50 + 1 for i in range(N)]
PROCESS_BAD = {13, 250}
LOAD_BAD = {77}


class Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        if index in LOAD_BAD:
            raise OSError(f"item {index} cannot be read")
        return torch.tensor(index)


class Flaky(TorchBatchProcessor):
    """Fails on the examples of ``PROCESS_BAD``; preempts its own process at batch ``preempt_at``."""

    preempt_at: int | None = None

    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        bad = PROCESS_BAD & {int(v) for v in batch}
        if bad:
            raise ValueError(f"cannot embed example {min(bad)}")
        if batch_idx == type(self).preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # the library's handler: commit and stop at the next step
        time.sleep(0.002)


def _run(storage: str, preempt_at: int | None = None, **kwargs: Any) -> Any:
    Flaky.preempt_at = preempt_at
    return torch_batch_process(
        Flaky, Items(), batch_size=BATCH, checkpoint_interval=3, storage_path=storage, on_error="skip",
        bucket_by=LENGTHS, progress="off", **kwargs,
    )


def _whole_batches() -> int:
    """Batches of the plan holding no failing example: those ``process_batch`` ran whole."""
    layout = bucket_layout(np.asarray(LENGTHS), BATCH, 100, None)
    bad = PROCESS_BAD | LOAD_BAD
    return sum(1 for g in range(layout.num_batches()) if not bad & set(layout.batch_indices(g).tolist()))


@pytest.fixture(scope="module")
def preempted_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job preempted at its 30th batch, then resumed to the end, with three failing examples (two in
    ``process_batch``, one in loading) and ``bucket_by``."""
    storage = tmp_path_factory.mktemp("report") / "job"
    first = _run(str(storage), preempt_at=30)
    assert first.preempted and 30 < first.batches_committed < 100
    second = _run(str(storage))
    assert second.finished and second.failed_examples == 3 and second.examples_committed == N
    return storage


@needs_plotly
@needs_chromium
def test_report_of_a_preempted_and_resumed_job_shows_its_real_numbers_in_the_browser(preempted_job, tmp_path):
    output = tmp_path / "report.html"
    assert cli.main(["report", str(preempted_job), "-o", str(output)]) == 0
    assert output.stat().st_size < 5_000_000
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", output.read_text()), "nothing from the network"
    status = read_status(str(preempted_job))
    dom, console = browse(output.as_uri(), tmp_path)
    page = Page(dom)
    check_clean(page, console)

    expected = {"progress", "throughput", "batch_times", "ranks", "commits", "padding", "failures"}
    assert set(page.titles) == expected and not page.hidden_plots & expected, (page.titles, page.hidden_plots)
    assert page.titles["progress"] == f"Progress: {N:,} of {N:,} examples committed (100.0%)"
    assert "attempt 2 (1 rank(s)): resumed after preemption" in page.texts["progress"]
    assert "attempt 1 preempted" in page.texts["progress"]
    assert page.titles["throughput"].startswith("Throughput: ") and "(2 attempts)" in page.titles["throughput"]
    assert page.titles["batch_times"].startswith(f"Batch times (process_batch): {_whole_batches():,} batches;")
    assert page.titles["ranks"] == "Ranks: 1 rank worked (stragglers need two or more)"
    assert page.titles["commits"].startswith(f"Commits: {status['last_commit']['commit']:,} commit record(s); latency")
    lengths = np.asarray(LENGTHS)
    layout = bucket_layout(lengths, BATCH, 100, None)
    padded, in_order = layout.padded_tokens(lengths), contiguous_padded_tokens(lengths, BATCH)
    assert page.titles["padding"].startswith(
        f"Padding (bucket_by): {padded:,} padded tokens for {int(lengths.sum()):,} real"
    ) and f"dataset order: {in_order:,}" in page.titles["padding"]
    assert page.titles["failures"] == "Failing examples: 3 (load 1, process 2)"

    assert page.cells["examples"] == f"{N} of {N} (100.0%)" and page.cells["failed_examples"] == "3"
    assert page.cells["state"] == "finished" and page.cells["attempts"] == "2" and page.cells["eta"] == "done"
    assert status["failed_examples"] == 3 and status["examples_committed"] == N
    attempts = page.rows["tbp-attempts"]
    assert [row[0] for row in attempts] == ["1", "2"] and [row[-1] for row in attempts] == ["preempted", "finished"]
    assert sum(int(row[3]) for row in attempts) == N - 3, "every example processed once, the failing ones skipped"
    failures = page.rows["tbp-failures"]
    assert [int(row[0]) for row in failures] == sorted(PROCESS_BAD | LOAD_BAD)
    assert {row[0]: row[4] for row in failures} == {"13": "process", "77": "load", "250": "process"}
    assert "cannot embed example 13" in failures[0][6] and failures[1][5] == "OSError"
    arguments = dict(page.rows["tbp-arguments"])
    assert arguments["on_error"] == "skip" and arguments["checkpoint_interval"] == "3"
    assert arguments["bucket_by"] == "true"
    assert [row[0] for row in page.rows["tbp-job-lines"]] == ["1", "2"]


@needs_plotly
def test_report_data_of_a_job_on_every_storage_backend(storage_url):
    from torch_batch_process.observe.report.data import read_job_data
    from torch_batch_process.observe.report.page import build_model, render_page

    result = _run(storage_url)
    assert result.finished and result.failed_examples == 3
    data = read_job_data(storage_url)
    assert data.points and data.points[-1]["metrics"]["finished"] and len(data.jobs) == 1
    assert data.jobs[0]["metrics"]["arguments"]["checkpoint_interval"] == 3
    assert data.jobs[0]["metrics"]["tokens"]["real"] == sum(LENGTHS)
    points = [p["metrics"] for p in data.points]
    assert sum(sum(p["ranks"]["examples"]) for p in points) == N - 3
    assert points[-1]["examples_committed"] == N and points[-1]["failed_examples"] == 3
    assert [int(r["index"]) for r in data.failures] == sorted(PROCESS_BAD | LOAD_BAD)
    model = build_model(data)
    figures = {s["key"]: s["figure"] for s in model["sections"]}
    assert figures["failures"]["layout"]["title"]["text"] == "Failing examples: 3 (load 1, process 2)"
    assert "<html" in render_page(model)[:200]


@needs_plotly
def test_report_of_a_job_without_a_timeline_still_shows_what_is_stored(tmp_path):
    storage = tmp_path / "job"
    assert _run(str(storage)).finished
    (storage / "metrics.jsonl").unlink()  # as a job of an older version, which wrote no timeline
    from torch_batch_process.observe.report import build_report

    page = build_report(str(storage))
    assert "holds no timeline points" in page and "Failing examples" in page
    assert "no arguments stored" in page


def test_report_and_dashboard_refuse_bad_arguments_and_missing_jobs(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nothing"), "-o", str(tmp_path / "r.html")]) in (1, 2)
    assert "no job is stored at" in capsys.readouterr().err or importlib.util.find_spec("plotly") is None
    assert cli.main(["report", str(tmp_path), "-o", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err or importlib.util.find_spec("plotly") is None
    assert cli.main(["dashboard", str(tmp_path), "--refresh", "0"]) == 2
    assert "--refresh must be at least 0.5 seconds" in capsys.readouterr().err
    assert cli.main(["dashboard", str(tmp_path), "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path), "--storage-options", "[1]"]) == 2
    capsys.readouterr()
    for bad in ("", "s3:/bucket/job"):  # the working directory, a local folder named 's3:': read as a job before
        for command in ("report", "status", "failures"):
            assert cli.main([command, bad]) in (1, 2)
            assert "storage_path" in capsys.readouterr().err or importlib.util.find_spec("plotly") is None


def test_report_to_an_empty_or_unwritable_output_is_one_clear_line(tmp_path, capsys):
    """-o '' ended in a FileNotFoundError traceback; a file in the way of the output's folder, in a NotADirectoryError
    or FileExistsError traceback."""
    pytest.importorskip("plotly")
    storage = tmp_path / "job"
    assert _run(str(storage)).finished
    capsys.readouterr()
    assert cli.main(["report", str(storage), "-o", ""]) == 2
    assert capsys.readouterr().err == "tbp report: --output is empty; give a file name, e.g. report.html\n"
    (tmp_path / "file").write_text("x")
    assert cli.main(["report", str(storage), "-o", str(tmp_path / "file" / "r.html")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tbp report: cannot write --output {str(tmp_path / 'file' / 'r.html')!r}")
    assert err.count("\n") == 1


def test_report_without_output_goes_next_to_the_job_named_after_it_and_says_where(tmp_path, capsys, monkeypatch):
    """Issue 48 item 5: without -o the page was report.html in the working directory (a clone's root, where it shows
    in git status)."""
    pytest.importorskip("plotly")
    from torch_batch_process.observe.report.commands import default_output

    assert _run(str(tmp_path / "runs" / "job")).finished
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main(["report", "runs/job/"]) == 0
    assert capsys.readouterr().out.startswith("wrote runs/job-report.html (")
    assert (tmp_path / "runs" / "job-report.html").stat().st_size > 0 and not (tmp_path / "report.html").exists()
    page = (tmp_path / "runs" / "job-report.html").read_text()
    name = html.escape(f"job '{read_status(str(tmp_path / 'runs' / 'job'))['job_name']}'")  # issue 41 item 3: quoted
    assert f"<title>{name}: torch_batch_process report</title>" in page and f"<h1>{name}</h1>" in page
    assert default_output("s3://bucket/jobs/digits/") == "digits-report.html"
    assert default_output("file:///srv/jobs/digits") == "/srv/jobs/digits-report.html"


# -------------------------------------------------------------------------------------- tbp status


def test_status_shows_the_failing_examples_in_text_and_json(preempted_job, tmp_path, capsys):
    capsys.readouterr()
    assert cli.main(["status", str(preempted_job), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["failed_examples"] == 3
    failures = status["failures"]
    assert failures["count"] == 3 and failures["by_phase"] == {"load": 1, "process": 2} and failures["error"] is None
    assert failures["by_error"] == {"ValueError": 2, "OSError": 1}
    assert [entry["index"] for entry in failures["first"]] == [13, 77, 250]
    assert failures["first"][0]["message"] == "cannot embed example 13" and "traceback" not in failures["first"][0]
    assert failures["path"] == str(preempted_job / "failures")
    assert cli.main(["status", str(preempted_job)]) == 0
    text = capsys.readouterr().out
    assert "failed       3 example(s) skipped (on_error='skip'); by phase: load 1, process 2" in text
    assert "  index 77 (batch " in text and "OSError: item 77 cannot be read" in text

    clean = tmp_path / "clean"
    torch_batch_process(Flaky, list(range(100, 140)), batch_size=4, storage_path=str(clean), progress="off")
    assert cli.main(["status", str(clean), "--json"]) == 0
    none = json.loads(capsys.readouterr().out)
    assert none["failed_examples"] == 0 and none["failures"]["count"] == 0 and none["failures"]["first"] == []
    assert cli.main(["status", str(clean)]) == 0
    assert "failed       none" in capsys.readouterr().out


def test_status_counts_the_failures_left_after_retry_failed(tmp_path):
    storage = str(tmp_path / "job")
    assert _run(storage).failed_examples == 3
    global PROCESS_BAD
    saved, PROCESS_BAD = PROCESS_BAD, set()
    try:
        retried = _run(storage, retry_failed=True)
    finally:
        PROCESS_BAD = saved
    assert retried.finished
    status = read_status(storage)
    assert status["failed_examples"] == 1 and status["failures"]["by_phase"] == {"load": 1}
    assert status["failures"]["path"].endswith("retries/1/failures")


HOSTILE = {  # what a failing example's message may hold: a prompt, a file name, a model's answer
    1: "<script>alert(1)</script><img src=x onerror=alert(2)>",
    2: "\x1b]52;c;cHduZWQ=\x07\x1b[2J\x1b[31mred",
    3: "nul\x00byte",
    4: "lone \ud800 surrogate",
    5: "rtl \u202eexe.txt",
}


class Hostile(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        for index in self.context.batch_indices:
            if index in HOSTILE:
                raise ValueError(HOSTILE[index])
        self.context.write({"n": list(self.context.batch_indices)})


class Tags(HTMLParser):
    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)


@needs_plotly
def test_stored_text_that_would_act_is_shown_escaped_by_status_failures_and_report(tmp_path, capsys):
    """A keyed job's failure messages and version= holding HTML, terminal escapes, NUL, a lone surrogate and a
    right-to-left override: tbp status and tbp failures printed them raw (or died of UnicodeEncodeError), tbp report
    died writing the page."""
    storage = tmp_path / "job"
    examples = [{"id": f"<b>{i}</b>", "text": HOSTILE.get(i, "")} for i in range(8)]
    torch_batch_process(Hostile, examples, batch_size=4, storage_path=str(storage), key="id", on_error="skip",
                        version="<script>v\ud800</script>", progress="off")
    capsys.readouterr()
    for command in ("status", "failures"):
        assert cli.main([command, str(storage)]) == 0
        text = capsys.readouterr().out
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f\u202e\ud800]", text), command
        for shown in ("\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J", "nul\\x00byte", "lone \\ud800 surrogate", "rtl \\u202eexe"):
            assert shown in text, (command, shown)
    output = tmp_path / "report.html"
    assert cli.main(["report", str(storage), "-o", str(output)]) == 0
    page = output.read_bytes().decode("utf-8")  # strict: valid UTF-8
    assert Tags(page).tags.count("script") == 3 and "img" not in Tags(page).tags  # the page's own scripts only
    messages = [row[6] for row in Page(page).rows["tbp-failures"]]
    assert messages == ["<script>alert(1)</script><img src=x onerror=alert(2)>",
                        "\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x1b[31mred", "nul\\x00byte",
                        "lone \\ud800 surrogate", "rtl \\u202eexe.txt"]


# --------------------------------------------------------------------------------------- dashboard


@contextlib.contextmanager
def _children_get_sigint_at_its_default() -> Iterator[None]:
    """Processes started inside start with SIGINT at its default even when this one ignores it.

    pytest started in the background by a shell (``cmd &``, a CI step's ``nohup``) ignores SIGINT, and a child keeps
    an ignored signal ignored across exec: ``tbp dashboard``, which by design leaves an ignored SIGINT ignored, then
    never sees the test's Ctrl-C. A handled signal is reset to its default by exec, so this process handles SIGINT
    (as Python does by default) while it starts the child. Nothing runs in the child between fork and exec (unlike
    ``preexec_fn``, unsafe with threads: moto's, the fault proxy's); SIGINT is handled here for the few
    milliseconds of the start only, and only when it was ignored."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:  # an int (1) when ignored at the start, == SIG_IGN
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_dashboard(storage: Path | str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    with _children_get_sigint_at_its_default():  # the test's SIGINT is its Ctrl-C, whatever started pytest
        proc = subprocess.Popen(
            tbp_cmd("dashboard", str(storage), "--port", "0", "--refresh", "0.5", *extra),
            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
            start_new_session=True,  # stop_with_stacks kills its session
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "serving http://127.0.0.1:" in line, line + (proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split("serving ", 1)[1].split(" ", 1)[0]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:  # where it hangs: every thread's stack (kill -USR1), then the test fails
        out, err = stop_with_stacks(proc)
        raise AssertionError(f"tbp dashboard did not stop within 20 s of SIGINT; its stderr:\n{err[-8000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return out


def _summary(model: dict[str, Any]) -> str:
    return next(section["html"] for section in model["sections"] if section["key"] == "summary")


@needs_plotly
def test_dashboard_serves_the_live_page_and_stops_cleanly_on_ctrl_c(preempted_job, tmp_path):
    proc, url = _start_dashboard(preempted_job)
    try:
        code, body = _get(url)
        assert code == 200 and b'id="tbp-model"' in body and b"live: refreshes every 0.5 s" in body
        code, body = _get(url + "data.json")
        model = json.loads(body)
        assert code == 200 and model["live"] and [s["key"] for s in model["sections"]][0] == "summary"
        assert f'<span class="num">{N}</span>' in _summary(model)
        code, body = _get(url + "report.html")
        assert code == 200 and b"by <code>tbp report</code>" in body
        assert _get(url + "nope")[0] == 404
        if CHROMIUM is not None:  # the live page in a browser: drawn, then updated from data.json
            dom, console = browse(url, tmp_path, budget_ms=6000)
            page = Page(dom)
            check_clean(page, console)
            assert int(page.body.get("data-refreshes", "0")) >= 1, page.body
            assert page.titles["failures"] == "Failing examples: 3 (load 1, process 2)"
    finally:
        out = _stop(proc)
    assert "tbp dashboard: stopped" in out
    port = int(url.rsplit(":", 1)[1].strip("/"))
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)


@pytest.mark.slow
@needs_plotly
def test_dashboard_follows_a_running_job_from_before_its_start_to_its_end(tmp_path):
    gate = tmp_path / "gate"
    gate.write_text("held")
    spec = job_spec(
        tmp_path, n=240, batch_size=4, checkpoint_interval=2, outputs="none", sleep=0.01, gate_batch=30,
        gate_file=str(gate), kwargs={"progress": "off"},
    )
    storage = Path(spec["storage"])
    proc, url = _start_dashboard(storage)
    job = None
    try:
        code, body = _get(url)
        assert code == 200 and b"Nothing to show yet" in body and b"no job is stored" in body
        assert _get(url + "data.json")[0] == 503
        (job,) = spawn_ranks(1, GENERIC_JOB, json.dumps(spec))
        wait_for(lambda: Path(str(gate) + ".reached").exists(), 120, "the job held at its gate")
        time.sleep(1.0)  # its commits before the gate are written, and the dashboard's model is older than 0.25 s

        def committed() -> int:
            code, body = _get(url + "data.json")
            if code != 200:
                return -1
            return int(_summary(json.loads(body)).split('<span class="num">', 1)[1].split("<", 1)[0])

        held = committed()
        assert 0 < held < 240, held
        running = _summary(json.loads(_get(url + "data.json")[1]))
        assert 'data-key="state">running' in running and re.search(r'data-key="eta">\d+:\d\d:\d\d<', running), running
        gate.unlink()
        wait_all([job], timeout=120)
        wait_for(lambda: committed() == 240, 30, "the dashboard showing the finished job")
        code, body = _get(url + "data.json")
        summary = _summary(json.loads(body))
        assert 'data-key="state">finished' in summary
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        _stop(proc)


@pytest.mark.slow
@needs_plotly
@needs_chromium
def test_report_of_two_ranks_names_the_straggler_and_plots_every_rank(tmp_path):
    spec = job_spec(
        tmp_path, n=240, batch_size=4, checkpoint_interval=5, outputs="none", sleep_rank={"1": 0.04},
        kwargs={"progress": "off"},
    )
    proc, reports = run_generic(spec, nproc=2, launcher="ranks")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = tmp_path / "report.html"
    assert cli.main(["report", spec["storage"], "-o", str(output)]) == 0
    dom, console = browse(output.as_uri(), tmp_path)
    page = Page(dom)
    check_clean(page, console)
    assert page.titles["ranks"].startswith("Ranks: rank 1 is a straggler (")
    assert {"rank 0", "rank 1"} <= set(page.texts["throughput"])
    assert {"rank 0", "rank 1"} <= set(page.texts["batch_times"])
    ranks = {row[0]: row for row in page.rows["tbp-ranks"]}
    assert ranks["rank 1 (straggler)"][1] == "30" and ranks["rank 0"][1] == "30", "60 batches, 30 per rank"
    assert page.titles["batch_times"].startswith("Batch times (process_batch): 60 batches;")
    assert page.cells["examples"] == "240 of 240 (100.0%)"


@needs_plotly
def test_tbp_dashboard_shows_a_storage_path_that_would_act_escaped(tmp_path):
    """A path with a lone surrogate (a name decoded with surrogateescape) killed tbp dashboard's start line with
    UnicodeEncodeError, and its waiting page was never sent; escapes in it reached the terminal and the page raw."""
    proc, url = _start_dashboard(tmp_path / "job\udcff\x1b[2J")
    try:
        code, body = _get(url)
        assert code == 200 and b"Nothing to show yet for <code>" in body and b"job\\udcff\\x1b[2J</code>" in body
    finally:
        _stop(proc)
