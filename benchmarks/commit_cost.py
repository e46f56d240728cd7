"""What a commit costs the batch's thread in a 1-process tiny-batch record job (issue 45): Python calls and CPU.

    python -m benchmarks.commit_cost                        # 1e5 rows in batches of 100, 199 commits, 3 rounds
    python -m benchmarks.commit_cost --base /work/main      # also another checkout, in the same rotated rounds

The job is ``records_small``'s (``context.write`` of two columns per batch, default ``checkpoint_interval=5``,
local storage). Each run is a fresh process and gives two figures per commit, both on the batch's thread only: the
**Python function calls** made by ``Committer.commit`` and the loop's ``on_checkpoint_start`` step (counted by
``cProfile``, which runs only inside them: a deterministic count, the machine's load does not move it), and the
**CPU** of the same calls without the profiler (``time.thread_time``, median over the job's commits: the load
moves it). The background threads' share (the record writer) is not in these figures; ``records_small`` gives the
job's clocks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(rows: int, profiled: bool) -> dict:
    import cProfile
    import pstats

    import pyarrow.parquet  # noqa: F401 - imported before the job, as in records_small
    import torch
    from records_small import two_columns_processor  # run by path (see _run): this folder first on the path

    from torch_batch_process import torch_batch_process
    from torch_batch_process.engine import loop
    from torch_batch_process.engine.commit import committer

    profile = cProfile.Profile()
    seconds: list[float] = []

    def measured(method):
        def call(*args, **kwargs):
            if profiled:
                profile.enable()
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                seconds.append(time.thread_time() - start)
                if profiled:
                    profile.disable()
        return call

    committer.Committer.commit = measured(committer.Committer.commit)
    for owner in vars(loop).values():  # the loop's class that runs on_checkpoint_start before a commit
        if isinstance(owner, type) and hasattr(owner, "_checkpoint_hook"):
            owner._checkpoint_hook = measured(owner._checkpoint_hook)

    with tempfile.TemporaryDirectory() as tmp:
        result = torch_batch_process(two_columns_processor(), torch.arange(rows), batch_size=100,
                                     storage_path=f"{tmp}/job", progress=False)
    commits = len(seconds) // 2  # a hook and a commit each
    out = {"commits": commits, "cpu_us": statistics.median(
        seconds[i] + seconds[i + 1] for i in range(0, 2 * commits, 2)) * 1e6}
    if profiled:
        out["calls"] = pstats.Stats(profile).total_calls / commits
    assert result.finished
    return out


def _run(tree: str, rows: int, profiled: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(  # by path: the tree's library first on the path, this script whatever the tree
        [sys.executable, os.path.abspath(__file__), "--child", str(rows), "1" if profiled else "0"],
        capture_output=True, text=True, check=False, env=env, cwd=tree,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", default="", help="another checkout, measured in the same rotated rounds")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1] == "1")))
        return 0
    from benchmarks.report import fmt_spread, machine, machine_line, rotated

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this tree": here, **({"--base tree": os.path.abspath(args.base)} if args.base else {})}
    calls: dict[str, float] = {}
    cpu: dict[str, list[float]] = {name: [] for name in trees}
    for name, tree in trees.items():
        calls[name] = _run(tree, args.rows, profiled=True)["calls"]
    for r in range(args.rounds):
        for name in rotated(list(trees), r):
            cpu[name].append(_run(trees[name], args.rows, profiled=False)["cpu_us"])
    print(f"{args.rows:,} rows in batches of 100, commits every 5 batches; CPU: {args.rounds} rotated rounds")
    print("| tree | Python calls per commit | batch thread's CPU per commit (us), median [min-max] |")
    print("|---|---:|---:|")
    for name in trees:
        print(f"| {name} | {calls[name]:.0f} | {fmt_spread(cpu[name], 0)} |")
    print(f"\nMachine: {machine_line(machine())}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
