"""The scale simulation (DESIGN §14): the library's own costs at W = 1..32 ranks and N = 10^6..10^8 examples.

    python -m benchmarks.scale                 # the full grid: ~25 min on 2 cores
    python -m benchmarks.scale --quick         # W = 1, 2, 8; N = 10^6, 10^8; fewer batches: ~8 min
    python -m benchmarks.scale --render bench_results/scale-<time>/results.json

Many ranks with trivial work on one machine, so that only the library's own costs show: W ranks are processes
forked from one parent after the imports (:mod:`benchmarks.scale_ranks`), joined in one gloo process group. The
dataset is range-like (example ``i`` is the integer ``i``, nothing held per example), batches of ``--batch-size``
examples, and every batch writes its values as record outputs (``context.write``), on local storage (a temporary
folder) and on S3 (a moto server on 127.0.0.1, started here, serving one request at a time:
:mod:`benchmarks.moto_serial`), with both schedules.

A full run at N = 10^8 with trivial batches would take hours, so each cell is bounded: per cell,

- **a measured run**: a fresh job over all N examples (its plan and dealing cover N) that stops (a preemption)
  once its first T batches are taken (``--batches``; at least 50 per rank); the per-batch figures are taken on
  each rank from its first batch of id T/5 or more to its last;
- **a resume at 90%**: the same job stored after 90% of its batches were committed (made once per N and storage
  by one rank that writes no outputs, so it is quick; the record then covers 90% of N), copied, resumed with W
  ranks, each stopping after 3 batches. *Resume at 90%, s*: from the call to the first batch of the last rank to
  get one (with ``dynamic`` a rank may see the others' stop before its first batch).

Columns: *CPU us/batch*: user + system CPU of every rank's process (all threads: the loop, the library's
background threads, gloo's, the rendezvous store's server in rank 0's process) over the measured batches, summed
over ranks, per batch: not wall time, since 32 ranks share 2 cores. *Commit, ms*: the wall time from
``on_checkpoint_start()`` to the next ``process_batch()`` on each rank (the commit on the loop's path, plus
loading the next tiny batch), p50 / p99 over every commit of every rank; on an oversubscribed machine it holds
the time a rank waits for a core. *Commit CPU*: the main thread's CPU over the same span, p50 over every rank (and
rank 0's own). *Rank 0*: rank 0's share of the CPU. *RSS*: peak resident memory during the call (``VmHWM``), rank
0 (its growth during the call: the first call of a process grows by ~75 MiB, later ones by what they hold) / the
largest of any rank; it counts the torch pages the forked ranks share. *Record*: bytes of the latest commit record
after the resume at 90%. *Files*: files under ``outputs/`` after the measured run. *read_outputs*: seconds for
``read_outputs`` of the measured run's rows (a reader process, imports excluded); on S3 only at the largest W and
the smallest N (moto answers ~0.1 s per file, the same files whatever N and W). *Load*: the machine's 1-minute
load average when the cells of that W started (other engineers' jobs share it).

Two more tables: the control, W processes each running a one-rank job of the same work side by side (what W
processes cost this 2-core machine when the library coordinates nothing: caches and context switches shared by
more processes), and the waiting ranks: the last rank sleeps 6 s in a batch and the others' CPU while they
wait for it is given in ms per second (no busy polling means a few ms per second: heartbeats, timers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.launch import run_logged
from benchmarks.report import machine, machine_line, new_results_dir, rotated, save_json

FULL = {"worlds": [1, 2, 4, 8, 16, 32], "sizes": [10**6, 10**7, 10**8], "batches": 1600}
QUICK = {"worlds": [1, 2, 8], "sizes": [10**6, 10**8], "batches": 800}
RESUME_BATCHES = 3
"""Batches each rank runs in a resume at 90% (the figure is the start-up, not the batches)."""
WAIT_S = 6.0
"""Seconds the last rank sleeps in a batch of the waiting cells."""
PREFIX_INTERVAL = 20000
"""``checkpoint_interval`` of the one-rank run that commits the first 90% (few commits: it is only a setup)."""


def _size_name(n: int) -> str:
    exponent = round(math.log10(n))
    return f"1e{exponent}" if 10**exponent == n else str(n)


def _load() -> float:
    return os.getloadavg()[0]


class Storages:
    """Where the cells' jobs live: a local scratch folder, and a bucket of a moto server (started on demand)."""

    def __init__(self, scratch: Path, kinds: list[str]) -> None:
        self.scratch = scratch
        self.server: Any = None
        self.bucket = ""
        if "s3" in kinds:
            from benchmarks.moto_serial import serial_moto_server

            self.server = serial_moto_server()  # moto, one request at a time (its own races answer HTTP 500)
            os.environ.update(self.server.env())  # the ranks and the reader inherit it
            self.bucket = self.server.new_bucket()

    def url(self, kind: str, name: str) -> str:
        return f"s3://{self.bucket}/{name}" if kind == "s3" else str(self.scratch / name)

    @staticmethod
    def fs(url: str) -> tuple[Any, str]:
        import fsspec

        return fsspec.core.url_to_fs(url)

    def copy(self, source: str, target: str) -> None:
        fs, src = self.fs(source)
        _, dst = self.fs(target)
        if fs.exists(dst):
            fs.rm(dst, recursive=True)
        if source.startswith("s3://"):
            for path in fs.find(src):
                fs.copy(path, dst + path[len(src) :])
        else:
            shutil.copytree(src, dst)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def _cell(name: str, storage: str, n: int, batch_size: int, schedule: str, per_rank: int, *, write: bool = True,
          interval: int = 5, warmup: int = 0, batches: int | None = None) -> dict[str, Any]:
    """A cell: each rank stops after ``per_rank`` batches of its own, or (``batches``) once the job's first
    ``batches`` batch ids are taken; its figures start at its ``warmup``-th batch (or at batch id ``warmup``)."""
    return {
        "name": name, "storage": storage, "n": n, "batch_size": batch_size, "schedule": schedule,
        "batches_per_rank": per_rank, "write": write, "interval": interval, "warmup": warmup, "batches": batches,
    }


