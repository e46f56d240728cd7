"""The report page: one self-contained HTML file (no network access, no CDN) made from a stored job.

:func:`build_model` turns :class:`~torch_batch_process.observe.report.data.JobData` into the page's *model*: its
sections in a fixed order, each with its HTML text (tables, notes) and its plotly figure (or ``None``).
:func:`render_page` writes the model as HTML: the text is in the page itself (readable without JavaScript), the
figures are drawn by plotly.js, which is embedded gzip-compressed and base64-encoded (about 1.9 MB instead of
4.8 MB; the browser unpacks it with ``DecompressionStream``, in every major browser since 2023). The dashboard
serves the same page with ``live`` set: it then fetches ``data.json`` (the model) every few seconds and updates
the text and the plots in place (zoom kept).

Errors in the page's script are shown at its top (element ``#tbp-errors``) and counted in ``body[data-errors]``;
``body[data-plots="drawn"]`` is set once every figure is drawn (what the browser tests wait for).
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import json
import time
from collections.abc import Iterable
from typing import Any

from torch_batch_process.observe.histogram import quantile
from torch_batch_process.observe.options import DEFAULT_STRAGGLER_RATIO
from torch_batch_process.observe.progress import format_duration
from torch_batch_process.observe.report import figures
from torch_batch_process.observe.report.data import JobData
from torch_batch_process.observe.report.series import (
    Attempt,
    RankTotals,
    attempts,
    decimate,
    intervals,
    rank_totals,
    stragglers,
)
from torch_batch_process.observe.status import generation_text
from torch_batch_process.observe.visible_text import visible
from torch_batch_process.outputs.keyed.runs import counts_text
from torch_batch_process.shell_commands import pip_install

__all__ = ["SECTIONS", "build_model", "plotly_bundle", "render_page"]

SECTIONS = (
    ("summary", "Summary"),
    ("progress", "Progress"),
    ("throughput", "Throughput"),
    ("batch_times", "Batch times"),
    ("ranks", "Ranks and stragglers"),
    ("commits", "Commits"),
    ("padding", "Padding"),
    ("failures", "Failing examples"),
    ("arguments", "Arguments"),
)
"""The page's sections, in order: ``(key, title)``; the plot of section ``key`` is the element ``#plot-<key>``."""

FAILURES_SHOWN = 20
"""Failing examples listed in the page's table (``tbp failures`` lists them all)."""


def build_model(data: JobData, *, live: bool = False, refresh_s: float = 5.0) -> dict[str, Any]:
    """The page's model (JSON-able): ``title``, ``generated``, ``live``, ``refresh_s`` and ``sections`` (``key``,
    ``title``, ``html``, ``figure``)."""
    status = data.status
    items = intervals(data.points)
    runs = attempts(items, running=status.get("state") == "running")
    shown = decimate(items)
    totals = rank_totals(items)
    job = data.jobs[-1]["metrics"] if data.jobs else {}
    ratio = float(job.get("straggler_ratio") or DEFAULT_STRAGGLER_RATIO)
    found = stragglers(totals, ratio)
    failed = int(status.get("failed_examples") or 0)
    records = sum(item.commits for item in items)
    parts: dict[str, tuple[str, dict[str, Any] | None]] = {
        "summary": (_summary_html(data, runs), None),
        "progress": (_progress_html(data, items), figures.progress_figure(shown, runs, status)),
        "throughput": (_attempts_html(runs, data), figures.throughput_figure(shown, runs)),
        "batch_times": (_batch_times_html(totals), figures.batch_times_figure(totals)),
        "ranks": (_ranks_html(totals, found), figures.ranks_figure(totals, found, ratio)),
        "commits": (_commits_html(items, records), figures.commits_figure(shown, runs, records)),
        "padding": (_padding_html(job), figures.padding_figure(job.get("tokens"))),
        "failures": (_failures_html(data, failed), figures.failures_figure(data.failures, failed)),
        "arguments": (_arguments_html(data), None),
    }
    return {
        "title": f"job '{status['job_name']}': torch_batch_process report",
        "job_name": status["job_name"],
        "generated": time.time(),
        "generated_text": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
        "live": live,
        "refresh_s": refresh_s,
        "sections": [
            {"key": key, "title": title, "html": parts[key][0], "figure": parts[key][1]} for key, title in SECTIONS
        ],
    }


# ----------------------------------------------------------------------------------------- the page


