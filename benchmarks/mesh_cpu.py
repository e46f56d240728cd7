"""Where the CPU of a ``mesh=`` job goes, against the hand loop: per process and per thread, over the job's window.

    python -m benchmarks.mesh_cpu                                  # TP, 1 and 2 replicas of 2, 2 rounds
    python -m benchmarks.mesh_cpu --replicas 2 --rounds 3 --base /work/main
    python -m benchmarks.mesh_cpu --contenders hand,library,library:TBP_AGREEMENT_S=1,library@/tmp/before

The contenders of ``benchmarks/mesh.py`` (``hand``: ``examples/mesh/hand_loop.py``; ``library``:
``benchmarks/contenders/tbp_mesh.py``; ``base``: that contender of the checkout ``--base``; ``library@DIR``: that of
the checkout ``DIR``), each process started
under a sampler (this file, ``--child``) that reads every thread's CPU time (``/proc/self/task/<tid>/schedstat``:
nanoseconds on a CPU, nanoseconds runnable but waiting for one, time slices) and the process's ``getrusage`` (user +
system of every thread, living or ended; voluntary and involuntary context switches) every ``--period`` seconds, then
once more when the contender's ``main()`` returned. A contender ``name:KEY=VALUE,...`` runs ``name`` with those
environment variables (a lever tried without a code change). Each contender writes its ranks' timestamps
(``--report``, the benchmarks' format): the *job window* is from the last rank's ``start`` to the last rank's ``end``,
the job clock of ``benchmarks/mesh.py``.

Printed per contender (median over rounds, per process): the job clock (examples/s), the process CPU within the job
window (user + system) and per batch of the replica, the whole process's CPU (imports and start-up too), context
switches per batch, and per thread (named by Python's ``threading`` name where it has one, else the kernel's) the CPU
over the whole process. On a shared 2-core machine the CPU clocks are steadier than the job clock: the CPU a
contender spends beyond the forward is what the others' forwards wait for at 2 replicas (4 processes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHILD = "--child"


# ---------------------------------------------------------------------------------------------- the child (sampler)


def _thread_times() -> dict[int, tuple[int, int, int]]:
    """Every thread of this process: (ns on a CPU, ns runnable but waiting, time slices)."""
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_cpu, waiting, slices = (int(v) for v in f.read().split())
        except (OSError, ValueError):
            continue
        times[int(tid)] = (on_cpu, waiting, slices)
    return times


def _comm(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _usage() -> tuple[float, int, int]:
    """This process (every thread, ended ones too): user + system seconds, voluntary and involuntary switches."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, u.ru_nvcsw, u.ru_nivcsw


class _Sampler:
    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.samples: list[dict[str, Any]] = []
        self.threads: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        times = _thread_times()
        for tid, (on_cpu, waiting, slices) in times.items():
            seen = self.threads.get(tid)
            if seen is None:
                seen = self.threads[tid] = {"name": names.get(tid) or _comm(tid), "first": on_cpu}
            elif tid in names and seen["name"] != names[tid]:
                seen["name"] = names[tid]
            seen.update(on_cpu=on_cpu, waiting=waiting, slices=slices)
        cpu, voluntary, involuntary = _usage()
        self.samples.append({"t": time.time(), "cpu": cpu, "nvcsw": voluntary, "nivcsw": involuntary})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()


def child(argv: list[str]) -> None:
    """``--child OUT_DIR PERIOD_S TARGET...``: runs TARGET (a script, or ``-m module``) as ``__main__`` under the
    sampler; writes ``OUT_DIR/rank_<RANK>.json``."""
    import runpy

    out, period_s, target = Path(argv[0]), float(argv[1]), argv[2:]
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here]  # benchmarks/ shadows no module
    sampler = _Sampler(period_s)
    sampler.start()
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path.insert(0, str(Path(target[0]).resolve().parent))
            runpy.run_path(target[0], run_name="__main__")
    finally:
        sampler.stop()
        out.mkdir(parents=True, exist_ok=True)
        rank = int(os.environ.get("RANK", "0"))
        data = {"rank": rank, "samples": sampler.samples, "threads": list(sampler.threads.values())}
        (out / f"rank_{rank}.json").write_text(json.dumps(data))


# ---------------------------------------------------------------------------------------------- the driver


