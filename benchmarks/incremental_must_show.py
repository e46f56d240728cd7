"""Issue 46's must-show at scale: incremental runs of a keyed job over 10^5 rows, for Parquet shards and each table
format, with kill -9 at random moments and resumes on other world sizes (DESIGN §21).

    python -m benchmarks.incremental_must_show                       # 10^5 rows, shards + Delta + Iceberg + Lance
    python -m benchmarks.incremental_must_show --rows 20000 --outputs shards,delta

Per output (rotated order is moot: each output is its own job; they run one after the other), in real processes
started like torchrun's ranks (``RANK``, ``WORLD_SIZE``... on 127.0.0.1):

1. **Run 1** on 2 ranks: ``--rows`` examples ``{"id": i, "text": "t<i>"}``, ``key="id"``; each row is
   ``value = text.upper()``.
2. **Run 2** on 2 ranks, ``incremental=True``: every 10th text changed (``t<i>-v2``) and ``rows / 10`` examples
   appended: ``process_batch`` must be called on exactly those ``0.2 * rows`` examples (every process appends the
   dataset indices of each batch it is given to a file before processing it: they are counted), each once.
3. **Run 3**, ``incremental=True`` again over a dataset changed the same way (the texts of ids ending in 5 changed,
   10% appended): killed with SIGKILL by this script at random moments (a random rank, once a random number of
   batches has been given out, after a random delay up to 0.5 s) on 2 ranks, then on 3 ranks, then resumed on 1
   rank to the end. The union of what the attempts processed must be the run's selection (batches in flight at a
   kill are processed again: counted as repeats), and reads between the kills never give a key twice.

After runs 2 and 3 every key must be once in the outputs with the value of its newest text, read with
``read_outputs`` (shards) or the table's own reader through ``read_outputs(table)`` (Delta: delta-rs; Iceberg:
pyiceberg; Lance: pylance). A check that fails stops the script with an error: a run that lost or duplicated a row
is never reported as a figure.

Clock: each attempt's wall time (processes started to the last one's exit, planning included), one round (the
checks are the point; the times are indicative). The planner alone at 10^7 keys: ``python -m
benchmarks.incremental``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = ("shards", "delta", "iceberg", "lance")
BATCH_SIZE = 250
WORK_MS = 0.2
"""Processing milliseconds per example (a sleep standing for the device's time)."""


# ------------------------------------------------------------------------------------------------ the job


def text(i: int, run: int, rows: int) -> str:
    """The text of example ``i`` in the dataset of run ``run`` (1, 2, 3) of a job that started with ``rows``."""
    second = rows + rows // 10  # the examples of run 2's dataset
    if i >= second:
        return f"m{i}"
    value = f"n{i}" if i >= rows else f"t{i}-v2" if run >= 2 and i % 10 == 0 else f"t{i}"
    return value + "-v3" if run >= 3 and i % 10 == 5 else value


def size(run: int, rows: int) -> int:
    """The examples of run ``run``'s dataset."""
    second = rows + rows // 10
    return rows if run == 1 else second if run == 2 else second + second // 10


def table_target(spec: dict[str, Any]) -> Any:
    from torch_batch_process import tables

    output, folder = spec["output"], spec["folder"]
    if output == "shards":
        return None
    if output == "iceberg":
        return tables.iceberg("db.rows", catalog={"type": "sql", "uri": f"sqlite:///{folder}/catalog.db",
                                                   "warehouse": f"file://{folder}/warehouse"})
    return getattr(tables, output)(f"{folder}/table.{output}")


def worker(spec: dict[str, Any]) -> int:
    """One rank of one attempt (``--worker SPEC``)."""
    import torch_batch_process as tbp

    calls = Path(spec["folder"]) / "calls" / f"calls-{os.getpid()}.jsonl"
    calls.parent.mkdir(parents=True, exist_ok=True)

    class Upper(tbp.TorchBatchProcessor):
        def __init__(self, context: Any) -> None:
            self.context = context

        def process_batch(self, batch: Any, batch_idx: int) -> None:
            with open(calls, "a") as f:
                f.write(json.dumps([int(i) for i in self.context.batch_indices]) + "\n")
            time.sleep(WORK_MS * len(batch["text"]) / 1000)
            self.context.write({"value": [t.upper() for t in batch["text"]]})

    run, rows = spec["run"], spec["rows"]
    dataset = [{"id": i, "text": text(i, run, rows)} for i in range(size(run, rows))]
    target = table_target(spec)
    result = tbp.torch_batch_process(
        Upper, dataset, batch_size=BATCH_SIZE, checkpoint_interval=4, storage_path=f"{spec['folder']}/storage",
        key="id", version="v1", incremental=run > 1, progress=False, tensorboard=False,
        **({"table": target} if target is not None else {}),
    )
    if int(os.environ.get("RANK", "0")) == 0:
        Path(spec["folder"], "result.json").write_text(json.dumps(result.to_json()))
    return 0


# ------------------------------------------------------------------------------------------------ the driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(spec: dict[str, Any], world_size: int) -> list[subprocess.Popen[bytes]]:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        log = open(Path(spec["folder"]) / f"log-{spec['attempt']}-rank{rank}.txt", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.incremental_must_show", "--worker", json.dumps(spec)], env=env,
            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True,
        ))
    return procs