def _run_ranks(
    world: int, cells: list[dict[str, Any]], out: Path, logs: Path, tag: str, *, independent: bool = False
) -> bool:
    cells_file = logs / f"cells-{tag}.json"
    cells_file.parent.mkdir(parents=True, exist_ok=True)
    cells_file.write_text(json.dumps(cells))
    command = [sys.executable, "-m", "benchmarks.scale_ranks", "--world", str(world), "--cells", str(cells_file),
               "--out", str(out), *(["--independent"] if independent else [])]
    code = run_logged(command, logs / f"ranks-{tag}.log", timeout_s=1800)
    return code == 0


def _reports(out: Path, name: str) -> list[dict[str, Any]]:
    return sorted((json.loads(p.read_text()) for p in (out / name).glob("rank_*.json")), key=lambda r: r["rank"])


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _stored(storages: Storages, url: str) -> dict[str, Any]:
    """Bytes of the latest commit record and the files under ``outputs/`` of the job at ``url``."""
    fs, root = storages.fs(url)
    records = sorted(p for p in fs.ls(f"{root}/_tbp/commits", detail=False) if p.endswith(".json"))
    record_bytes = fs.size(records[-1]) if records else None
    try:
        files = len(fs.find(f"{root}/outputs"))
    except FileNotFoundError:
        files = 0
    return {"record_bytes": record_bytes, "files": files}


def _read_outputs_s(url: str) -> tuple[float, int]:
    from torch_batch_process import read_outputs

    started = time.perf_counter()
    table = read_outputs(url)
    return time.perf_counter() - started, table.num_rows


