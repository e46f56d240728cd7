"""The report's plots, as plotly figures (JSON-able dicts that plotly.js draws in the page).

Each function takes what :mod:`~torch_batch_process.observe.report.series` computed and returns a figure dict
(``{"data": [...], "layout": {...}}``, validated by ``plotly.graph_objects``) or ``None`` when the job has nothing
to show there. Every title states the plot's headline numbers (total examples, failure count, ...), so the page
says them even to a reader who does not hover. Times are local wall-clock times.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from torch_batch_process.observe.histogram import bin_bounds, quantile, total
from torch_batch_process.observe.progress import format_duration
from torch_batch_process.observe.report.series import Attempt, Interval, RankTotals, all_batch_times, slowest_ratio

__all__ = [
    "batch_times_figure",
    "commits_figure",
    "failures_figure",
    "format_seconds",
    "padding_figure",
    "progress_figure",
    "ranks_figure",
    "throughput_figure",
]

MAX_RANK_LINES = 16
"""Per-rank lines up to this many ranks; beyond, the slowest, median and fastest rank of each interval."""

MAX_RANK_BARS = 8
"""Per-rank batch-time histograms up to this many ranks; beyond, one for all ranks."""

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
_HEIGHT = 380


def _go() -> Any:
    try:
        import plotly.graph_objects as go
    except ImportError as exc:  # pragma: no cover - checked by the command first
        raise ImportError(
            "tbp report and tbp dashboard need plotly: pip install 'torch-batch-process[report]'"
        ) from exc
    return go


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


def _figure(fig: Any) -> dict[str, Any]:
    """The figure as plain JSON values (what the page embeds)."""
    fig.update_layout(template="plotly_white", uirevision="tbp")  # uirevision: the dashboard keeps zoom on updates
    return json.loads(fig.to_json())


def _layout(title: str, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        "height": _HEIGHT,
        "margin": {"l": 60, "r": 20, "t": 60, "b": 45},
        "legend": {"orientation": "h", "y": -0.18},
        **extra,
    }


def _marks(runs: list[Attempt], rows: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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


def _vline(epoch: float, color: str, dash: str) -> dict[str, Any]:
    stamp = _stamp(epoch)
    return {
        "type": "line", "xref": "x", "yref": "paper", "x0": stamp, "x1": stamp, "y0": 0, "y1": 1,
        "line": {"color": color, "dash": dash, "width": 1.5},
    }


def _note(epoch: float, text: str, color: str) -> dict[str, Any]:
    return {
        "x": _stamp(epoch), "xref": "x", "y": 1.0, "yref": "paper", "text": text, "showarrow": False,
        "xanchor": "left", "yanchor": "bottom", "font": {"size": 10, "color": color}, "textangle": 0,
    }


# ------------------------------------------------------------------------------------------ progress


def progress_figure(
    items: list[Interval], runs: list[Attempt], status: dict[str, Any]
) -> dict[str, Any] | None:
    """Examples committed over time, one line per attempt, the planned total, and the ETA while running."""
    if not items:
        return None
    go = _go()
    fig = go.Figure()
    committed, planned = int(status["examples_committed"]), int(status["examples_total"])
    by_attempt: dict[int, list[Interval]] = {}
    for item in items:
        by_attempt.setdefault(item.attempt, []).append(item)
    for index, (attempt, parts) in enumerate(by_attempt.items()):
        first = parts[0]
        x = [_stamp(first.start)] + [_stamp(part.end) for part in parts]
        y = [first.examples_committed - first.examples_total] + [part.examples_committed for part in parts]
        fig.add_trace(
            go.Scatter(
                x=x, y=y, mode="lines+markers", marker={"size": 4}, name=f"attempt {attempt} ({first.world_size} rank(s))",
                line={"color": _COLORS[index % len(_COLORS)]},
            )
        )
    last = items[-1]
    eta = status.get("eta_s")
    title = f"Progress: {committed:,} of {planned:,} examples committed ({status['percent']:.1f}%)"
    if eta is not None and status.get("state") == "running":
        title += f"; ETA {format_duration(eta)}"
        fig.add_trace(
            go.Scatter(
                x=[_stamp(last.end), _stamp(last.end + eta)], y=[last.examples_committed, planned], mode="lines",
                name="projected (current rate)", line={"dash": "dash", "color": "#7f7f7f"},
            )
        )
    shapes, notes = _marks(runs)
    shapes.append(
        {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": planned, "y1": planned,
         "line": {"color": "#7f7f7f", "dash": "dot", "width": 1}}
    )
    fig.update_layout(
        **_layout(title, shapes=shapes, annotations=notes),
        xaxis={"type": "date", "title": "time"},
        yaxis={"title": "examples committed", "rangemode": "tozero"},
    )
    return _figure(fig)


# ---------------------------------------------------------------------------------------- throughput


def throughput_figure(items: list[Interval], runs: list[Attempt]) -> dict[str, Any] | None:
    """The job's examples per second over time, and each rank's examples per second of its own work."""
    if not items:
        return None
    go = _go()
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
        subplot_titles=("job: examples committed per second",
                        "per rank: examples per second of its own work (loading + process_batch)"),
    )
    seconds = sum(item.seconds for item in items)
    examples = sum(item.examples_total for item in items)
    overall = examples / seconds if seconds > 0 else 0.0
    for index, attempt in enumerate(sorted({item.attempt for item in items})):
        parts = [item for item in items if item.attempt == attempt]
        fig.add_trace(
            go.Scatter(
                x=[_stamp(part.end) for part in parts], y=[part.rate() for part in parts], mode="lines+markers",
                marker={"size": 4}, name=f"job, attempt {attempt}", line={"color": _COLORS[index % len(_COLORS)]},
                legendgroup="job",
            ),
            row=1, col=1,
        )
    world = max(item.world_size for item in items)
    x = [_stamp(item.end) for item in items]
    if world <= MAX_RANK_LINES:
        for rank in range(world):
            fig.add_trace(
                go.Scatter(
                    x=x, y=[item.busy_rate(rank) for item in items], mode="lines", name=f"rank {rank}",
                    line={"width": 1.2, "color": _COLORS[rank % len(_COLORS)]}, connectgaps=False,
                ),
                row=2, col=1,
            )
    else:
        spreads = [sorted(r for r in (item.busy_rate(k) for k in range(item.world_size)) if r is not None) for item in items]
        for name, pick in (("slowest rank", 0), ("median rank", None), ("fastest rank", -1)):
            y = [
                (statistics.median(values) if pick is None else values[pick]) if values else None for values in spreads
            ]
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name), row=2, col=1)
    shapes, notes = _marks(runs)
    title = f"Throughput: {overall:,.1f} examples/s over {format_duration(seconds)} of running"
    if len(runs) > 1:
        title += f" ({len(runs)} attempts)"
    titles = [note.to_plotly_json() for note in fig.layout.annotations]  # the subplot titles
    fig.update_layout(**_layout(title, shapes=shapes, annotations=titles + notes))
    fig.update_layout(height=560)
    fig.update_xaxes(type="date")
    fig.update_yaxes(title_text="examples/s", rangemode="tozero")
    return _figure(fig)


# ---------------------------------------------------------------------------------------- batch times


def batch_times_figure(totals: list[RankTotals]) -> dict[str, Any] | None:
    """The distribution of ``process_batch`` seconds per batch (log-spaced bins), per rank or of all ranks."""
    everything = all_batch_times(totals)
    count = total(everything)
    if not count:
        return None
    go = _go()
    low, high = min(everything), max(everything)
    keys = list(range(low, high + 1))
    labels = [format_seconds(bin_bounds(key)[0]) for key in keys]
    fig = go.Figure()
    if 1 < len(totals) <= MAX_RANK_BARS:
        for each in totals:
            fig.add_trace(
                go.Bar(x=labels, y=[each.batch_times.get(key, 0) for key in keys], name=f"rank {each.rank}",
                       marker={"color": _COLORS[each.rank % len(_COLORS)]})
            )
    else:
        fig.add_trace(go.Bar(x=labels, y=[everything.get(key, 0) for key in keys], name="all ranks"))
    p50, p90, p99 = (quantile(everything, q) for q in (0.5, 0.9, 0.99))
    title = (
        f"Batch times (process_batch): {count:,} batches; median {format_seconds(p50)}, p90 {format_seconds(p90)}, "
        f"p99 {format_seconds(p99)}, longest < {format_seconds(bin_bounds(high)[1])}"
    )
    fig.update_layout(
        **_layout(title, barmode="stack" if len(fig.data) > 1 else "group", bargap=0.05),
        xaxis={"title": "seconds per batch (bins 19% wide; label: lower bound)", "type": "category"},
        yaxis={"title": "batches"},
    )
    return _figure(fig)


# --------------------------------------------------------------------------------------------- ranks


def ranks_figure(totals: list[RankTotals], found: dict[int, float], ratio: float) -> dict[str, Any] | None:
    """Each rank's busy rate (stragglers in red) and its batch-time quantiles."""
    worked = [each for each in totals if each.batches]
    if not worked:
        return None
    go = _go()
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2, cols=1, vertical_spacing=0.2,
        subplot_titles=("examples per second of its own work (loading + process_batch)",
                        "process_batch seconds per batch: median, p90, p99"),
    )
    names = [f"rank {each.rank}" for each in worked]
    colors = ["#d62728" if each.rank in found else "#1f77b4" for each in worked]
    fig.add_trace(
        go.Bar(x=names, y=[each.busy_rate for each in worked], marker={"color": colors}, name="busy rate",
               text=[f"{each.busy_rate:,.1f}" if each.busy_rate else "" for each in worked], textposition="auto"),
        row=1, col=1,
    )
    for q, color in ((0.5, "#1f77b4"), (0.9, "#ff7f0e"), (0.99, "#d62728")):
        fig.add_trace(
            go.Bar(x=names, y=[each.batch_quantile(q) for each in worked], name=f"p{int(q * 100)}",
                   marker={"color": color}),
            row=2, col=1,
        )
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
    fig.update_layout(**_layout(f"Ranks: {text}", barmode="group", showlegend=True))
    fig.update_layout(height=560)
    fig.update_yaxes(title_text="examples/s", row=1, col=1)
    fig.update_yaxes(title_text="seconds", type="log", row=2, col=1)
    return _figure(fig)


