"""Where each rank's time goes, the library's job against the hand loop: py-spy on every process of a run.

    python -m benchmarks.profile_ranks [--workload cnn] [--nproc 2] [--contenders hand_loop,tbp] [--rounds 2]

Each contender runs as in ``benchmarks.run`` (same command, sizes and workers), under
``py-spy record --subprocesses``, twice per round (contenders interleaved): once with ``--idle`` (every thread
sampled whether it runs or waits: the wall-clock breakdown of each rank's main thread) and once without (only
samples of threads on a CPU: where the CPU goes, per process role and thread). The ranks are told apart by the
pids in their timing reports; the DataLoader workers (forked from the ranks, stacks under ``_worker_loop``) are
counted together. Printed: per contender, the main thread's time per phase of the loop (share of its samples,
summed over the ranks) and the samples on a CPU per role and thread, with the job time of each run; and, from
each rank's own accounting (``benchmarks.common.cpu_times``, not sampled), the CPU seconds of its main thread,
its other threads and its loader workers within the job clock. On a loaded machine a thread waiting for a CPU
counts as on a CPU for py-spy, so the sampled CPU overstates; the accounted CPU seconds do not. py-spy slows
what it samples (a few %), the same way for every contender.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.launch import run_contender
from benchmarks.report import new_results_dir
from benchmarks.run import sizes, workers_for

# A forked child's stacks start with its parent's "process" entry, then its own.
LINE = re.compile(r'^(?:process \d+:"[^"]*";)*process (\d+):"([^"]*)";thread \((\d+)\): ([^;]*);?(.*) (\d+)$')
RATE = 100  # samples per second


def _after(names: list[str], files: list[str], name: str, file: str) -> int | None:
    """Index of the frame right below the first frame ``name (file...)``, or ``None``."""
    at = next((k for k in range(len(names)) if names[k] == name and files[k] == file), None)
    return None if at is None else at + 1


def phase(frames: list[str]) -> str:
    """The main thread's phase from a stack (root first), named alike for the hand loop and the library."""
    names = [f.split(" (")[0].split(".")[-1] for f in frames]  # JobRun._steps -> _steps
    files = [f.split("(")[-1].split(":")[0].split("/")[-1] for f in frames]  # base names
    job = _after(names, files, "run", "hand_loop.py") or _after(names, files, "run", "tbp.py")
    if job is None:
        return "not in the job clock (interpreter, imports)"
    if "save_tensor" in names:
        return "process_batch: torch.save"
    if "process_batch" in names or "predict" in names:
        below = files[names.index("process_batch" if "process_batch" in names else "predict") :]
        return "process_batch: upload_path (library)" if "files.py" in below else "process_batch: model"
    steps = _after(names, files, "_steps", "loop.py")
    if steps is not None:
        if steps == len(frames):
            return "loop itself"
        if {"dataloader.py", "batches.py", "prefetch.py"} & set(files[steps:]):
            return "loading: next(batch)"
        if files[steps] == "runner.py":
            return f"per batch: runner ({names[-1]}, {files[-1]})"  # transaction (on_oom='split'), bookkeeping
        return f"per step: {names[steps]} ({files[steps]})"
    if "dataloader.py" in files[job:]:
        return "loading: next(batch)"
    if any(f.startswith("c10d") or f == "distributed_c10d.py" for f in files[job:]):
        return "start/end: process group (init, barrier, destroy)"
    inner = _after(names, files, "run", "loop.py")
    at = inner if inner is not None and inner < len(frames) else job
    return f"start/end: {names[at]} ({files[at]})" if at < len(frames) else "start/end: loop itself"