def _batches_given(folder: Path) -> list[list[int]]:
    return [json.loads(line) for path in sorted((folder / "calls").glob("calls-*.jsonl"))
            for line in path.read_text().splitlines() if line]


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append(None)  # a hang: reported
    return codes


def attempt(spec: dict[str, Any], world_size: int, *, kill_after: int | None, rng: random.Random,
            timeout: float) -> dict[str, Any]:
    """One attempt on ``world_size`` ranks; ``kill_after``: SIGKILL a random rank once that many batches were given
    out in this attempt (and a random delay up to 0.5 s)."""
    folder = Path(spec["folder"])
    before = len(_batches_given(folder))
    started = time.perf_counter()
    procs = _start(spec, world_size)
    killed = None
    if kill_after is not None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if len(_batches_given(folder)) - before >= kill_after:
                time.sleep(rng.uniform(0, 0.5))
                victim = rng.randrange(world_size)
                if procs[victim].poll() is None:
                    os.kill(procs[victim].pid, signal.SIGKILL)
                    killed = {"rank": victim, "batches_given": len(_batches_given(folder)) - before,
                              "at_s": round(time.perf_counter() - started, 1)}
                break
            time.sleep(0.05)
    codes = _wait(procs, timeout)
    seconds = time.perf_counter() - started
    if None in codes:
        raise AssertionError(f"attempt {spec['attempt']} of {spec['output']}: a process hung: {codes}")
    if kill_after is None and any(codes):
        raise AssertionError(f"attempt {spec['attempt']} of {spec['output']} failed: {codes}; see {folder}/log-*")
    return {"world_size": world_size, "seconds": seconds, "killed": killed, "codes": codes,
            "batches": len(_batches_given(folder)) - before}


def read_back(spec: dict[str, Any]) -> dict[int, str]:
    """Every key's value as read back; raises when a key is read twice."""
    from torch_batch_process import read_outputs

    target = table_target(spec)
    table = read_outputs(target if target is not None else f"{spec['folder']}/storage", columns=["id", "value"])
    ids, values = table.column("id").to_pylist(), table.column("value").to_pylist()
    if len(ids) != len(set(ids)):
        raise AssertionError(f"{spec['output']}: {len(ids) - len(set(ids))} key(s) read back twice")
    return dict(zip(ids, values, strict=True))


def check_final(spec: dict[str, Any], run: int) -> None:
    rows = spec["rows"]
    got = read_back(spec)
    expected = {i: text(i, run, rows).upper() for i in range(size(run, rows))}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or [k for k in expected if got.get(k) != expected[k]]
        raise AssertionError(f"{spec['output']} after run {run}: {len(wrong)} key(s) missing, extra or stale: "
                             f"{wrong[:10]}")


def selected(run: int, rows: int) -> set[int]:
    """The indices run ``run`` must process: changed texts and appended examples."""
    before = size(run - 1, rows)
    return {i for i in range(size(run, rows)) if i >= before or text(i, run, rows) != text(i, run - 1, rows)}