# ------------------------------------------------------------------------------------------- commits


def commits_figure(items: list[Interval], runs: list[Attempt], records: int) -> dict[str, Any] | None:
    """Commit latency over time (votes merged to record durable), record write seconds, and the seconds a rank
    spends in a commit."""
    timed = [item for item in items if item.commit_latency or item.votes and sum(item.votes)]
    if not timed:
        return None
    go = _go()
    x = [_stamp(item.end) for item in timed]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[quantile(item.commit_latency, 0.5) for item in timed], mode="lines+markers",
                             marker={"size": 4}, name="commit latency, median"))
    fig.add_trace(go.Scatter(x=x, y=[quantile(item.commit_latency, 1.0) for item in timed], mode="lines",
                             name="commit latency, longest (bin)", line={"dash": "dot"}))
    fig.add_trace(go.Scatter(
        x=x, y=[item.record_write_s / item.record_writes if item.record_writes else None for item in timed],
        mode="lines", name="record write (rank 0, mean)"))
    fig.add_trace(go.Scatter(x=x, y=[item.commit_s_per_vote() for item in timed], mode="lines",
                             name="time a rank spends in a commit (mean)"))
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
    fig.update_layout(
        **_layout(title, shapes=shapes, annotations=notes),
        xaxis={"type": "date", "title": "time"},
        yaxis={"type": "log", "title": "seconds"},
    )
    return _figure(fig)