def _at(samples: list[dict[str, Any]], t: float, key: str) -> float:
    """``key`` at time ``t``, linearly between the samples around it."""
    before = [s for s in samples if s["t"] <= t]
    after = [s for s in samples if s["t"] >= t]
    if not before:
        return float(samples[0][key])
    if not after:
        return float(samples[-1][key])
    a, b = before[-1], after[0]
    if b["t"] == a["t"]:
        return float(a[key])
    return a[key] + (b[key] - a[key]) * (t - a["t"]) / (b["t"] - a["t"])


def _thread_group(name: str) -> str:
    """Threads grouped by what they are (numbered duplicates folded)."""
    if name.startswith("Thread-") or name.startswith("Dummy-"):
        return "python (unnamed)"
    return name


def run_once(spec: str, replicas: int, args: argparse.Namespace, scratch: Path, log: Path) -> dict[str, Any]:
    from benchmarks.launch import run_logged
    from benchmarks.mesh import HAND, LIBRARY, SCRIPTS

    name, _, env_text = spec.partition(":")
    extra = dict(item.split("=", 1) for item in env_text.split(",") if item)
    out, report, cpu = scratch / "out", scratch / "report", scratch / "cpu"
    for folder in (out, report, cpu):
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
    nproc = 2 * replicas
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    options = ["--mode", args.mode, "--size", "2", "--examples", str(args.examples), "--batch-size",
               str(args.batch_size), "--out", str(out), "--report", str(report)]
    if name == "hand":
        target = SCRIPTS[HAND]
    elif name == "library":
        target = SCRIPTS[LIBRARY]
    elif name == "base" or name.startswith("library@"):  # another checkout's library contender
        tree = Path(args.base if name == "base" else name.partition("@")[2]).resolve()
        target = [str(tree / "benchmarks/contenders/tbp_mesh.py")]
        extra = {"PYTHONPATH": str(tree), **extra}
    else:
        raise SystemExit(f"unknown contender {spec!r}: hand, library, library@DIR, base (optionally :KEY=VALUE,...)")
    env = ["env", *(f"{k}={v}" for k, v in extra.items())] if extra else []
    command = [*env, *launcher, str(Path(__file__).resolve()), CHILD, str(cpu), str(args.period), *target, *options]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    code = run_logged(command, log, 900)
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise RuntimeError(f"{spec} failed ({'timeout' if code is None else f'exit code {code}'}); see {log}")
    reports = [json.loads(p.read_text()) for p in sorted(report.glob("rank_*.json"))]
    samples = [json.loads(p.read_text()) for p in sorted(cpu.glob("rank_*.json"))]
    if len(reports) != nproc or len(samples) != nproc:
        raise RuntimeError(f"{spec}: {len(reports)} reports, {len(samples)} CPU samples (expected {nproc})")
    start, end = max(r["start"] for r in reports), max(r["end"] for r in reports)
    batches = -(-args.examples // args.batch_size)
    per_replica_batches = batches / replicas
    processes = []
    for s in samples:
        ss = s["samples"]
        window = _at(ss, end, "cpu") - _at(ss, start, "cpu")
        switches = _at(ss, end, "nvcsw") - _at(ss, start, "nvcsw")
        threads: dict[str, float] = {}
        for t in s["threads"]:
            group = _thread_group(t["name"])
            threads[group] = threads.get(group, 0.0) + (t["on_cpu"] - t["first"]) / 1e9
        processes.append({
            "rank": s["rank"], "window_cpu_s": window, "total_cpu_s": ss[-1]["cpu"],
            "voluntary_switches": switches, "involuntary": _at(ss, end, "nivcsw") - _at(ss, start, "nivcsw"),
            "threads": threads, "thread_count": len(s["threads"]),
        })
    first = max(r["first_batch"] or end for r in reports)
    return {
        "job": args.examples / (end - start),
        "to_first_batch_s": first - start,
        "after_first_batch_s": end - first,
        "job_s": end - start,
        "wall_s": wall,
        "command_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "window_cpu_per_process_s": statistics.mean(p["window_cpu_s"] for p in processes),
        "window_cpu_per_batch_ms": 1000 * statistics.mean(p["window_cpu_s"] for p in processes) / per_replica_batches,
        "switches_per_batch": statistics.mean(p["voluntary_switches"] for p in processes) / per_replica_batches,
        "processes": processes,
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.report import fmt_spread, load_average, machine, machine_line, new_results_dir, save_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("tp", "pp"), default="tp")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--period", type=float, default=0.25, help="seconds between two samples of a process")
    parser.add_argument("--contenders", default="hand,library")
    parser.add_argument("--base", default="", help="another checkout: its library contender runs as 'base'")
    args = parser.parse_args(argv)
    contenders = args.contenders.split(",") if ":" not in args.contenders else _split_specs(args.contenders)
    if args.base and "base" not in contenders:
        contenders.append("base")
    results_dir = new_results_dir(f"mesh-cpu-{args.mode}")
    info = machine()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    loads = []
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tbp-mesh-cpu-") as scratch:
        for index in range(args.rounds):
            for replicas in args.replicas:
                order = contenders[index % len(contenders):] + contenders[: index % len(contenders)]
                for spec in order:
                    loads.append(load_average())
                    tag = f"r{index}-x{replicas}-{spec.replace(':', '_').replace('=', '-').replace(',', '_')}"
                    figures = run_once(spec, replicas, args, Path(scratch), results_dir / "logs" / f"{tag}.log")
                    runs.setdefault(str(replicas), {}).setdefault(spec, []).append(figures)
                    threads: dict[str, float] = {}
                    for p in figures["processes"]:
                        for group, seconds in p["threads"].items():
                            threads[group] = threads.get(group, 0.0) + seconds / len(figures["processes"])
                    shown = sorted(threads.items(), key=lambda kv: -kv[1])
                    print("   threads (CPU s per process):", ", ".join(f"{g} {v:.3f}" for g, v in shown if v >= 0.001))
                    print(
                        f"round {index + 1} x{replicas} {spec}: {figures['job']:.0f} ex/s job, "
                        f"{figures['window_cpu_per_batch_ms']:.1f} ms CPU per batch per process, "
                        f"{figures['switches_per_batch']:.1f} voluntary switches per batch; load {loads[-1]}",
                        flush=True,
                    )
    print()
    print(f"mesh {args.mode}, {args.examples} examples, batch {args.batch_size}, {args.rounds} rounds")
    print(machine_line(info))
    print(f"load averages at each run's start: first {loads[0]}, last {loads[-1]}")
    print("| replicas | contender | job (ex/s) | ratio | to the first batch (s) | after it (s) "
          "| CPU/process in job window (s) | CPU/batch/process (ms) | whole process CPU (s) | command CPU (s) "
          "| voluntary switches/batch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for replicas, per in runs.items():
        hand = per.get(contenders[0])
        for spec in contenders:
            figures = per[spec]
            ratios = [f["job"] / h["job"] for f, h in zip(figures, hand, strict=True)] if hand else []
            print(
                f"| {replicas} | {spec} | {fmt_spread([f['job'] for f in figures])} | {fmt_spread(ratios, 3)} | "
                f"{fmt_spread([f['to_first_batch_s'] for f in figures], 2)} | "
                f"{fmt_spread([f['after_first_batch_s'] for f in figures], 2)} | "
                f"{fmt_spread([f['window_cpu_per_process_s'] for f in figures], 2)} | "
                f"{fmt_spread([f['window_cpu_per_batch_ms'] for f in figures], 1)} | "
                f"{fmt_spread([statistics.mean(p['total_cpu_s'] for p in f['processes']) for f in figures], 2)} | "
                f"{fmt_spread([f['command_cpu_s'] for f in figures], 2)} | "
                f"{fmt_spread([f['switches_per_batch'] for f in figures], 1)} |"
            )
    print()
    print("Per thread, CPU seconds per process over the whole process (median over rounds of the mean over ranks):")
    for replicas, per in runs.items():
        for spec in contenders:
            groups: dict[str, list[float]] = {}
            for f in per[spec]:
                totals: dict[str, float] = {}
                for p in f["processes"]:
                    for group, seconds in p["threads"].items():
                        totals[group] = totals.get(group, 0.0) + seconds / len(f["processes"])
                for group, seconds in totals.items():
                    groups.setdefault(group, []).append(seconds)
            shown = sorted(groups.items(), key=lambda kv: -statistics.median(kv[1]))
            text = ", ".join(f"{g} {statistics.median(v):.3f}" for g, v in shown if statistics.median(v) >= 0.001)
            print(f"  x{replicas} {spec}: {text}")
    save_json(results_dir / "results.json", {"machine": info, "args": vars(args), "runs": runs, "loads": loads})
    print(f"\nresults: {results_dir}")
    return 0


def _split_specs(text: str) -> list[str]:
    """``hand,library:A=1,B=2,base``: a comma starts a new contender unless it is followed by ``KEY=``."""
    specs: list[str] = []
    for item in text.split(","):
        if specs and "=" in item and ":" in specs[-1] and not item.startswith(("hand", "library", "base")):
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2:])
    else:
        raise SystemExit(main())
