"""``tbp status STORAGE_PATH``: where a job stands, read from its storage, while it runs and after.

Read-only: it takes no lock and writes nothing, so it is safe to run at any time, as often as
wanted, against a running job. Commit records are written atomically; when the record it lists
is garbage-collected before it reads it (a newer commit landed in between), it lists again.

``--json`` prints one JSON object with these keys (stable; ``null`` when unknown):

``job_name``, ``storage_path``, ``fingerprint`` (a short hash of ``spec``), ``spec`` (dataset length,
batch size, processor, max_batches), ``created`` (epoch seconds), ``state`` (``running``,
``preempted``, ``finished``, ``unpublished``: finished but killed while publishing its last outputs,
``stopped``: not running and not finished, e.g. crashed or killed;
``unknown``: the lock is held on another host, which this host cannot check), ``running``
(true/false/null), ``holder`` (``{"host", "pid"}`` of the running job), ``attempts``,
``current_attempt`` (``{"attempt", "started", "world_size"}`` of the latest start),
``unpublished_commits`` (commits whose files are still staged; run the job again to publish them),
``provenance`` (model versions and checkpoints it reported using),
``batches_committed``, ``batches_total``, ``examples_committed``, ``examples_total``, ``percent``,
``last_commit`` (``{"commit", "attempt", "time", "world_size"}``), ``throughput`` (of the attempt of
the last commit: ``{"attempt", "world_size", "examples_per_s", "elapsed_s", "examples_processed",
"batches_processed", "started"}``), ``eta_s`` (while running), ``metrics`` (reduced metrics: final
when finished, else the latest computed "so far"), ``metrics_final``, ``metrics_batches_committed``,
``metrics_time``, ``memory_limits`` (what the job learned about the device's memory with ``on_oom="split"``:
``{"unit", "budget", "ranges", "text"}``, see ``BatchProcessResult.memory_limits``; ``null``: it never ran out),
``ooms`` and ``split_batches`` (out-of-memory errors met and batches run in parts, over all attempts),
``outputs_path``, ``metrics_path``, ``tensorboard_path`` (``null`` when the job wrote no event files),
``result_path`` (when finished and ``result.json`` is written: a job killed between its final commit record, which
makes it finished, and ``result.json`` has none until it is run again), ``failed_examples`` (examples skipped with
``on_error="skip"``, committed so far; after ``retry_failed=True``, those still failing), ``failures``
(``{"count", "by_phase", "by_error", "first", "path", "error"}``: counts per phase (``load``/``process``) and per
exception type, the first few by dataset index with their messages, the folder they are stored in, and
``error``: why the records cannot be read, else ``null``; ``tbp failures`` lists them all), ``runs`` (a keyed job's
incremental runs, ``incremental=True``: ``{"run", "folder", "state", "counts", "examples_committed",
"examples_total"}``, ``counts`` as ``BatchProcessResult.increment``; ``[]`` for other jobs), ``generation`` (a
generation job's ``generated_prompts``, ``prompt_tokens``, ``completion_tokens``, ``resumed_prompts`` and
``reused_tokens`` over all attempts of the job and of its runs (incremental, ``retry_failed``), and ``ranks``: the
newest run's latest attempt's ``{"rank", "prompts", "tokens_in",
"tokens_out", "tokens_in_per_s", "tokens_out_per_s"}`` per rank, and ``budget``: the record's
``generation_budget``, what its engines learned with ``on_oom="split"``, or ``null``; ``null`` for other jobs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

from torch_batch_process.environment import add_storage_arguments, command_storage_options
from torch_batch_process.errors import BatchProcessError, CheckpointCorruptError, NoJobError
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.layout import (
    ATTEMPT_FILE,
    FAILURES_DIR,
    METRICS_FILE,
    OUTPUTS_DIR,
    RESULT_FILE,
    RETRIES_DIR,
    TENSORBOARD_DIR,
)
from torch_batch_process.jobstore.memory_limits import MemoryLimits
from torch_batch_process.jobstore.retries import current_failures_root, retry_numbers
from torch_batch_process.jobstore.store import JobStore, latest_record_at, lock_holder
from torch_batch_process.observe.failures import current_failure_records, failure_summary
from torch_batch_process.observe.progress import format_duration
from torch_batch_process.observe.token_rates import GENERATION_STATS, format_rate, rates_per_rank
from torch_batch_process.observe.visible_text import visible
from torch_batch_process.outputs.keyed.runs import counts_text, incremental_runs, keyed_column
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.registry import open_storage

_READ_RETRIES = 5


def read_status(storage_path: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reads the job stored at ``storage_path``; returns the ``--json`` object (see the module docstring).

    Raises:
        NoJobError: nothing is stored there.
        CheckpointCorruptError: a record cannot be read.
        StorageError: the storage cannot be read.
    """
    storage = open_storage(storage_path, storage_options)
    store = JobStore(storage)
    job = store.load_job()
    latest = _load_latest(store)
    if job is None:
        raise NoJobError(f"no job is stored at {storage.url!r} (no _tbp/job.json)")
    attempt_info = storage.read_json_object(ATTEMPT_FILE) or {}
    result = storage.read_json_object(RESULT_FILE) if latest is not None and latest.finished else None
    running, holder = lock_holder(storage)

    spec = job.spec
    batches_total = job.planned_batches
    examples_total = job.examples_total
    stats = latest.stats if latest else {}
    batches_committed = len(latest.committed) if latest else 0
    examples_committed = int(stats.get("examples_committed", 0)) if latest else 0
    attempts = max(int(attempt_info.get("attempt", 0) or 0), latest.attempt if latest else 0)

    finished = bool(latest and latest.finished)
    unpublished = store.unpublished_stages(latest) if finished and latest is not None and not running else []
    if finished and unpublished:
        state = "unpublished"  # killed while publishing: the committed files are still in staging
    elif finished:
        state = "finished"
    elif running:
        state = "running"
    elif latest is not None and stats.get("preempted") and latest.attempt >= attempts:
        state = "preempted"  # and no attempt started since
    elif running is None:
        state = "unknown"
    else:
        state = "stopped"

    throughput = None
    if latest is not None and "examples_per_s" in stats:
        throughput = {
            "attempt": latest.attempt,
            "world_size": latest.world_size,
            "examples_per_s": stats.get("examples_per_s"),
            "elapsed_s": stats.get("attempt_elapsed_s"),
            "examples_processed": stats.get("attempt_examples_processed"),
            "batches_processed": stats.get("attempt_batches_processed"),
            "started": stats.get("attempt_started"),
        }
    eta = None
    if state == "running" and throughput and throughput["examples_per_s"] and latest.attempt == attempts:
        eta = round((examples_total - examples_committed) / throughput["examples_per_s"], 1)

    metrics, metrics_final = stats.get("metrics"), False
    if finished and (result or latest.result):
        metrics, metrics_final = (result or latest.result or {}).get("metrics", {}), True
    failures = _failures(storage, latest)

    return {
        "job_name": job.job_name,
        "storage_path": storage.url,
        "fingerprint": fingerprint(spec),
        "unpublished_commits": unpublished,
        "provenance": latest.provenance if latest else [],
        "spec": spec,
        "created": job.created,
        "state": state,
        "running": running,
        "holder": holder,
        "attempts": attempts,
        "current_attempt": (
            {
                "attempt": attempt_info.get("attempt"),
                "started": attempt_info.get("started"),
                "world_size": attempt_info.get("world_size"),
            }
            if attempt_info
            else None
        ),
        "batches_committed": batches_committed,
        "batches_total": batches_total,
        "examples_committed": examples_committed,
        "examples_total": examples_total,
        "percent": round(100.0 * examples_committed / examples_total, 2) if examples_total else 100.0,
        "last_commit": (
            {"commit": latest.commit, "attempt": latest.attempt, "time": latest.time, "world_size": latest.world_size}
            if latest
            else None
        ),
        "throughput": throughput,
        "eta_s": eta,
        "metrics": metrics,
        "metrics_final": metrics_final,
        "metrics_batches_committed": batches_committed if metrics_final else stats.get("metrics_batches_committed"),
        "metrics_time": latest.time if metrics_final and latest else stats.get("metrics_time"),
        "memory_limits": _memory_limits(latest),
        "ooms": int(stats.get("ooms", 0)),
        "split_batches": int(stats.get("split_batches", 0)),
        "outputs_path": storage.url_of(OUTPUTS_DIR),
        "metrics_path": storage.url_of(METRICS_FILE),
        "tensorboard_path": storage.url_of(TENSORBOARD_DIR) if storage.exists(TENSORBOARD_DIR) else None,
        "result_path": storage.url_of(RESULT_FILE) if finished and result is not None else None,
        "failed_examples": failures["count"],
        "failures": failures,
        "generation": _generation(storage, latest),
        "runs": incremental_runs(storage),
    }