# ------------------------------------------------------------------------------------------- padding


def padding_figure(tokens: dict[str, Any] | None) -> dict[str, Any] | None:
    """Real vs padded tokens of a ``bucket_by`` plan, against the same examples in dataset order."""
    if not tokens or not tokens.get("examples"):
        return None
    go = _go()
    from plotly.subplots import make_subplots

    real, padded, in_order = int(tokens["real"]), int(tokens["padded"]), int(tokens["padded_in_order"])
    saved = 1 - padded / in_order if in_order else 0.0
    fig = make_subplots(
        rows=1, cols=2, column_widths=[0.4, 0.6],
        subplot_titles=("tokens", "batches by fill (real / padded tokens)"),
    )
    fig.add_trace(
        go.Bar(x=["real", "padded, bucket_by plan", "padded, dataset order"], y=[real, padded, in_order],
               marker={"color": ["#2ca02c", "#1f77b4", "#7f7f7f"]}, text=[f"{v:,}" for v in (real, padded, in_order)],
               textposition="auto", name="tokens", showlegend=False),
        row=1, col=1,
    )
    bins = int(tokens.get("fill_bins") or len(tokens["fill"]))
    labels = [f"{100 * k / bins:.0f}-{100 * (k + 1) / bins:.0f}%" for k in range(bins)]
    fig.add_trace(go.Bar(x=labels, y=tokens["fill"], name="bucket_by plan", marker={"color": "#1f77b4"}), row=1, col=2)
    fig.add_trace(
        go.Bar(x=labels, y=tokens["fill_in_order"], name="dataset order", marker={"color": "#7f7f7f"}), row=1, col=2
    )
    title = (
        f"Padding (bucket_by): {padded:,} padded tokens for {real:,} real ({_share(real, padded)} real); "
        f"dataset order: {in_order:,} ({_share(real, in_order)} real); bucketing saves {100 * saved:.1f}%"
    )
    fig.update_layout(**_layout(title, barmode="group"))
    fig.update_yaxes(title_text="tokens", row=1, col=1)
    fig.update_yaxes(title_text="batches", row=1, col=2)
    return _figure(fig)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