def _summarize(measured: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> dict[str, Any]:
    cpu = sum(r["cpu_s"] for r in measured)
    batches = sum(r["batches"] for r in measured)
    walls = [x for r in measured for x in r["commit_wall_ms"]]
    cpus = [x for r in measured for x in r["commit_cpu_ms"]]
    firsts = [r["first_batch_s"] for r in resumed if r.get("first_batch_s") is not None]
    return {
        "batches": batches,
        "per_rank": max(r["batches_total"] for r in measured),
        "cpu_us_per_batch": cpu / batches * 1e6 if batches else None,
        "commit_p50_ms": _percentile(walls, 0.5),
        "commit_p99_ms": _percentile(walls, 0.99),
        "commit_cpu_p50_ms": _percentile(cpus, 0.5),
        "commit_cpu0_p50_ms": _percentile(measured[0]["commit_cpu_ms"], 0.5),
        "commits": len(walls),
        "rank0_share": measured[0]["cpu_s"] / cpu if cpu else None,
        "rss0_mib": measured[0]["peak_rss_mib"],
        "rss0_growth_mib": measured[0]["peak_rss_mib"] - measured[0]["start_rss_mib"],
        "rss_max_mib": max(r["peak_rss_mib"] for r in measured),
        "resume_s": max(firsts) if firsts else None,  # a dynamic rank may see the others' stop before a batch
        "resume_rss0_mib": resumed[0]["peak_rss_mib"] if resumed else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    worlds, sizes, kinds, schedules = args.worlds, args.sizes, args.storages, args.schedules
    out_dir = new_results_dir("scale")
    logs = out_dir / "logs"
    results: dict[str, Any] = {
        "machine": machine(), "args": vars(args) | {"render": None}, "cells": [], "loads": {}, "waits": [],
        "alone": {},
    }
    base = os.environ.get("TBP_SCALE_SCRATCH") or None
    with tempfile.TemporaryDirectory(prefix="tbp-scale-", dir=base) as scratch_name:
        scratch = Path(scratch_name)
        storages = Storages(scratch / "jobs", kinds)
        reports = scratch / "reports"
        try:
            # 1. The first 90% of each job, committed once per N and storage by one rank writing nothing.
            prefixes = {}
            cells = []
            for kind in kinds:
                for n in sizes:
                    name = f"prefix-{kind}-{_size_name(n)}"
                    prefixes[kind, n] = storages.url(kind, name)
                    planned = math.ceil(n / args.batch_size)
                    cells.append(_cell(name, prefixes[kind, n], n, args.batch_size, "static", int(planned * 0.9),
                                       write=False, interval=PREFIX_INTERVAL))
            started = time.perf_counter()
            print(f"committing 90% of each job once ({len(cells)} jobs, 1 rank each, 2 at a time)...", flush=True)
            halves = [cells[0::2], cells[1::2]]
            with ThreadPoolExecutor(2) as pool:  # one core each
                done = list(pool.map(lambda i: _run_ranks(1, halves[i], reports, logs, f"prefix{i}"), range(2)))
            if not all(done):
                raise RuntimeError(f"making the 90% states failed: see {logs}/ranks-prefix*.log")
            results["prefix_s"] = time.perf_counter() - started
            _read_outputs_s(prefixes[kinds[0], sizes[0]])  # the reader's first call imports and warms up
            # 2. Per world size, one pool of ranks runs every cell of that size (a measured run, a resume at 90%).
            for world in worlds:
                per_rank = max(50, args.batches // world)
                total = per_rank * world
                cells, keys = [], []
                groups = 0  # the schedules' order rotates from (storage, N) to the next: the pool's first cell
                for kind in kinds:  # (in cold processes) is not always a static one (issue 45)
                    for n in sizes:
                        groups += 1
                        for schedule in rotated(list(schedules), groups + world):
                            if world == 1 and schedule == "dynamic":
                                continue  # one process: both schedules are the same loop
                            name = f"w{world}-{kind}-{_size_name(n)}-{schedule}"
                            cells.append(_cell(f"{name}-run", storages.url(kind, f"{name}-run"), n, args.batch_size,
                                               schedule, per_rank, warmup=total // 5, batches=total))
                            storages.copy(prefixes[kind, n], storages.url(kind, f"{name}-resume"))
                            cells.append(_cell(f"{name}-resume", storages.url(kind, f"{name}-resume"), n,
                                               args.batch_size, schedule, RESUME_BATCHES))
                            keys.append((name, kind, n, schedule))
                if world > 1:  # the last rank sleeps WAIT_S in its 1st batch: the others' CPU while they wait for it
                    for schedule in schedules:
                        name = f"w{world}-wait-{schedule}"
                        cells.append(_cell(name, storages.url("local", name), sizes[0], args.batch_size, schedule,
                                           4) | {"sleep_rank": world - 1, "sleep_at": 1, "sleep_s": WAIT_S})
                load = _load()
                results["loads"][str(world)] = load
                alone = f"w{world}-alone"  # the control: W one-rank jobs side by side (the machine's own cost of W)
                _run_ranks(world, [_cell(alone, storages.url("local", alone), sizes[0], args.batch_size, "static",
                                         per_rank, warmup=per_rank // 5)], reports, logs, alone, independent=True)
                solo = _reports(reports, alone)
                solo_batches = sum(r["batches"] for r in solo)
                results["alone"][str(world)] = (
                    sum(r["cpu_s"] for r in solo) / solo_batches * 1e6 if len(solo) == world and solo_batches else None
                )
                print(f"W={world}: {len(keys)} cells, {per_rank} batches per rank, load {load:.1f}...", flush=True)
                started = time.perf_counter()
                ok = _run_ranks(world, cells, reports, logs, f"w{world}")
                print(f"  {time.perf_counter() - started:.0f} s{'' if ok else ' (FAILED: see the log)'}", flush=True)
                for name, kind, n, schedule in keys:
                    row: dict[str, Any] = {"world": world, "storage": kind, "n": n, "schedule": schedule, "load": load}
                    measured, resumed = _reports(reports, f"{name}-run"), _reports(reports, f"{name}-resume")
                    if len(measured) != world or len(resumed) != world:
                        row["failed"] = True
                        results["cells"].append(row)
                        continue
                    row.update(_summarize(measured, resumed))
                    row["files"] = _stored(storages, storages.url(kind, f"{name}-run"))["files"]
                    row["record_bytes"] = _stored(storages, storages.url(kind, f"{name}-resume"))["record_bytes"]
                    row["read_s"], row["rows"] = None, None
                    if kind == "local" or (world == max(worlds) and n == sizes[0]):  # moto: ~0.1 s per file read
                        row["read_s"], row["rows"] = _read_outputs_s(storages.url(kind, f"{name}-run"))
                    results["cells"].append(row)
                    shutil.rmtree(reports / f"{name}-run", ignore_errors=True)
                if world > 1:
                    for schedule in schedules:
                        waited = _reports(reports, f"w{world}-wait-{schedule}")
                        fast = [r for r in waited[:-1] if r.get("after_first_s")]
                        results["waits"].append({
                            "world": world, "schedule": schedule, "load": load,
                            "failed": len(waited) != world or not fast,
                            "cpu_ms_per_s": (
                                statistics.fmean(r["after_first_cpu_s"] / r["after_first_s"] for r in fast) * 1000
                                if fast else None
                            ),
                            "wait_s": statistics.fmean(r["after_first_s"] for r in fast) if fast else None,
                        })
                save_json(out_dir / "results.json", results)
        finally:
            storages.close()
    results["plans"] = plan_rows(args.plan_sizes, logs) if args.plan_sizes else []
    save_json(out_dir / "results.json", results)
    (out_dir / "table.md").write_text(render(results))
    print(f"results: {out_dir}")
    return results


# ----------------------------------------------------------------------------------------------- plans


def plan_rows(sizes: list[int], logs: Path) -> list[dict[str, Any]]:
    """Time and peak memory of the plan of ``bucket_by`` over N lengths, per input kind, each in a fresh process."""
    rows = []
    for n in sizes:
        for source, max_tokens in (("numpy-int32", None), ("numpy-int32", 4096), ("arrow", None), ("arrow-chunked", None)):
            tag = f"{source}-{n}" + (f"-{max_tokens}" if max_tokens else "")
            report = logs / f"plan-{tag}.json"
            command = [sys.executable, "-m", "benchmarks.scale_plan", "--n", str(n), "--source", source,
                       "--report", str(report), *(["--max-tokens", str(max_tokens)] if max_tokens else [])]
            code = run_logged(command, logs / f"plan-{tag}.log", timeout_s=900)
            row: dict[str, Any] = {"n": n, "source": source + (f", max_tokens={max_tokens}" if max_tokens else "")}
            if code == 0 and report.exists():
                row.update(json.loads(report.read_text()))
            else:
                row["failed"] = True
            rows.append(row)
            print(f"plan {row['source']} {_size_name(n)}: {row}", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- table


def _f(value: Any, digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}{suffix}"


def render(results: dict[str, Any]) -> str:
    lines = [
        "| Storage | Schedule | N | W | Batches measured (most by a rank) | CPU us/batch | × W=2 | Commit p50 / p99, ms "
        "| Commit CPU p50, ms (rank 0) "
        "| Rank 0 CPU | RSS rank 0 (+call) / max, MiB | Record, B | Files | Resume at 90%, s | read_outputs, s (rows) "
        "| Load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = results["cells"]
    by_key = {(c["storage"], c["schedule"], c["n"], c["world"]): c for c in cells}
    for c in sorted(cells, key=lambda c: (c["storage"], c["schedule"], c["n"], c["world"])):
        head = f"| {c['storage']} | {c['schedule']} | {_size_name(c['n'])} | {c['world']} "
        if c.get("failed"):
            lines.append(head + "| failed |" + " |" * 11)
            continue
        rows = f" ({c['rows']:,})" if c.get("rows") is not None else ""
        w2 = by_key.get((c["storage"], c["schedule"], c["n"], 2))
        ratio = c["cpu_us_per_batch"] / w2["cpu_us_per_batch"] if w2 and not w2.get("failed") else None
        lines.append(
            head + f"| {c['batches']:,} ({c['per_rank']}) | {_f(c['cpu_us_per_batch'])} | {_f(ratio, 2)} "
            f"| {_f(c['commit_p50_ms'], 1)} / {_f(c['commit_p99_ms'], 1)} | {_f(c['commit_cpu_p50_ms'], 2)} "
            f"({_f(c.get('commit_cpu0_p50_ms'), 2)}) "
            f"| {_f(c['rank0_share'] * 100 if c['rank0_share'] is not None else None, 1, '%')} "
            f"| {_f(c['rss0_mib'])} (+{_f(c.get('rss0_growth_mib'))}) / {_f(c['rss_max_mib'])} "
            f"| {_f(c['record_bytes'])} | {_f(c['files'])} | {_f(c['resume_s'], 2)} "
            f"| {_f(c['read_s'], 2)}{rows} | {c['load']:.1f} |"
        )
    alone = results.get("alone") or {}
    if alone:
        base = alone.get("2")
        lines += ["", "| W | Control: W one-rank jobs side by side, CPU us/batch | × W=2 | Load |", "|---:|---:|---:|---:|"]
        for world, cost in sorted(alone.items(), key=lambda item: int(item[0])):
            ratio = cost / base if cost is not None and base else None
            lines.append(f"| {world} | {_f(cost)} | {_f(ratio, 2)} | {results['loads'].get(world, 0):.1f} |")
    waits = results.get("waits") or []
    if waits:
        lines += ["", "| Schedule | W | Waiting ranks' CPU, ms per s (mean of W-1 ranks) | Their wait, s | Load |",
                  "|---|---:|---:|---:|---:|"]
        for w in sorted(waits, key=lambda w: (w["schedule"], w["world"])):
            lines.append(f"| {w['schedule']} | {w['world']} | {_f(w['cpu_ms_per_s'], 1) if not w['failed'] else 'failed'} "
                         f"| {_f(w['wait_s'], 1)} | {w['load']:.1f} |")
    plans = results.get("plans") or []
    if plans:
        lines += ["", "| bucket_by (batches of 32, default window) | N | Plan, s | Peak memory over the lengths, MiB "
                  "| Bytes per example | Batches |", "|---|---:|---:|---:|---:|---:|"]
        for p in plans:
            if p.get("failed"):
                lines.append(f"| {p['source']} | {_size_name(p['n'])} | failed | | | |")
                continue
            lines.append(
                f"| {p['source']} | {_size_name(p['n'])} | {p['plan_s']:.1f} | {p['peak_mib']:,.0f} "
                f"| {p['peak_mib'] * 2**20 / p['n']:.1f} | {p['batches']:,} |"
            )
    info = results["machine"]
    lines += ["", f"Machine: {machine_line(info)}. 90% states made in {results.get('prefix_s', 0):.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="W = 1, 2, 8; N = 1e6, 1e8; 800 batches per cell")
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--sizes", type=lambda s: [int(float(x)) for x in s.split(",")], default=None)
    parser.add_argument("--schedules", type=lambda s: s.split(","), default=["static", "dynamic"])
    parser.add_argument("--storages", type=lambda s: s.split(","), default=["local", "s3"])
    parser.add_argument("--batches", type=int, default=None, help="batches of a measured run, over all ranks")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--plan-sizes", type=lambda s: [int(float(x)) for x in s.split(",") if x], default=None,
                        help="N of the bucket_by plans measured (default 1e8; 1e7 with --quick; '' for none)")
    parser.add_argument("--render", type=Path, default=None, help="print the table of a saved results.json")
    args = parser.parse_args(argv)
    if args.render is not None:
        print(render(json.loads(args.render.read_text())), end="")
        return 0
    preset = QUICK if args.quick else FULL
    args.worlds = args.worlds or preset["worlds"]
    args.sizes = args.sizes or preset["sizes"]
    args.batches = args.batches or preset["batches"]
    if args.plan_sizes is None:
        args.plan_sizes = [10**7] if args.quick else [10**8]
    results = run(args)
    print(render(results), end="")
    failed = [c for c in results["cells"] if c.get("failed")] + [p for p in results["plans"] if p.get("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