def _generation(storage: Storage, latest: CommitRecord | None) -> dict[str, Any] | None:
    """A generation job's prompts and tokens over all attempts of the job and of its runs (``retries/<k>``: a keyed
    job's incremental runs, ``retry_failed`` runs), the newest one's latest attempt per rank with their tokens per
    second, and the engine's budget it learned (DESIGN §19); ``None`` for other jobs."""
    if latest is None or "generated_prompts" not in latest.stats:  # not a generation job: its runs are not read
        return None
    records = [latest, *(latest_record_at(storage, f"{RETRIES_DIR}/{k}") for k in retry_numbers(storage))]
    generating = [record for record in records if record is not None and "generated_prompts" in record.stats]
    if not generating:
        return None
    totals = {name: sum(int(record.stats.get(name, 0)) for record in generating) for name in GENERATION_STATS}
    newest = generating[-1]
    ranks = rates_per_rank(newest.stats.get("generation_ranks") or [], newest.stats.get("attempt_elapsed_s"))
    return {**totals, "ranks": ranks, "budget": newest.generation_budget}


def generation_text(generation: dict[str, Any]) -> str:
    """The ``generation`` line of ``tbp status`` (and the report's row)."""
    text = (
        f"{generation['generated_prompts']:,} prompts answered, {generation['prompt_tokens']:,} prompt tokens, "
        f"{generation['completion_tokens']:,} answer tokens (all attempts and runs)"
    )
    if generation.get("resumed_prompts"):
        text += (
            f"; {generation['resumed_prompts']:,} answers continued from a stop's partial answers "
            f"({generation['reused_tokens']:,} tokens not generated again)"
        )
    budget = generation.get("budget")
    if budget:
        text += (
            f"; engine budget learned: KV cache {budget['cache_tokens']:,} tokens, {budget['batch_tokens']:,} tokens "
            f"per step ({budget.get('ooms', 0)} out-of-memory errors)"
        )
    ranks = [r for r in generation.get("ranks") or [] if r.get("tokens_out_per_s") is not None]
    if ranks:
        tokens_in = sum(r["tokens_in_per_s"] for r in ranks)
        tokens_out = sum(r["tokens_out_per_s"] for r in ranks)
        text += f"\nlatest attempt: in {format_rate(tokens_in)} tok/s, out {format_rate(tokens_out)} tok/s"
        if len(ranks) > 1:
            text += " (" + ", ".join(
                f"rank {r['rank']}: in {format_rate(r['tokens_in_per_s'])}, out {format_rate(r['tokens_out_per_s'])}"
                for r in ranks
            ) + ")"
    return text