@functools.lru_cache(maxsize=1)
def plotly_bundle() -> tuple[str, str]:
    """plotly.js (of the installed ``plotly`` package) gzip-compressed and base64-encoded, and its version."""
    try:
        import plotly
        from plotly.offline import get_plotlyjs
    except ImportError as exc:
        raise ImportError(f"tbp report and tbp dashboard need plotly: {pip_install('report')}") from exc
    packed = gzip.compress(get_plotlyjs().encode("utf-8"), compresslevel=9, mtime=0)
    return base64.b64encode(packed).decode("ascii"), plotly.__version__


def render_page(model: dict[str, Any]) -> str:
    """The HTML page of a model (see the module docstring)."""
    bundle, version = plotly_bundle()
    figures_only = {
        "live": model["live"],
        "refresh_s": model["refresh_s"],
        "template": figures.template(),
        "figures": {section["key"]: section["figure"] for section in model["sections"]},
    }
    body = "\n".join(_section_html(section) for section in model["sections"])
    mode = (
        f'live: refreshes every {model["refresh_s"]:g} s, last update <span id="tbp-updated">'
        f'{_e(model["generated_text"])}</span>'
        if model["live"]
        else f'made {_e(model["generated_text"])} by <code>tbp report</code>'
    )
    nav = " · ".join(f'<a href="#sec-{key}">{_e(title)}</a>' for key, title in SECTIONS)
    return _TEMPLATE.format(
        title=_e(model["title"]),
        job=_e(f"job '{model['job_name']}'"),
        mode=mode,
        nav=nav,
        body=body,
        model=_script_json(figures_only),
        bundle=bundle,
        version=_e(version),
        style=_STYLE,
        script=_SCRIPT,
    )


def _section_html(section: dict[str, Any]) -> str:
    key = section["key"]
    hidden = "" if section["figure"] else " hidden"
    plot = f'<div class="tbp-plot" id="plot-{key}"{hidden}></div>' if key not in ("summary", "arguments") else ""
    return (
        f'<section id="sec-{key}"><h2>{_e(section["title"])}</h2>{plot}'
        f'<div class="tbp-text" id="text-{key}">{section["html"]}</div></section>'
    )


def _script_json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element."""
    return json.dumps(value, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")


def _e(value: Any) -> str:
    """``value`` as HTML text; :func:`visible`: a lone surrogate in a stored message would fail the page's UTF-8."""
    return html.escape(visible(value), quote=True)


# --------------------------------------------------------------------------------------- sections


def _table(rows: Iterable[tuple[str, Any]], table_id: str = "", keys: Iterable[str] | None = None) -> str:
    """A two-column table; ``keys`` names each row (``data-key``, for readers and tests)."""
    keyed = list(keys) if keys is not None else None
    cells = []
    for index, (label, value) in enumerate(rows):
        key = f' data-key="{_e(keyed[index])}"' if keyed else ""
        cells.append(f"<tr><th>{_e(label)}</th><td{key}>{value}</td></tr>")
    ident = f' id="{table_id}"' if table_id else ""
    return f'<table class="kv"{ident}>{"".join(cells)}</table>'


