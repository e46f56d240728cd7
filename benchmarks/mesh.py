"""One model over several ranks (DESIGN §18): the hand-written mesh loop against the library's ``mesh=`` job.

    python -m benchmarks.mesh                          # tensor parallel, 1 and 2 replicas of 2 ranks, 3 rounds
    python -m benchmarks.mesh --mode pp                # 2 pipeline stages, 4 microbatches
    python -m benchmarks.mesh --replicas 2 --rounds 1  # one configuration, one round
    python -m benchmarks.mesh --base /tmp/before       # also another checkout's library job, in the same rounds

Both contenders run the encoder of ``examples/mesh`` (4 blocks, dim 128, 32 tokens per example) split the same way
over the same batches, the replica's writer saving each batch's embeddings with ``torch.save``:

- ``hand loop``: ``examples/mesh/hand_loop.py``, what a user writes with torch alone (``init_device_mesh``, batches
  dealt to replicas, every member loading its replica's batches, no checkpoint, no resume);
- ``torch_batch_process``: ``benchmarks/contenders/tbp_mesh.py``, ``mesh={"replica": -1, <mode>: 2}``, files through
  ``upload_path()`` committed every 5 steps, each batch loaded by the replica's first member and sent to the
  other (the hand loop has every member load it).

With ``--base DIR`` a third contender, ``torch_batch_process (base)``, runs this checkout's library contender over
another checkout's library (``DIR`` first on the path): a before/after of a change to the library measured in the same
rounds, on the same load, with the same user code.

Each run is a fresh torchrun with ``2 x replicas`` processes, the contenders in rotated order per round. Clocks: *job*
is from the moment the last process is ready (its imports done) to the moment the last one is done (examples per
second over that); *end to end* is the whole command's wall time. Ratios are the library's over the hand loop's,
per round, shown as median [min-max]. The job clock is split into its phases (from each rank's timestamps, the last
rank's): the call to its first batch (process groups, the library's join and mesh, the model, the first batch), the
steady steps (wall, and the main thread's CPU per step), the last batch to the return (the library's closing
commits and teardown; the hand loop's clock stops before ``destroy_process_group``, as the library's stops after its
own teardown but before the default group's, destroyed at exit).
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.launch import REPO, run_logged
from benchmarks.report import fmt_spread, machine, machine_line, new_results_dir, save_json

GOAL = 0.95
HAND = "hand loop"
LIBRARY = "torch_batch_process"
BASE = "torch_batch_process (base)"
SCRIPTS = {HAND: ["examples/mesh/hand_loop.py"], LIBRARY: ["-m", "benchmarks.contenders.tbp_mesh"]}
RUN_TIMEOUT_S = 900


def library_has_mesh() -> bool:
    """Whether ``torch_batch_process`` takes ``mesh=`` (the library's contender runs only then)."""
    from torch_batch_process import torch_batch_process

    return "mesh" in inspect.signature(torch_batch_process).parameters


def run_once(contender: str, replicas: int, args: argparse.Namespace, scratch: Path, log: Path) -> dict[str, Any]:
    """One torchrun of ``contender``; its job and end-to-end throughputs (examples per second)."""
    out, report = scratch / "out", scratch / "report"
    for folder in (out, report):
        shutil.rmtree(folder, ignore_errors=True)
    nproc = 2 * replicas
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    options = [
        "--mode",
        args.mode,
        "--size",
        "2",
        "--examples",
        str(args.examples),
        "--batch-size",
        str(args.batch_size),
        "--out",
        str(out),
        "--report",
        str(report),
    ]
    # the base: this checkout's contender (the same user code) over the other checkout's library, first on the path (a
    # script: no cwd on sys.path)
    script = SCRIPTS[contender] if contender != BASE else [str(REPO / "benchmarks/contenders/tbp_mesh.py")]
    if contender == BASE:
        launcher = ["env", f"PYTHONPATH={Path(args.base).resolve()}", *launcher]
    started = time.time()
    code = run_logged([*launcher, *script, *options], log, RUN_TIMEOUT_S)
    wall = time.time() - started
    if code != 0:
        raise RuntimeError(f"{contender} failed ({'timeout' if code is None else f'exit code {code}'}); see {log}")
    reports = [json.loads(p.read_text()) for p in sorted(report.glob("rank_*.json"))]
    files = len(list(out.rglob("batch_*.pt")))
    batches = -(-args.examples // args.batch_size)
    if len(reports) != nproc or files != batches:
        raise RuntimeError(f"{contender}: {len(reports)} reports, {files} batch files (expected {nproc}, {batches})")
    start, end = max(r["start"] for r in reports), max(r["end"] for r in reports)
    figures = {"job": args.examples / (end - start), "end_to_end": args.examples / wall}
    if all(r.get("last_batch") for r in reports):  # the phases of the job clock (an older checkout's contender: none)
        first, last = max(r["first_batch"] for r in reports), max(r["last_batch"] for r in reports)
        batches = max(sum(r["batches"] for r in reports) // replicas - 1, 1)  # per replica, after the first
        figures["phases"] = {
            "to_first_batch_s": first - start,  # the call to its first batch: join, groups, mesh, model, 1st batch
            "step_ms": 1000 * (last - first) / batches,  # the steady steps (wall)
            "step_cpu_ms": 1000 * statistics.median(r["steady_cpu"] for r in reports) / batches,  # main thread
            "after_last_batch_s": end - last,  # the last batch to the call's return: closing commits, teardown
        }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("tp", "pp"), default="tp")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", default="", help="another checkout (e.g. before a change): its library job runs "
                        f"as the contender '{BASE}' in the same rounds")
    args = parser.parse_args(argv)
    contenders = [HAND, LIBRARY] if library_has_mesh() else [HAND]
    if args.base:
        contenders.append(BASE)
    results_dir = new_results_dir(f"mesh-{args.mode}")
    info = machine()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="tbp-mesh-") as scratch:
        for index in range(args.rounds):
            for replicas in args.replicas:
                order = contenders[index % len(contenders) :] + contenders[: index % len(contenders)]
                for contender in order:
                    tag = f"r{index}-x{replicas}-{contender.replace(' ', '_')}"
                    figures = run_once(contender, replicas, args, Path(scratch), results_dir / "logs" / f"{tag}.log")
                    runs.setdefault(f"{replicas}", {}).setdefault(contender, []).append(figures)
                    print(
                        f"round {index + 1} {replicas} replica(s) {contender}: {figures['job']:.0f} ex/s job",
                        flush=True,
                    )
    print()
    print(
        f"mesh {args.mode} x 2 ranks per replica; {args.examples} examples, batch {args.batch_size}, "
        f"{args.rounds} rounds"
    )
    print(machine_line(info))
    print(f"| replicas | contender | job (ex/s) | end to end (ex/s) | job ratio vs hand (goal >= {GOAL}) |")
    print("|---|---|---|---|---|")
    for replicas, per in runs.items():
        for contender in (HAND, LIBRARY, BASE):
            figures = per.get(contender)
            if figures is None and contender == BASE:
                continue
            if figures is None:
                print(f"| {replicas} | {contender} | n/a (no mesh= yet) | n/a | n/a |")
                continue
            ratios = [f["job"] / h["job"] for f, h in zip(figures, per[HAND], strict=True)]
            print(
                f"| {replicas} | {contender} | {fmt_spread([f['job'] for f in figures])} | "
                f"{fmt_spread([f['end_to_end'] for f in figures])} | "
                f"{'1' if contender == HAND else fmt_spread(ratios, 3)} |"
            )
    print()
    print("| replicas | contender | to the first batch (s) | step (ms) | step, main thread CPU (ms) | after the last "
          "batch (s) |")
    print("|---|---|---|---|---|---|")
    for replicas, per in runs.items():
        for contender, figures in per.items():
            phases = [f["phases"] for f in figures if "phases" in f]
            if phases:
                cells = [fmt_spread([p[key] for p in phases], 3) for key in
                         ("to_first_batch_s", "step_ms", "step_cpu_ms", "after_last_batch_s")]
                print(f"| {replicas} | {contender} | {' | '.join(cells)} |")
    save_json(results_dir / "results.json", {"machine": info, "args": vars(args), "runs": runs})
    print(f"\nresults: {results_dir.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
