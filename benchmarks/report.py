"""Statistics, the machine's description and result files shared by the benchmark scripts.

Speed on a shared machine drifts (here by up to 30% over minutes), so contenders are compared by
ratios taken *within* a round (the contenders of a round run back to back, in a rotating order) and
the median of those per-round ratios is reported with its min-max spread.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_ROOT = REPO / "bench_results"
PACKAGES = ("torch", "lightning", "accelerate", "ray", "transformers", "sentence-transformers", "torch-batch-process")


def median_spread(values: Iterable[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) of the values that are not ``None``."""
    clean = [v for v in values if v is not None]
    if not clean:
        return None, None, None
    return statistics.median(clean), min(clean), max(clean)


def fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def fmt_spread(values: Iterable[float | None], digits: int = 0) -> str:
    """``median [min-max]`` or ``n/a``."""
    med, lo, hi = median_spread(values)
    if med is None:
        return "n/a"
    if lo == hi:
        return fmt(med, digits)
    return f"{fmt(med, digits)} [{fmt(lo, digits)}–{fmt(hi, digits)}]"


FIGURES_ENV = "TBP_BENCH_FIGURES"
"""A JSON file where a benchmark adds its figures (set by ``benchmarks.head``, which reads them back)."""


def rotated(items: list[Any], round_index: int) -> list[Any]:
    """``items`` in the order of round ``round_index``: rotated by one per round, so that no contender always runs
    first (a cold cache, a machine that just got busy) or last."""
    if not items:
        return []
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


def load_average() -> str:
    """The machine's 1-, 5- and 15-minute load averages, for the line under a table."""
    try:
        return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        return "load average unknown"


def emit_figures(figures: dict[str, Any]) -> None:
    """Adds ``figures`` (name -> value, a number or ``[median, min, max]``) to the file named by
    ``$TBP_BENCH_FIGURES``, if set: how ``benchmarks.head`` reads what a benchmark measured without parsing its
    table."""
    path = os.environ.get(FIGURES_ENV)
    if not path:
        return
    target = Path(path)
    known = json.loads(target.read_text()) if target.exists() else {}
    known.update(figures)
    target.write_text(json.dumps(known, indent=1) + "\n")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - informational only
        gpu = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "gpu": gpu,
        "os": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
        "commit": commit,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load": load_average(),
    }


def machine_line(info: dict[str, Any]) -> str:
    packages = ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v)
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ", no GPU"
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB{gpu}; Python {info['python']}; "
        f"{packages}; commit {info['commit'] or '?'}; {info['date']}; {info.get('load', 'load average unknown')}"
    )


def new_results_dir(kind: str) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RESULTS_ROOT / f"{kind}-{stamp}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