# ------------------------------------------------------------------------------------------ failures


def failures_figure(failures: list[dict[str, Any]], count: int, runs: list[Attempt]) -> dict[str, Any] | None:
    """Failing examples over time (cumulative) and by phase and exception type."""
    if not count:
        return None
    go = _go()
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1, cols=2, column_widths=[0.6, 0.4],
        subplot_titles=("failing examples over time (cumulative)", "by phase and exception"),
    )
    times = sorted(float(record["time"]) for record in failures if isinstance(record.get("time"), (int, float)))
    if times:
        step = max(1, len(times) // 2000)  # at most ~2,000 points
        picked = list(range(0, len(times), step))
        if picked[-1] != len(times) - 1:
            picked.append(len(times) - 1)
        fig.add_trace(
            go.Scatter(x=[_stamp(times[i]) for i in picked], y=[i + 1 for i in picked], mode="lines+markers",
                       line={"shape": "hv"}, marker={"size": 4}, name="failing examples", showlegend=False),
            row=1, col=1,
        )
    phases: dict[str, dict[str, int]] = {}
    for record in failures:
        by_error = phases.setdefault(str(record.get("phase", "?")), {})
        error = str(record.get("error_type", "?"))
        by_error[error] = by_error.get(error, 0) + 1
    phases = dict(sorted(phases.items()))
    errors = sorted({error for by_error in phases.values() for error in by_error})
    for index, error in enumerate(errors):
        fig.add_trace(
            go.Bar(x=list(phases), y=[phases[phase].get(error, 0) for phase in phases], name=error,
                   marker={"color": _COLORS[index % len(_COLORS)]}),
            row=1, col=2,
        )
    by_phase = ", ".join(f"{phase} {sum(by_error.values())}" for phase, by_error in phases.items())
    title = f"Failing examples: {count:,}" + (f" ({by_phase})" if by_phase else "")
    fig.update_layout(**_layout(title, barmode="stack"))
    fig.update_xaxes(type="date", row=1, col=1)
    fig.update_yaxes(title_text="examples", rangemode="tozero")
    return _figure(fig)