def _grid(header: list[str], rows: list[list[Any]], table_id: str = "") -> str:
    ident = f' id="{table_id}"' if table_id else ""
    head = "".join(f"<th>{_e(name)}</th>" for name in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f'<table class="grid"{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _when(epoch: float | None) -> str:
    if not epoch:
        return "n/a"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def _note(text: str) -> str:
    return f'<p class="note">{_e(text)}</p>'


def _summary_html(data: JobData, runs: list[Attempt]) -> str:
    status = data.status
    throughput = status.get("throughput") or {}
    state = status["state"]
    if state == "preempted":
        state += " (run the same command again to resume)"
    elif state == "stopped" and status["batches_committed"] < status["batches_total"]:
        state += " (not running: it failed, crashed or was killed; run the same command again to resume)"
    rate = throughput.get("examples_per_s")
    running_s = sum(run.seconds for run in runs)
    rows = [
        ("job", _e(f"'{status['job_name']}'"), "job_name"),
        ("storage", f'<code>{_e(status["storage_path"])}</code>', "storage_path"),
        ("state", _e(state), "state"),
        ("examples committed", f'<span class="num">{status["examples_committed"]}</span> of '
         f'<span class="num">{status["examples_total"]}</span> ({status["percent"]:.1f}%)', "examples"),
        ("batches committed", f'{status["batches_committed"]} of {status["batches_total"]}', "batches"),
        ("failed examples", f'<span class="num">{int(status.get("failed_examples") or 0)}</span>', "failed_examples"),
        ("attempts", _e(status["attempts"]), "attempts"),
        ("throughput", _e(f"{rate:,.1f} examples/s (attempt {throughput.get('attempt')}, "
                          f"{throughput.get('world_size')} rank(s))") if rate is not None else "n/a", "throughput"),
        ("ETA", _e(format_duration(status["eta_s"])) if status.get("eta_s") is not None else
         ("done" if state == "finished" else "n/a (not running)"), "eta"),
        ("running time", _e(format_duration(running_s)) if runs else "n/a", "running_time"),
        ("last commit", _e(_when((status.get("last_commit") or {}).get("time"))), "last_commit"),
    ]
    if status.get("generation"):  # a generation job: prompts, tokens, tokens per second per rank
        rows.append(("generation", _e(generation_text(status["generation"])).replace("\n", "<br>"), "generation"))
    if status.get("runs"):  # a keyed job's incremental runs (DESIGN §21): new, changed, failed-retried, unchanged
        rows.append(("incremental runs", "<br>".join(_e(counts_text(run)) for run in status["runs"]), "runs"))
    metrics = status.get("metrics")
    if metrics:
        text = ", ".join(f"{key}={_short(value)}" for key, value in sorted(metrics.items()))
        rows.append(("metrics" if status.get("metrics_final") else "metrics so far", _e(text), "metrics"))
    table = _table([(label, value) for label, value, _ in rows], "tbp-summary", [key for _, _, key in rows])
    notes = [note for note in (data.metrics_error, data.failures_error) if note]
    if not data.points:
        notes.append(
            "this job's metrics.jsonl holds no timeline points (a job of an older version, or no commit yet): the "
            "plots over time are empty"
        )
    return table + "".join(_note(note) for note in notes)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def _progress_html(data: JobData, items: list[Any]) -> str:
    if not items:
        return _note("no timeline point yet")
    return _note(f"{len(items)} timeline point(s); one line per attempt; the dotted line is the planned total.")


def _attempts_html(runs: list[Attempt], data: JobData) -> str:
    if not runs:
        return ""
    rows = []
    for run in runs:
        rate = run.examples / run.seconds if run.seconds > 0 else None
        rows.append([
            run.attempt, _e(_when(run.started)), run.world_size, run.examples, run.batches,
            _e(format_duration(run.seconds)), f"{rate:,.1f}" if rate is not None else "n/a", _e(run.end),
        ])
    header = ["attempt", "started", "ranks", "examples", "batches", "running", "examples/s", "ended"]
    missing = int(data.status.get("attempts") or 0) - len(runs)
    note = _note(f"{missing} attempt(s) made no commit (they stopped before their first)") if missing > 0 else ""
    return _grid(header, rows, "tbp-attempts") + note


def _batch_times_html(totals: list[RankTotals]) -> str:
    if not any(each.batch_times for each in totals):
        return _note("no batch times stored yet")
    return _note(
        "seconds in process_batch per batch, counted in bins 19% wide (the quantiles shown are within a bin); "
        "batches split by on_error='skip' are not counted"
    )


def _ranks_html(totals: list[RankTotals], found: dict[int, float]) -> str:
    worked = [each for each in totals if each.batches]
    if not worked:
        return ""
    rows = []
    for each in worked:
        per_commit = each.commit_s / each.votes if each.votes else None
        rate = each.busy_rate
        rows.append([
            f"rank {each.rank}" + (" <b>(straggler)</b>" if each.rank in found else ""), each.batches, each.examples,
            f"{each.data_s:,.2f}", f"{each.process_s:,.2f}", f"{each.commit_s:,.2f}",
            f"{rate:,.1f}" if rate is not None else "n/a",
            *(figures.format_seconds(each.batch_quantile(q)) for q in (0.5, 0.9, 0.99)),
            figures.format_seconds(per_commit),
        ])
    header = ["rank", "batches", "examples", "loading s", "process_batch s", "commit s", "examples/busy s",
              "batch p50", "batch p90", "batch p99", "s per commit"]
    return _grid(header, rows, "tbp-ranks") + _note(
        "over every attempt (rank r of each attempt counts as rank r); a straggler's busy rate is below the job's "
        "straggler ratio times the median of the other ranks"
    )


def _commits_html(items: list[Any], records: int) -> str:
    if not items:
        return ""
    latency: dict[int, int] = {}
    for item in items:
        for key, count in item.commit_latency.items():
            latency[key] = latency.get(key, 0) + count
    writes = sum(item.record_writes for item in items)
    write_s = sum(item.record_write_s for item in items)
    rows = [
        ("commit records", f"{records:,}"),
        ("record writes (group commits)", f"{writes:,}" + (f", {figures.format_seconds(write_s / writes)} each on "
                                                            "average" if writes else "")),
        ("commit latency, median", figures.format_seconds(quantile(latency, 0.5))),
        ("commit latency, p99", figures.format_seconds(quantile(latency, 0.99))),
    ]
    return _table(rows, "tbp-commits") + _note(
        "commit latency: from rank 0 merging a commit's votes to its record being durable; counted once per "
        "record write (records that wait are written together), as the longest wait among the commits it wrote"
    )


def _padding_html(job: dict[str, Any]) -> str:
    tokens = job.get("tokens")
    if not tokens:
        return _note("this job has no bucket_by lengths, so its padding is not known (see DESIGN §9)")
    return _table(
        [
            ("real tokens", f'{tokens["real"]:,}'),
            ("padded tokens (bucket_by plan)", f'{tokens["padded"]:,}'),
            ("padded tokens in dataset order", f'{tokens["padded_in_order"]:,}'),
            ("batches", f'{tokens["batches"]:,}'),
        ],
        "tbp-padding",
    )


def _failures_html(data: JobData, failed: int) -> str:
    if not failed:
        return _note("no failing example" + (" (on_error='raise')" if _on_error(data) == "raise" else ""))
    records = data.failures
    rows = []
    for record in records[:FAILURES_SHOWN]:
        rows.append([
            record.get("index"), record.get("batch_idx"), record.get("attempt"), record.get("rank"),
            _e(record.get("phase")), _e(record.get("error_type")), _e(_first_line(record.get("message"))),
            _e(_when(record.get("time"))),
        ])
    header = ["index", "batch", "attempt", "rank", "phase", "error", "message", "time"]
    more = f"; the first {FAILURES_SHOWN} by dataset index below" if len(records) > FAILURES_SHOWN else ""
    text = _note(f'{failed:,} failing example(s){more}; all of them: tbp failures {data.status["storage_path"]}')
    error = _note(data.failures_error) if data.failures_error else ""
    return text + error + _grid(header, rows, "tbp-failures")


def _on_error(data: JobData) -> str | None:
    if not data.jobs:
        return None
    return (data.jobs[-1]["metrics"].get("arguments") or {}).get("on_error")


def _first_line(message: Any) -> str:
    lines = str(message or "").strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= 200 else line[:197] + "..."


def _arguments_html(data: JobData) -> str:
    status = data.status
    parts = ["<h3>Fingerprint (fixed at the first start)</h3>"]
    spec = dict(status.get("spec") or {})
    parts.append(_table([(key, _e(_short(value))) for key, value in sorted(spec.items())], "tbp-spec"))
    if data.jobs:
        latest = data.jobs[-1]["metrics"]
        parts.append(f"<h3>Arguments of the latest attempt ({_e(latest.get('attempt'))})</h3>")
        arguments = latest.get("arguments") or {}
        parts.append(_table([(key, _e(_short(value))) for key, value in sorted(arguments.items())], "tbp-arguments"))
        parts.append("<h3>Attempts</h3>")
        rows = []
        for line in data.jobs:
            job = line["metrics"]
            versions = job.get("versions") or {}
            rows.append([
                _e(job.get("attempt")), _e(_when(job.get("attempt_started"))), _e(job.get("world_size")),
                _e(job.get("device")), _e(job.get("host")), _e(job.get("torchrun_restart")), _e(job.get("plan")),
                _e(", ".join(f"{k} {v}" for k, v in sorted(versions.items()))),
            ])
        parts.append(_grid(["attempt", "started", "ranks", "device", "host", "torchrun restart", "plan", "versions"],
                           rows, "tbp-job-lines"))
    else:
        parts.append(_note("no arguments stored (a job of an older version, or no commit yet)"))
    if data.hparams:
        parts.append("<h3>Hyperparameters (job config)</h3>")
        parts.append(_table([(key, _e(_short(value))) for key, value in sorted(data.hparams.items())], "tbp-hparams"))
    return "".join(parts)


# ------------------------------------------------------------------------------------------- template

_STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:12px 24px}header h1{font-size:20px;margin:0 0 4px}
header .mode{font-size:13px;opacity:.85}nav{font-size:13px;margin-top:6px}nav a{color:#b3e5fc}
main{max-width:1280px;margin:0 auto;padding:8px 24px 40px}
section{background:#fff;border:1px solid #e0e0e0;border-radius:6px;margin:16px 0;padding:10px 16px}
section h2{font-size:17px;margin:4px 0 8px}section h3{font-size:14px;margin:12px 0 4px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}th,td{padding:3px 10px;text-align:left;
vertical-align:top}table.kv th{color:#555;font-weight:600;white-space:nowrap}
table.grid th{background:#eceff1}table.grid td,table.grid th{border:1px solid #e0e0e0}
.note{font-size:12px;color:#666;margin:4px 0}code{font-size:12px}
#tbp-errors{background:#ffebee;color:#b71c1c;padding:8px 24px;white-space:pre-wrap;font-family:monospace}
"""

_SCRIPT = r"""
(function () {
  "use strict";
  var errors = [];
  function note(message) {
    errors.push(String(message));
    var box = document.getElementById("tbp-errors");
    box.textContent = errors.join("\n");
    box.hidden = false;
    document.body.setAttribute("data-errors", String(errors.length));
  }
  window.addEventListener("error", function (event) { note("error: " + event.message); });
  window.addEventListener("unhandledrejection", function (event) { note("error: " + event.reason); });
  var consoleError = console.error;
  console.error = function () {  // plotly.js reports some problems only there
    note("console.error: " + Array.prototype.join.call(arguments, " "));
    consoleError.apply(console, arguments);
  };
  var config = {responsive: true, displaylogo: false};

  async function loadPlotly() {
    if (window.Plotly) { return; }
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser cannot unpack the embedded plotly.js (no DecompressionStream): " +
                      "use a browser released in 2023 or later");
    }
    var text = document.getElementById("tbp-plotly").textContent.trim();
    var raw = atob(text);
    var bytes = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) { bytes[i] = raw.charCodeAt(i); }
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    var code = await new Response(stream).text();
    var script = document.createElement("script");
    script.textContent = code;
    document.head.appendChild(script);
  }

  var template = null;

  async function draw(figures) {
    for (var key in figures) {
      var div = document.getElementById("plot-" + key);
      if (!div) { continue; }
      var figure = figures[key];
      if (!figure) {
        if (!div.hidden) { Plotly.purge(div); div.hidden = true; }
        continue;
      }
      var checked = Object.assign({}, figure.layout);
      delete checked.legend;  // Plotly.validate throws on any legend (plotly.js 3); legends are checked by eye
      (Plotly.validate(figure.data, checked) || []).forEach(function (problem) {
        note("plot " + key + ": " + problem.msg);
      });
      figure.layout.template = template;  // after validate, which does not take templates
      div.hidden = false;
      await Plotly.react(div, figure.data, figure.layout, config);
    }
  }

  async function refresh(model) {
    var response = await fetch("data.json", {cache: "no-store"});
    if (!response.ok) { throw new Error("data.json: HTTP " + response.status); }
    var fresh = await response.json();
    var figures = {};
    fresh.sections.forEach(function (section) {
      var text = document.getElementById("text-" + section.key);
      if (text) { text.innerHTML = section.html; }
      figures[section.key] = section.figure;
    });
    await draw(figures);
    document.getElementById("tbp-updated").textContent = fresh.generated_text;
    var count = Number(document.body.getAttribute("data-refreshes") || "0") + 1;
    document.body.setAttribute("data-refreshes", String(count));
  }

  async function main() {
    var model = JSON.parse(document.getElementById("tbp-model").textContent);
    template = model.template;
    await loadPlotly();
    await draw(model.figures);
    document.body.setAttribute("data-plots", "drawn");
    if (model.live) {
      var busy = false;
      setInterval(function () {
        if (busy) { return; }
        busy = true;
        refresh(model).catch(function (error) {
          document.getElementById("tbp-updated").textContent = "update failed (" + error + "), retrying";
        }).finally(function () { busy = false; });
      }, model.refresh_s * 1000);
    }
  }
  main().catch(note);
})();
"""

_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="torch_batch_process tbp report; plots by plotly.js {version}">
<title>{title}</title><style>{style}</style></head>
<body data-errors="0">
<div id="tbp-errors" hidden></div>
<header><h1>{job}</h1><div class="mode">{mode}</div><nav>{nav}</nav></header>
<main>
{body}
</main>
<script type="application/json" id="tbp-model">{model}</script>
<script type="application/octet-stream" id="tbp-plotly">{bundle}</script>
<script>{script}</script>
</body></html>
"""
