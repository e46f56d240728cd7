"""The report's plots, as plotly figures: plain JSON (``{"data": [...], "layout": {...}}``) that plotly.js draws.

Each function takes what :mod:`~torch_batch_process.observe.report.series` computed and returns a figure, or
``None`` when the job has nothing to show there. Figures are written as plotly's JSON schema directly, not
through ``plotly.graph_objects`` (whose validation took most of a report's build time); the page checks each
figure with ``Plotly.validate`` before drawing it and reports any problem as an error (the browser tests fail on
it). The look comes from plotly's ``plotly_white`` template (:func:`template`), embedded once in the page. Every
title states the plot's headline numbers (total examples, failure count, ...), so that the page says them even to
a reader who does not hover. Times are local wall-clock times.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

from torch_batch_process.observe.histogram import bin_bounds, quantile, total
from torch_batch_process.observe.progress import format_duration
from torch_batch_process.observe.report.series import Attempt, Interval, RankTotals, all_batch_times, slowest_ratio
from torch_batch_process.shell_commands import pip_install

__all__ = [
    "batch_times_figure",
    "commits_figure",
    "failures_figure",
    "format_seconds",
    "padding_figure",
    "progress_figure",
    "ranks_figure",
    "template",
    "throughput_figure",
]

MAX_RANK_LINES = 16
"""Per-rank lines up to this many ranks; beyond, the slowest, median and fastest rank of each interval."""

MAX_RANK_BARS = 8
"""Per-rank batch-time histograms up to this many ranks; beyond, one for all ranks."""

Figure = dict[str, Any]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
_HEIGHT = 380
_TALL = 560


@functools.lru_cache(maxsize=1)
def template() -> dict[str, Any]:
    """plotly's ``plotly_white`` template (JSON), from the installed ``plotly`` package."""
    try:
        import plotly.io
    except ImportError as exc:  # pragma: no cover - the commands check first
        raise ImportError(f"tbp report and tbp dashboard need plotly: {pip_install('report')}") from exc
    return plotly.io.templates["plotly_white"].to_plotly_json()


def _stamp(epoch: float) -> str:
    """A local wall-clock time as plotly's date axes read it."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) + f".{int((epoch % 1) * 1000):03d}"


def format_seconds(seconds: float | None) -> str:
    """A duration for a title or a table: microseconds to hours."""
    if seconds is None:
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 60:
        return f"{seconds:.3g} s"
    return format_duration(seconds)


def _layout(title: str, height: int = _HEIGHT, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        "height": height,
        "margin": {"l": 60, "r": 20, "t": 60, "b": 45},
        "legend": {"orientation": "h", "y": -0.18},
        "uirevision": "tbp",  # the dashboard's updates keep the reader's zoom
        **extra,
    }


def _axis_name(kind: str, cell: int) -> str:
    """``x``, ``x2``, ... (the name a trace uses) of the axes of subplot ``cell`` (1-based)."""
    return kind if cell == 1 else f"{kind}{cell}"


def _grid(
    rows: int, cols: int, titles: list[str], *, widths: list[float] | None = None, vspace: float = 0.14,
    hspace: float = 0.08, share_x: bool = False,
) -> dict[str, Any]:
    """The layout entries of a grid of subplots (cell ``(r, c)`` is number ``(r - 1) * cols + c``): its axes with
    their domains, and the subplots' titles as annotations."""
    widths = widths or [1.0 / cols] * cols
    usable_x = 1.0 - hspace * (cols - 1)
    x_domains, left = [], 0.0
    for share in widths:
        x_domains.append([round(left, 4), round(left + share * usable_x, 4)])
        left += share * usable_x + hspace
    height = (1.0 - vspace * (rows - 1)) / rows
    y_domains = [[round(1.0 - (r + 1) * height - r * vspace, 4), round(1.0 - r * (height + vspace), 4)] for r in range(rows)]
    layout: dict[str, Any] = {"annotations": []}
    for r in range(rows):
        for c in range(cols):
            cell = r * cols + c + 1
            x_axis: dict[str, Any] = {"domain": x_domains[c], "anchor": _axis_name("y", cell)}
            if share_x and cell > 1:
                x_axis["matches"] = "x"
            if share_x and r < rows - 1:
                x_axis["showticklabels"] = False
            layout["xaxis" if cell == 1 else f"xaxis{cell}"] = x_axis
            layout["yaxis" if cell == 1 else f"yaxis{cell}"] = {"domain": y_domains[r], "anchor": _axis_name("x", cell)}
            if cell <= len(titles):
                layout["annotations"].append({
                    "text": titles[cell - 1], "x": (x_domains[c][0] + x_domains[c][1]) / 2, "y": y_domains[r][1],
                    "xref": "paper", "yref": "paper", "xanchor": "center", "yanchor": "bottom", "showarrow": False,
                    "font": {"size": 13},
                })
    return layout


