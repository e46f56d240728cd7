"""Cost and correctness of the launcher's rank-prefixed output, against torchrun with and without ``--tee``.

Each worker (a plain Python script, no torch) prints LINES lines as fast as it can, in two writes per line
(``print``), as most programs do. For each way of launching 2 workers it reports the wall time of the whole
command (torch import and rendezvous included), the lines received, and the lines that arrive broken (a line
cut in two, or two lines glued together): torchrun's ``--tee 3 --log-line-prefix-template`` tails log files
and prints whatever it reads, so a line caught half-written is split.

    python benchmarks/launcher_output.py [--lines 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import os, sys
rank = os.environ["RANK"]
for i in range(int(sys.argv[1])):
    print(f"line {i} of rank {rank} " + "x" * 40)
"""
LINE = re.compile(r"^(\[rank [01]\] |\[default[01]\]:)?line \d+ of rank [01] x{40}$")


def _commands(script: str, lines: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    launcher = [sys.executable, "-m", "torch_batch_process.launch.torch_distributed", "--nproc-per-node", "2"]
    unbuffered = {"PYTHONUNBUFFERED": "1"}
    return {
        "torchrun (no prefix)": (torchrun + [script, str(lines)], {}),
        "torchrun --tee 3 (prefix)": (
            torchrun + ["--tee", "3", "--log-line-prefix-template", "[rank ${rank}] ", script, str(lines)],
            unbuffered,
        ),
        "tbp launcher (prefix)": (launcher + ["python3", script, str(lines)], {}),
    }


def _run(cmd: list[str], extra_env: dict[str, str]) -> tuple[float, int, int]:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    env.update(extra_env)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-2000:]}")
    lines = proc.stdout.splitlines()
    broken = sum(1 for line in lines if not LINE.match(line))
    return elapsed, len(lines), broken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100_000, help="lines per worker")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = str(Path(tmp, "worker.py"))
        Path(script).write_text(WORKER)
        results: dict[str, list[tuple[float, int, int]]] = {}
        quiet = _commands(script, 0)
        loud = _commands(script, args.lines)
        for _ in range(args.rounds):  # interleaved rounds: the machine's load hits every launcher alike
            for name in loud:
                results.setdefault(f"{name}, 0 lines", []).append(_run(*quiet[name]))
                results.setdefault(f"{name}, {args.lines} lines", []).append(_run(*loud[name]))
    print(f"2 workers, {args.rounds} rounds (median wall time; lines and broken lines summed over rounds)\n")
    print(f"{'launch':<48} {'wall s':>8} {'lines':>10} {'broken':>8}")
    for name, runs in results.items():
        print(
            f"{name:<48} {statistics.median(r[0] for r in runs):>8.2f} {sum(r[1] for r in runs):>10} "
            f"{sum(r[2] for r in runs):>8}"
        )


if __name__ == "__main__":
    main()