def parse(path: Path) -> list[tuple[int, str, str, list[str], int]]:
    """(pid, command, thread name, frames root first, samples) of a py-spy raw file."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        match = LINE.match(line)
        if match:
            pid, cmd, _tid, thread, stack, count = match.groups()
            rows.append((int(pid), cmd, thread.strip(), [f for f in stack.split(";") if f], int(count)))
    return rows


def summarize(rows: list[tuple[int, str, str, list[str], int]], rank_pids: list[int]) -> dict[str, Counter]:
    """Samples per (role, thread) and per main-thread phase (ranks together)."""
    workers = {pid for pid, _, _, frames, _ in rows if any("_worker_loop" in f for f in frames)}
    threads: Counter = Counter()
    phases: Counter = Counter()
    for pid, cmd, thread, frames, count in rows:
        if pid in rank_pids:
            role = f"rank {rank_pids.index(pid)}"
        elif pid in workers:
            role = "loader workers"
        elif "torch.distributed.run" in cmd or "py-spy" in cmd:
            role = "launcher"
        else:
            role = "other"
        threads[(role, thread if thread == "MainThread" or role != "loader workers" else "workers' threads")] += count
        if pid in rank_pids and thread == "MainThread":
            name = phase(frames)
            if not name.startswith("not in the job"):
                phases[name] += count
    return {"threads": threads, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="cnn", choices=("cnn", "minilm"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--contenders", default="hand_loop,tbp")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    beside = Path(sys.executable).with_name("py-spy")  # the venv's, when its bin is not on PATH
    pyspy = str(beside) if beside.exists() else shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy (in the bench extra)")
    out_dir = new_results_dir("profile")
    num_examples, batch_size = sizes(args.workload, False, args.scale)
    totals: dict[tuple[str, str], dict[str, Counter]] = defaultdict(lambda: {"threads": Counter(), "phases": Counter()})
    jobs: dict[str, list[float]] = defaultdict(list)
    cpus: dict[str, list[list[dict[str, float]]]] = defaultdict(list)  # per run: per rank {main, threads, children}
    contenders = args.contenders.split(",")
    for round_index in range(args.rounds):
        order = contenders[round_index % len(contenders) :] + contenders[: round_index % len(contenders)]
        for mode in ("idle", "cpu"):
            for contender in order:
                tag = f"r{round_index}-{mode}-{contender}"
                idle = "--idle " if mode == "idle" else ""
                script = (f'exec {pyspy} record --subprocesses --threads --format raw -r {RATE} {idle}'
                          f'-o {out_dir}/{tag}-rank"${{RANK:-0}}".txt -- "$@"')
                wrap = ["sh", "-c", script, "sh"]
                result = run_contender(
                    contender, args.workload, args.nproc, num_examples, batch_size,
                    workers_for(args.workload, args.nproc), work_dir=out_dir / "work" / tag,
                    log_path=out_dir / "logs" / f"{tag}.log", round_index=round_index, rank_wrap=wrap,
                )
                raws = sorted(out_dir.glob(f"{tag}-rank*.txt"))
                if not result.ok or len(raws) != args.nproc:
                    raise SystemExit(f"{tag} failed: {result.error}; see {out_dir / 'logs' / (tag + '.log')}")
                jobs[contender].append(result.job_s or 0.0)
                pids = (result.extra or {}).get("pids", [])
                cpus[contender].append((result.extra or {}).get("cpu", []))
                summary = summarize([row for raw in raws for row in parse(raw)], pids)
                for key in ("threads", "phases"):
                    totals[(contender, mode)][key].update(summary[key])
                calls = {k: (result.extra or {}).get(k) for k in ("batches", "checkpoint_starts")}
                print(f"{tag}: job {result.job_s:.2f} s; per rank: process_batch {calls['batches']}, "
                      f"on_checkpoint_start {calls['checkpoint_starts']}", flush=True)
    for contender in contenders:
        job = statistics.median(jobs[contender])
        print(f"\n### {contender}: job {job:.2f} s (median of {len(jobs[contender])} runs under py-spy)\n")
        print("| CPU seconds in the job clock (median of runs) | main thread | other threads | loader workers |")
        print("|---|---:|---:|---:|")
        for rank in range(args.nproc):
            cells = [statistics.median(run[rank][k] for run in cpus[contender]) for k in ("main", "threads", "children")]
            print(f"| rank {rank} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        print()
        phases = totals[(contender, "idle")]["phases"]
        total = sum(phases.values()) or 1
        print("| main thread of the ranks (wall, --idle) | share |\n|---|---:|")
        for name, count in phases.most_common():
            print(f"| {name} | {count / total:.1%} |")
        cpu = totals[(contender, "cpu")]["threads"]
        print(f"\n| CPU (samples on a CPU, {args.rounds} runs, s at {RATE} Hz) | s per run |\n|---|---:|")
        for (role, thread), count in sorted(cpu.items(), key=lambda kv: (kv[0][0], -kv[1])):
            print(f"| {role}: {thread} | {count / RATE / args.rounds:.2f} |")
        cpu_phases = totals[(contender, "cpu")]["phases"]
        print("\n| main thread of the ranks on a CPU, per phase | s per run |\n|---|---:|")
        for name, count in cpu_phases.most_common():
            print(f"| {name} | {count / RATE / args.rounds:.2f} |")
    print(f"\nraw profiles: {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