def must_show(output: str, rows: int, seed: int, timeout: float) -> dict[str, Any]:
    rng = random.Random(seed)
    folder = Path(tempfile.mkdtemp(prefix=f"tbp-must-show-{output}-"))
    spec = {"output": output, "rows": rows, "folder": str(folder)}
    report: dict[str, Any] = {"output": output}
    try:
        first = attempt({**spec, "run": 1, "attempt": "1"}, 2, kill_after=None, rng=rng, timeout=timeout)
        check_final(spec, 1)
        report["run 1"] = first
        shutil.rmtree(folder / "calls")
        second = attempt({**spec, "run": 2, "attempt": "2"}, 2, kill_after=None, rng=rng, timeout=timeout)
        given = [i for batch in _batches_given(folder) for i in batch]
        want = selected(2, rows)
        if len(given) != len(want) or set(given) != want:
            raise AssertionError(f"{output} run 2 processed {len(given)} rows ({len(set(given))} distinct), "
                                 f"not exactly the {len(want)} selected")
        check_final(spec, 2)
        increment = json.loads((folder / "result.json").read_text())["increment"]
        report["run 2"] = {**second, "processed": len(given), "selected": len(want), "increment": increment}
        shutil.rmtree(folder / "calls")
        batches = -(-len(selected(3, rows)) // BATCH_SIZE)
        attempts = []
        for n, world_size in enumerate((2, 3)):
            kill_after = rng.randint(max(1, batches // 10), max(2, batches // 3))
            attempts.append(attempt({**spec, "run": 3, "attempt": f"3.{n + 1}"}, world_size, kill_after=kill_after,
                                    rng=rng, timeout=timeout))
            read_back(spec)  # never a key twice between the kills
        attempts.append(attempt({**spec, "run": 3, "attempt": "3.3"}, 1, kill_after=None, rng=rng, timeout=timeout))
        given = [i for batch in _batches_given(folder) for i in batch]
        want = selected(3, rows)
        if set(given) != want:
            raise AssertionError(f"{output} run 3: processed {len(set(given))} distinct rows, the selection has "
                                 f"{len(want)} (missing {len(want - set(given))}, extra {len(set(given) - want)})")
        check_final(spec, 3)
        report["run 3"] = {"attempts": attempts, "processed": len(given), "distinct": len(set(given)),
                           "selected": len(want)}
    except BaseException:
        print(f"{output}: failed; its job, logs and table are kept in {folder}", file=sys.stderr)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--outputs", default=",".join(OUTPUTS))
    parser.add_argument("--seed", type=int, default=46)
    parser.add_argument("--timeout", type=float, default=900, help="seconds an attempt may take")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    load = os.getloadavg()[0]
    reports = []
    for n, output in enumerate(args.outputs.split(",")):
        reports.append(must_show(output, args.rows, args.seed + n, args.timeout))
        print(json.dumps(reports[-1]), file=sys.stderr)
    print(f"incremental runs of a keyed job, {args.rows:,} rows; load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; every check passed (every key once with its newest value after "
          "runs 2 and 3, no key twice between kills, run 2 processed exactly its selection, run 3's attempts "
          "together processed exactly its selection)")
    print("| output | run 1 s (2 ranks) | run 2: processed / selected, s (2 ranks) | run 3: attempts (world size, "
          "killed rank at batches given, s) | run 3 processed (distinct / selected) |")
    print("| --- | ---: | ---: | --- | ---: |")
    for r in reports:
        second, third = r["run 2"], r["run 3"]
        attempts = "; ".join(
            f"{a['world_size']} rank{'s' if a['world_size'] > 1 else ''}, "
            + (f"rank {a['killed']['rank']} killed at {a['killed']['batches_given']}" if a["killed"] else "to the end")
            + f", {a['seconds']:.1f} s"
            for a in third["attempts"]
        )
        print(f"| {r['output']} | {r['run 1']['seconds']:.1f} | {second['processed']:,} / {second['selected']:,}, "
              f"{second['seconds']:.1f} | {attempts} | {third['processed']:,} ({third['distinct']:,} / "
              f"{third['selected']:,}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