def _memory_limits(latest: CommitRecord | None) -> dict[str, Any] | None:
    if latest is None or latest.memory_limits is None:
        return None
    return MemoryLimits.from_json(latest.memory_limits).summary()


def _failures(storage: Storage, latest: CommitRecord | None) -> dict[str, Any]:
    """The ``failures`` entry: read from the current failure files (the job's, or its latest finished
    ``retry_failed`` run's) when the latest record of their folder counts any; a keyed job's, over its runs (each
    key's newest failure: an earlier run's may be current when the latest run has none)."""
    summary: dict[str, Any] = failure_summary([])
    summary.update(path=storage.url_of(FAILURES_DIR), error=None)
    root = current_failures_root(storage)
    record = latest_record_at(storage, root) if root else latest
    committed = int(record.stats.get("failed_examples") or 0) if record is not None else 0
    if committed <= 0 and keyed_column(storage) is None:  # a keyed job's earlier runs' failures may be current too
        return summary
    try:
        folder, records = current_failure_records(storage)
    except BatchProcessError as exc:  # damaged files: say so, and give the count the record keeps
        summary.update(count=committed, error=str(exc))
        return summary
    summary.update(failure_summary(records), path=storage.url_of(folder))
    return summary


def fingerprint(spec: dict[str, Any]) -> str:
    """A short stable hash of a job's spec (what a resume must match)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def _load_latest(store: JobStore) -> CommitRecord | None:
    """The latest record; lists again when it vanished between list and read (a newer commit's GC)."""
    for attempt in range(_READ_RETRIES):
        try:
            return store.load_latest()
        except CheckpointCorruptError as exc:
            if "vanished" not in str(exc) or attempt == _READ_RETRIES - 1:
                raise
            time.sleep(0.05)
    return None  # pragma: no cover - the loop returns or raises


# ------------------------------------------------------------------------------------ text


def format_status(status: dict[str, Any]) -> str:
    """The human-readable report of :func:`read_status`'s object (what the job stored shown :func:`visible`: an
    exception message's escape sequences neither act on the terminal nor fail to print)."""
    now = time.time()
    lines = [("job", f"'{status['job_name']}': {_spec_text(status['spec'])}; fingerprint {status['fingerprint']}")]
    lines.append(("storage", status["storage_path"]))
    state = status["state"]
    holder = status.get("holder")
    if holder and state in ("running", "unknown"):
        state += f" (pid {holder.get('pid')} on host {holder.get('host')})"
    if status["state"] == "unknown":
        state += "; the lock is held on another host, so whether it still runs cannot be checked from here"
    elif status["state"] == "preempted":
        state += "; run the same command again to resume"
    elif status["state"] == "unpublished":
        state += (
            f": the job finished, but the committed outputs of commit(s) {status['unpublished_commits']} are not "
            "published yet (it was killed while publishing); run the same command again to publish them (no other work)"
        )
    elif status["state"] == "stopped" and status["batches_committed"] < status["batches_total"]:
        state += " (not running: it failed, crashed or was killed); run the same command again to resume"
    lines.append(("state", state))
    current = status.get("current_attempt") or {}
    attempts = f"{status['attempts']}"
    if current.get("started"):
        attempts += f" (latest started {_when(current['started'], now)} on {current.get('world_size')} rank(s))"
    lines.append(("attempts", attempts))
    lines.append(
        (
            "progress",
            f"{status['batches_committed']}/{status['batches_total']} batches, "
            f"{status['examples_committed']}/{status['examples_total']} examples committed ({status['percent']:.1f}%)",
        )
    )
    last = status.get("last_commit")
    last_text = f"#{last['commit']} {_when(last['time'], now)}, attempt {last['attempt']}" if last else "none yet"
    lines.append(("last commit", last_text))
    tp = status.get("throughput")
    if tp and tp.get("examples_per_s") is not None:
        text = (
            f"{tp['examples_per_s']:.1f} examples/s over {tp.get('elapsed_s') or 0:.1f} s "
            f"(attempt {tp['attempt']}, {tp['world_size']} rank(s), {tp.get('examples_processed')} examples)"
        )
        if status.get("eta_s") is not None:
            text += f"; ETA {format_duration(status['eta_s'])}"
        lines.append(("throughput", text))
    else:
        lines.append(("throughput", "unknown (no commit with throughput yet)"))
    metrics = status.get("metrics")
    if metrics:
        text = ", ".join(f"{key}={_short(value)}" for key, value in sorted(metrics.items()))
        if not status.get("metrics_final"):
            text += f" (so far: at {status.get('metrics_batches_committed')} batches"
            text += f", {_when(status['metrics_time'], now)})" if status.get("metrics_time") else ")"
        lines.append(("metrics", text))
    else:
        lines.append(("metrics", "none yet" if not status.get("metrics_final") else "none (no reducer)"))
    limits = status.get("memory_limits")
    if limits:
        lines.append((
            "memory",
            f"{limits['text']} ({status.get('ooms', 0)} out-of-memory error(s) met, "
            f"{status.get('split_batches', 0)} batch(es) run in parts, over all attempts)",
        ))
    lines.append(("failed", _failures_text(status)))
    if status.get("generation"):
        lines.append(("generation", generation_text(status["generation"])))
    for run in status.get("runs") or []:  # a keyed job's incremental runs (DESIGN §21)
        lines.append(("runs", counts_text(run)))
    for entry in status.get("provenance") or []:
        lines.append(("uses", ", ".join(f"{key}={_short(value)}" for key, value in entry.items())))
    lines.append(("outputs", status["outputs_path"]))
    lines.append(("metrics log", status["metrics_path"]))
    if status.get("tensorboard_path"):  # none without the tensorboard package (nor with tensorboard=False)
        lines.append(("tensorboard", status["tensorboard_path"]))
    if status.get("result_path"):
        lines.append(("result", status["result_path"]))
    elif status["state"] in ("finished", "unpublished"):
        lines.append(("result", "in the final commit record; result.json is not written yet (killed before it): a "
                      "re-run writes it"))
    width = max(len(key) for key, _ in lines)
    indent = "\n" + " " * (width + 2)  # a value of several lines lines up under its first
    return visible("\n".join(f"{key:<{width}}  {value.replace(chr(10), indent)}" for key, value in lines))


def _failures_text(status: dict[str, Any]) -> str:
    """The ``failed`` line: how many examples were skipped, by phase and error, and the first few."""
    failures = status.get("failures") or {}
    count = int(status.get("failed_examples") or 0)
    if not count:
        return "none"
    text = f"{count} example(s) skipped (on_error='skip')"
    if failures.get("by_phase"):
        phases = ", ".join(f"{phase} {n}" for phase, n in failures["by_phase"].items())
        errors = ", ".join(f"{error} {n}" for error, n in failures["by_error"].items())
        text += f"; by phase: {phases}; by error: {errors}"
    if failures.get("error"):
        text += f"; the failure records cannot be read: {failures['error']}"
    for entry in failures.get("first") or []:
        text += (
            f"\n  index {entry['index']} (batch {entry['batch_idx']}, attempt {entry['attempt']}, "
            f"rank {entry['rank']}, {entry['phase']}): {entry['error_type']}: {entry['message']}"
        )
    if count > len(failures.get("first") or []):
        text += f"\n  ... all of them: tbp failures {status['storage_path']}"
    return text


def _spec_text(spec: dict[str, Any]) -> str:
    """What the job runs, in words (``--json`` has the whole spec its fingerprint hashes)."""
    text = (
        f"processor {spec.get('processor')} over {spec.get('dataset_length')} examples ({spec.get('dataset_type')}) "
        f"in batches of {spec.get('batch_size')}"
    )
    plan = spec.get("plan")
    if isinstance(plan, dict):
        kind = plan.get("plan") or plan.get("kind") or ("retry" if "retry_indices" in plan else "custom")
        text += f", {kind} plan"
    if spec.get("max_batches") is not None:
        text += f", max_batches={spec['max_batches']} per rank"
    table = spec.get("table")
    if isinstance(table, dict):
        text += f", rows into a {table.get('format')} table"
    elif spec.get("output_format"):
        text += f", {spec['output_format']} records"
    return text


def _when(epoch: float, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
    return f"at {stamp} ({format_duration(max(0.0, now - epoch))} ago)"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------- CLI


def add_status_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``status`` to the ``tbp`` command's subparsers; the command runs :func:`run_status`."""
    parser = subparsers.add_parser(
        "status",
        help="show where a job stands (progress, throughput, metrics), read from its storage",
        description=(
            "Shows a job's progress, throughput, reduced metrics and where its outputs are, read from its storage "
            "path. Read-only: safe while the job runs."
        ),
    )
    add_storage_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (stable keys) instead of text")
    parser.set_defaults(func=run_status)
    return parser


def run_status(args: argparse.Namespace) -> int:
    """Runs ``tbp status``; returns the exit code (0, or 1 when nothing can be shown)."""
    try:
        options = command_storage_options(args.storage_options)
    except ValueError as exc:
        print(f"tbp status: --storage-options must be a JSON object: {exc}", file=sys.stderr)
        return 2
    try:
        status = read_status(args.storage_path, options)
    except BatchProcessError as exc:
        print(f"tbp status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=1, sort_keys=True) if args.json else format_status(status))
    return 0