def _in(cell: int, trace: dict[str, Any]) -> dict[str, Any]:
    """``trace`` drawn in subplot ``cell``."""
    return {**trace, "xaxis": _axis_name("x", cell), "yaxis": _axis_name("y", cell)}


def _marks(runs: list[Attempt]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Vertical lines and labels at the attempts' starts (restarts, resumes) and at preemptions."""
    shapes: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    for index, run in enumerate(runs):
        if index:
            before = runs[index - 1].end
            why = "resumed after preemption" if before == "preempted" else "restarted after a stop"
            shapes.append(_vline(run.started, "#2ca02c", "dash"))
            notes.append(_note(run.started, f"attempt {run.attempt} ({run.world_size} rank(s)): {why}", "#2ca02c"))
        if run.end == "preempted":
            shapes.append(_vline(run.ended, "#d62728", "dot"))
            notes.append(_note(run.ended, f"attempt {run.attempt} preempted", "#d62728"))
    return shapes, notes


def _series(items: list[Interval], value: Any) -> tuple[list[str | None], list[Any]]:
    """``x`` (interval ends) and ``y`` (``value(item)``) of a line over the intervals of every attempt, broken
    between attempts (a point with no value there, so that no line crosses the time between them); intervals
    where ``value`` is ``None`` (e.g. a rank that ran no batch in it) are left out, the line goes on."""
    x: list[str | None] = []
    y: list[Any] = []
    for index, item in enumerate(items):
        if index and item.attempt != items[index - 1].attempt:
            x.append(_stamp(item.start))
            y.append(None)
        found = value(item)
        if found is not None:
            x.append(_stamp(item.end))
            y.append(found)
    return x, y


def _vline(epoch: float, color: str, dash: str) -> dict[str, Any]:
    stamp = _stamp(epoch)
    return {
        "type": "line", "xref": "x", "yref": "paper", "x0": stamp, "x1": stamp, "y0": 0, "y1": 1,
        "line": {"color": color, "dash": dash, "width": 1.5},
    }


def _note(epoch: float, text: str, color: str) -> dict[str, Any]:
    return {
        "x": _stamp(epoch), "xref": "x", "y": 1.0, "yref": "paper", "text": text, "showarrow": False,
        "xanchor": "left", "yanchor": "bottom", "font": {"size": 10, "color": color},
    }


# ------------------------------------------------------------------------------------------ progress


def progress_figure(items: list[Interval], runs: list[Attempt], status: dict[str, Any]) -> Figure | None:
    """Examples committed over time, one line per attempt, the planned total, and the ETA while running."""
    if not items:
        return None
    committed, planned = int(status["examples_committed"]), int(status["examples_total"])
    by_attempt: dict[int, list[Interval]] = {}
    for item in items:
        by_attempt.setdefault(item.attempt, []).append(item)
    data = []
    for index, (attempt, parts) in enumerate(by_attempt.items()):
        first = parts[0]
        data.append({
            "type": "scatter", "mode": "lines+markers", "marker": {"size": 4},
            "name": f"attempt {attempt} ({first.world_size} rank(s))", "line": {"color": _COLORS[index % len(_COLORS)]},
            "x": [_stamp(first.start)] + [_stamp(part.end) for part in parts],
            "y": [first.examples_committed - first.examples_total] + [part.examples_committed for part in parts],
        })
    last = items[-1]
    eta = status.get("eta_s")
    title = f"Progress: {committed:,} of {planned:,} examples committed ({status['percent']:.1f}%)"
    if eta is not None and status.get("state") == "running":
        title += f"; ETA {format_duration(eta)}"
        data.append({
            "type": "scatter", "mode": "lines", "name": "projected (current rate)",
            "line": {"dash": "dash", "color": "#7f7f7f"},
            "x": [_stamp(last.end), _stamp(last.end + eta)], "y": [last.examples_committed, planned],
        })
    shapes, notes = _marks(runs)
    shapes.append({
        "type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": planned, "y1": planned,
        "line": {"color": "#7f7f7f", "dash": "dot", "width": 1},
    })
    layout = _layout(title, shapes=shapes, annotations=notes)
    layout.update(xaxis={"type": "date", "title": {"text": "time"}},
                  yaxis={"title": {"text": "examples committed"}, "rangemode": "tozero"})
    return {"data": data, "layout": layout}


# ---------------------------------------------------------------------------------------- throughput


def throughput_figure(items: list[Interval], runs: list[Attempt]) -> Figure | None:
    """The job's examples per second over time, and each rank's examples per second of its own work."""
    if not items:
        return None
    layout = _grid(2, 1, ["job: examples committed per second",
                          "per rank: examples per second of its own work (loading + process_batch)"], share_x=True)
    seconds = sum(item.seconds for item in items)
    examples = sum(item.examples_total for item in items)
    overall = examples / seconds if seconds > 0 else 0.0
    data = []
    for index, attempt in enumerate(sorted({item.attempt for item in items})):
        # an attempt's last interval holds only its closing commit when its batches were all committed before
        parts = [item for item in items if item.attempt == attempt and (item.examples_total or not item.last)]
        data.append(_in(1, {
            "type": "scatter", "mode": "lines+markers", "marker": {"size": 4}, "name": f"job, attempt {attempt}",
            "line": {"color": _COLORS[index % len(_COLORS)]},
            "x": [_stamp(part.end) for part in parts], "y": [part.rate() for part in parts],
        }))
    world = max(item.world_size for item in items)
    if world <= MAX_RANK_LINES:
        for rank in range(world):
            x, y = _series(items, lambda item, rank=rank: item.busy_rate(rank))
            data.append(_in(2, {
                "type": "scatter", "mode": "lines", "name": f"rank {rank}",
                "line": {"width": 1.2, "color": _COLORS[rank % len(_COLORS)]}, "x": x, "y": y,
            }))
    else:
        for name, pick in (("slowest rank", 0), ("median rank", None), ("fastest rank", -1)):
            x, y = _series(items, lambda item, pick=pick: _spread(item, pick))
            data.append(_in(2, {"type": "scatter", "mode": "lines", "name": name, "x": x, "y": y}))
    shapes, notes = _marks(runs)
    title = f"Throughput: {overall:,.1f} examples/s over {format_duration(seconds)} of running"
    if len(runs) > 1:
        title += f" ({len(runs)} attempts)"
    full = _layout(title, height=_TALL, shapes=shapes)
    full.update(layout)
    full["annotations"] = layout["annotations"] + notes
    for name in ("xaxis", "xaxis2"):
        full[name]["type"] = "date"
    for name in ("yaxis", "yaxis2"):
        full[name].update(title={"text": "examples/s"}, rangemode="tozero")
    return {"data": data, "layout": full}


def _spread(item: Interval, pick: int | None) -> float | None:
    """The slowest (``0``), fastest (``-1``) or median (``None``) busy rate of the ranks in ``item``."""
    rates = sorted(r for r in (item.busy_rate(k) for k in range(item.world_size)) if r is not None)
    if not rates:
        return None
    return statistics.median(rates) if pick is None else rates[pick]


# ---------------------------------------------------------------------------------------- batch times


def batch_times_figure(totals: list[RankTotals]) -> Figure | None:
    """The distribution of ``process_batch`` seconds per batch (log-spaced bins), per rank or of all ranks."""
    everything = all_batch_times(totals)
    count = total(everything)
    if not count:
        return None
    low, high = min(everything), max(everything)
    keys = list(range(low, high + 1))
    labels = [format_seconds(bin_bounds(key)[0]) for key in keys]
    data = []
    if 1 < len(totals) <= MAX_RANK_BARS:
        for each in totals:
            data.append({
                "type": "bar", "name": f"rank {each.rank}", "marker": {"color": _COLORS[each.rank % len(_COLORS)]},
                "x": labels, "y": [each.batch_times.get(key, 0) for key in keys],
            })
    else:
        data.append({"type": "bar", "name": "all ranks", "x": labels, "y": [everything.get(key, 0) for key in keys]})
    p50, p90, p99 = (quantile(everything, q) for q in (0.5, 0.9, 0.99))
    title = (
        f"Batch times (process_batch): {count:,} batches; median {format_seconds(p50)}, p90 {format_seconds(p90)}, "
        f"p99 {format_seconds(p99)}, longest < {format_seconds(bin_bounds(high)[1])}"
    )
    layout = _layout(title, barmode="stack", bargap=0.05)
    layout.update(
        xaxis={"title": {"text": "seconds per batch (bins 19% wide; label: lower bound)"}, "type": "category"},
        yaxis={"title": {"text": "batches"}},
    )
    return {"data": data, "layout": layout}


# --------------------------------------------------------------------------------------------- ranks


def ranks_figure(totals: list[RankTotals], found: dict[int, float], ratio: float) -> Figure | None:
    """Each rank's busy rate (stragglers in red) and its batch-time quantiles."""
    worked = [each for each in totals if each.batches]
    if not worked:
        return None
    layout = _grid(2, 1, ["examples per second of its own work (loading + process_batch)",
                          "process_batch seconds per batch: median, p90, p99"], vspace=0.2)
    names = [f"rank {each.rank}" for each in worked]
    data = [_in(1, {
        "type": "bar", "name": "busy rate", "x": names, "y": [each.busy_rate for each in worked],
        "marker": {"color": ["#d62728" if each.rank in found else "#1f77b4" for each in worked]},
        "text": [f"{each.busy_rate:,.1f}" if each.busy_rate else "" for each in worked], "textposition": "auto",
    })]
    for q, color in ((0.5, "#1f77b4"), (0.9, "#ff7f0e"), (0.99, "#d62728")):
        data.append(_in(2, {
            "type": "bar", "name": f"p{int(q * 100)}", "marker": {"color": color},
            "x": names, "y": [each.batch_quantile(q) for each in worked],
        }))
    if found:
        text = "; ".join(f"rank {rank} is a straggler ({share:.2f}x the median of the others)" for rank, share in found.items())
    elif len(worked) < 2:
        text = f"{len(worked)} rank worked (stragglers need two or more)"
    else:
        slowest = slowest_ratio(worked)
        text = "no straggler" + (
            f" (slowest: rank {slowest[0]} at {slowest[1]:.2f}x the median of the others; threshold {ratio:g}x)"
            if slowest else ""
        )
    full = _layout(f"Ranks: {text}", height=_TALL, barmode="group")
    full.update(layout)
    full["yaxis"]["title"] = {"text": "examples/s"}
    full["yaxis2"].update(title={"text": "seconds"}, rangemode="tozero")
    return {"data": data, "layout": full}


# ------------------------------------------------------------------------------------------- commits


def commits_figure(items: list[Interval], runs: list[Attempt], records: int) -> Figure | None:
    """Commit latency over time (votes merged to record durable), record write seconds, and the seconds a rank
    spends in a commit."""
    timed = [item for item in items if item.commit_latency or sum(item.votes)]
    if not timed:
        return None
    lines = (
        ("commit latency, median", lambda item: quantile(item.commit_latency, 0.5), {"mode": "lines+markers",
                                                                                    "marker": {"size": 4}}),
        ("commit latency, longest (bin)", lambda item: quantile(item.commit_latency, 1.0), {"line": {"dash": "dot"}}),
        ("record write (rank 0, mean)",
         lambda item: item.record_write_s / item.record_writes if item.record_writes else None, {}),
        ("time a rank spends in a commit (mean)", lambda item: item.commit_s_per_vote(), {}),
    )
    data = []
    for name, value, style in lines:
        x, y = _series(timed, value)
        data.append({"type": "scatter", "mode": "lines", "name": name, "x": x, "y": y, **style})
    latency: dict[int, int] = {}
    for item in items:
        for key, count in item.commit_latency.items():
            latency[key] = latency.get(key, 0) + count
    title = f"Commits: {records:,} commit record(s)"
    if latency:
        title += (
            f"; latency (votes merged to record durable) median {format_seconds(quantile(latency, 0.5))}, "
            f"p99 {format_seconds(quantile(latency, 0.99))}"
        )
    shapes, notes = _marks(runs)
    layout = _layout(title, shapes=shapes, annotations=notes)
    layout.update(xaxis={"type": "date", "title": {"text": "time"}}, yaxis={"type": "log", "title": {"text": "seconds"}})
    return {"data": data, "layout": layout}


# ------------------------------------------------------------------------------------------- padding


def padding_figure(tokens: dict[str, Any] | None) -> Figure | None:
    """Real vs padded tokens of a ``bucket_by`` plan, against the same examples in dataset order."""
    if not tokens or not tokens.get("examples"):
        return None
    real, padded, in_order = int(tokens["real"]), int(tokens["padded"]), int(tokens["padded_in_order"])
    saved = 1 - padded / in_order if in_order else 0.0
    layout = _grid(1, 2, ["tokens", "batches by fill (real / padded tokens)"], widths=[0.4, 0.6])
    bins = int(tokens.get("fill_bins") or len(tokens["fill"]))
    labels = [f"{100 * k / bins:.0f}-{100 * (k + 1) / bins:.0f}%" for k in range(bins)]
    data = [
        _in(1, {"type": "bar", "name": "tokens", "showlegend": False,
                "x": ["real", "padded, bucket_by plan", "padded, dataset order"], "y": [real, padded, in_order],
                "marker": {"color": ["#2ca02c", "#1f77b4", "#7f7f7f"]},
                "text": [f"{v:,}" for v in (real, padded, in_order)], "textposition": "auto"}),
        _in(2, {"type": "bar", "name": "bucket_by plan", "marker": {"color": "#1f77b4"}, "x": labels,
                "y": tokens["fill"]}),
        _in(2, {"type": "bar", "name": "dataset order", "marker": {"color": "#7f7f7f"}, "x": labels,
                "y": tokens["fill_in_order"]}),
    ]
    title = (
        f"Padding (bucket_by): {padded:,} padded tokens for {real:,} real ({_share(real, padded)} real); "
        f"dataset order: {in_order:,} ({_share(real, in_order)} real); bucketing saves {100 * saved:.1f}%"
    )
    full = _layout(title, barmode="group")
    full.update(layout)
    full["yaxis"]["title"] = {"text": "tokens"}
    full["yaxis2"]["title"] = {"text": "batches"}
    return {"data": data, "layout": full}


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


# ------------------------------------------------------------------------------------------ failures


def failures_figure(failures: list[dict[str, Any]], count: int) -> Figure | None:
    """Failing examples over time (cumulative) and by phase and exception."""
    if not count:
        return None
    layout = _grid(1, 2, ["failing examples over time (cumulative)", "by phase and exception"], widths=[0.6, 0.4])
    data = []
    times = sorted(float(record["time"]) for record in failures if isinstance(record.get("time"), (int, float)))
    if times:
        step = max(1, len(times) // 2000)  # at most ~2,000 points
        picked = list(range(0, len(times), step))
        if picked[-1] != len(times) - 1:
            picked.append(len(times) - 1)
        data.append(_in(1, {
            "type": "scatter", "mode": "lines+markers", "line": {"shape": "hv"}, "marker": {"size": 4},
            "name": "failing examples", "showlegend": False,
            "x": [_stamp(times[i]) for i in picked], "y": [i + 1 for i in picked],
        }))
    phases: dict[str, dict[str, int]] = {}
    for record in failures:
        by_error = phases.setdefault(str(record.get("phase", "?")), {})
        error = str(record.get("error_type", "?"))
        by_error[error] = by_error.get(error, 0) + 1
    phases = dict(sorted(phases.items()))
    errors = sorted({error for by_error in phases.values() for error in by_error})
    for index, error in enumerate(errors):
        data.append(_in(2, {
            "type": "bar", "name": error, "marker": {"color": _COLORS[index % len(_COLORS)]},
            "x": list(phases), "y": [phases[phase].get(error, 0) for phase in phases],
        }))
    by_phase = ", ".join(f"{phase} {sum(by_error.values())}" for phase, by_error in phases.items())
    title = f"Failing examples: {count:,}" + (f" ({by_phase})" if by_phase else "")
    full = _layout(title, barmode="stack")
    full.update(layout)
    full["xaxis"]["type"] = "date"
    full["yaxis"].update(title={"text": "examples"}, rangemode="tozero")
    full["yaxis2"].update(title={"text": "examples"}, rangemode="tozero")
    return {"data": data, "layout": full}
