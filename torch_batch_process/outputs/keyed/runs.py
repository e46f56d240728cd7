"""The incremental runs of a keyed job as stored (DESIGN §21): their files, and what ``tbp status`` says of them.

An incremental run ``k + 1`` is stored like a ``retry_failed`` run, in ``retries/<k>/``
(:mod:`torch_batch_process.engine.plan.incremental`), with two files of its own written before its ``job.json``:
its selection (:data:`SELECTION_FILE`) and the planner's counts (:data:`INCREMENT_FILE`), and, with
``prune_missing=True``, the stored keys the dataset no longer has (:data:`REMOVED_FILE`). Read-only here. A damaged
counts or removed-keys file is a :class:`~torch_batch_process.errors.CheckpointCorruptError` naming it
(:func:`read_counts`, :func:`decode_removed`): a resume and a read-back depend on them.
"""

from __future__ import annotations

from typing import Any

from torch_batch_process.errors import CORRUPT_HINT, CheckpointCorruptError
from torch_batch_process.jobstore.formats import JobInfo, parse_json
from torch_batch_process.jobstore.layout import JOB_FILE, RETRIES_DIR
from torch_batch_process.jobstore.retries import retry_numbers
from torch_batch_process.jobstore.store import job_finished, latest_record_at
from torch_batch_process.outputs.failure_records import read_failure_records
from torch_batch_process.storage.base import Storage
from torch_batch_process.storage.errors import NotAFileError

__all__ = ["INCREMENT_FILE", "REMOVED_FILE", "RETRIED_FILE", "SELECTION_FILE", "counts_text", "current_failures",
           "decode_removed", "failed_keys", "incremental_runs", "keyed_column", "read_counts", "read_run_counts",
           "removed_keys"]

SELECTION_FILE = "_tbp/selection.bin"
"""The run's selection (:class:`~torch_batch_process.outputs.keyed.selection.Selection`), in its folder."""
INCREMENT_FILE = "_tbp/increment.json"
"""The planner's counts of the run (new, changed, unchanged...: ``IncrementCounts.to_json``), in its folder."""
REMOVED_FILE = "_tbp/removed.arrows"
"""The keys a ``prune_missing=True`` run removes (an Arrow IPC stream, column ``key``), in its folder."""
RETRIED_FILE = "_tbp/retried.arrows"
"""The examples the run selected because their key failed before (an Arrow IPC stream, columns ``key`` and
``index``), in its folder: the earlier failures it clears, those of its planned batches (:func:`current_failures`).
Runs of earlier versions have none."""


def keyed_column(storage: Storage) -> str | None:
    """The key's column of the keyed job (``key=``, DESIGN §21) stored in ``storage``; ``None`` for another job, or
    when its job file is missing or unreadable (what reads it for more says so)."""
    try:
        job = storage.read_json_object(JOB_FILE)
    except NotAFileError:
        return None
    spec = job.get("spec") if job is not None else None
    keyed = spec.get("keyed") if isinstance(spec, dict) else None
    return keyed.get("column") if isinstance(keyed, dict) else None


def incremental_runs(storage: Storage) -> list[dict[str, Any]]:
    """The job's incremental runs, oldest first: ``run`` (2, 3...), ``folder``, ``state`` (``finished``,
    ``unfinished``: killed or running; ``planned``: killed before it started), ``counts`` (the planner's),
    ``examples_committed`` and ``examples_total`` (of its selection), and ``error``: ``None``, or why its counts
    cannot be read (a damaged :data:`INCREMENT_FILE`: the run is listed, never left out of ``tbp status``)."""
    runs = []
    for k in retry_numbers(storage):
        folder = f"{RETRIES_DIR}/{k}"
        error = None
        try:
            counts = read_counts(storage, f"{folder}/{INCREMENT_FILE}")
        except FileNotFoundError:
            continue  # a retry_failed run
        except CheckpointCorruptError as exc:
            counts, error = {}, str(exc)
        latest = latest_record_at(storage, folder)
        started = storage.exists(f"{folder}/_tbp/job.json")
        state = "finished" if job_finished(storage, folder) else "unfinished" if started else "planned"
        runs.append({
            "run": k + 1,
            "folder": folder,
            "state": state,
            "counts": counts,
            "examples_committed": int(latest.stats.get("examples_committed", 0)) if latest is not None else 0,
            "examples_total": int(counts.get("selected", 0)),
            "error": error,
        })
    return runs


def counts_text(run: dict[str, Any]) -> str:
    """One incremental run in words, for ``tbp status`` and the log."""
    if run.get("error"):
        return (f"run {run['run']} (incremental, {run['state']}): its planner's counts cannot be read: {run['error']}; "
                f"{run['examples_committed']:,} examples processed")
    c = run["counts"]
    gone = int(c.get("removed", 0))
    return (
        f"run {run['run']} (incremental, {run['state']}): {c.get('total', 0):,} examples: {c.get('new', 0):,} new, "
        f"{c.get('changed', 0):,} changed, {c.get('failed', 0):,} failed before (retried), "
        f"{c.get('recompute', 0):,} recomputed, {c.get('unchanged', 0):,} unchanged; "
        f"{run['examples_committed']:,}/{run['examples_total']:,} processed"
        + (f"; {gone:,} keys gone from the dataset ({'removed' if c.get('pruned') else 'kept'})" if gone else "")
    )


def failed_keys(storage: Storage) -> Any:
    """The keys that failed in each run of a keyed job (``on_error="skip"``), as a ``pyarrow.Table`` of ``key`` and
    ``_tbp_run``: the *tombstones* that hide a key's older rows (a changed example whose new run failed is not
    served with its stale value) and that the planner selects again. ``None`` when there are none. Reads the
    committed failure records of the job and of every ``retries/<k>/`` run, checked as ``read_failures`` checks
    them (a damaged or missing file is an ``OutputCorruptError``, never a failed key served with its stale row)."""
    keys: list[Any] = []
    runs: list[int] = []
    for k in [0, *retry_numbers(storage)]:
        for record in read_failure_records(storage, f"{RETRIES_DIR}/{k}" if k else ""):
            if "key" in record:
                keys.append(record["key"])
                runs.append(int(record.get("_tbp_run", k + 1)))
    if not keys:
        return None
    import pyarrow as pa  # only here: tbp's status parser imports this module, and must stay light

    return pa.table({"key": keys, "_tbp_run": pa.array(runs, pa.int32())})


def current_failures(storage: Storage) -> list[dict[str, Any]]:
    """A keyed job's current failure records: for each key whose newest event is a failure, that failure's record,
    ordered by dataset index (then run). What ``tbp failures``, ``tbp status`` and ``read_failures`` list, and what
    the next incremental run selects again (``failed``).

    The job's failures first, then each finished run's in order: a run clears the earlier failures of the keys it
    selected again (:data:`RETRIED_FILE`) within its planned batches (a run capped by ``max_batches`` leaves the
    others, and those of keys gone from its dataset, listed), and adds its own. A run without that file (an earlier
    version's) replaces them all, as before. An unfinished run adds nothing yet (its failures are the job's once it
    finishes), as for ``retry_failed=True`` runs.

    Raises:
        OutputCorruptError: a failures file cannot be read (:func:`read_failure_records`).
        CheckpointCorruptError: a run's :data:`RETRIED_FILE`, selection or ``job.json`` cannot be read.
    """
    current: dict[Any, dict[str, Any]] = {}
    for k in [0, *retry_numbers(storage)]:
        folder = f"{RETRIES_DIR}/{k}" if k else ""
        if k:
            if not job_finished(storage, folder):
                continue
            cleared = _cleared_keys(storage, folder)
            if cleared is None:
                current.clear()
            for key in cleared or ():
                current.pop(key, None)
        for n, record in enumerate(read_failure_records(storage, folder)):
            current[record["key"] if "key" in record else (folder, n)] = record
    return sorted(current.values(),
                  key=lambda r: (r.get("index", 0), r.get("_tbp_run", 0), r.get("attempt", 0)))


def _cleared_keys(storage: Storage, folder: str) -> list[Any] | None:
    """The keys whose earlier failures the finished run in ``folder`` cleared: those it selected again as failed
    (:data:`RETRIED_FILE`) in its planned batches (a row or a failure of this run is their newest event now).
    ``None``: the run stored no such file (a run of an earlier version)."""
    rel = f"{folder}/{RETRIED_FILE}"
    try:
        data = storage.read_bytes(rel)
    except FileNotFoundError:
        return None
    import pyarrow as pa  # only here, as in failed_keys

    try:
        retried = pa.ipc.open_stream(data).read_all()
        keys, indices = retried.column("key").to_pylist(), retried.column("index").to_numpy()
    except (pa.ArrowException, OSError, KeyError) as exc:  # garbled: pyarrow's OSError "Invalid flatbuffers message"
        raise CheckpointCorruptError(
            f"{storage.url_of(rel)}: the examples this run retried cannot be read ({exc}); it is damaged. "
            f"{CORRUPT_HINT}."
        ) from exc
    reached = _reached(storage, folder)
    if reached is None or not keys:
        return keys
    if reached == 0:
        return []
    from torch_batch_process.outputs.keyed.selection import Selection

    rel = f"{folder}/{SELECTION_FILE}"
    last = Selection.from_bytes(_run_file(storage, rel, "selection file"), storage.url_of(rel)).take(reached - 1, 1)
    if len(last) == 0:  # the planned batches hold every selected example
        return keys
    return [key for key, index in zip(keys, indices.tolist(), strict=True) if index <= int(last[0])]


def _reached(storage: Storage, folder: str) -> int | None:
    """How many of its selected examples (the first ones, in index order) the run's planned batches hold; ``None``:
    all of them."""
    rel = f"{folder}/{JOB_FILE}"
    where = storage.url_of(rel)
    return JobInfo.from_json(parse_json(_run_file(storage, rel, "job file"), where), where).planned_examples


def _run_file(storage: Storage, rel: str, what: str) -> bytes:
    """The bytes of a file that a started run stores before its first batch (its job file, selection, counts).

    Raises:
        CheckpointCorruptError: it is missing (deleted, or not restored with the rest of the job).
    """
    try:
        return storage.read_bytes(rel)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(
            f"{storage.url_of(rel)}: this run's {what} is missing (deleted, or not restored with the rest of the "
            f"job); the run's examples and failures cannot be told without it. {CORRUPT_HINT}."
        ) from exc


def removed_keys(storage: Storage) -> Any:
    """The keys that ``prune_missing=True`` runs removed, as a ``pyarrow.Table`` of ``key`` and ``_tbp_run`` (the run
    that removed them): tombstones, like failures, from the moment the run's plan is stored. ``None``: none."""
    tables = []
    for k in retry_numbers(storage):
        rel = f"{RETRIES_DIR}/{k}/{REMOVED_FILE}"
        try:
            data = storage.read_bytes(rel)
        except FileNotFoundError:
            continue
        import pyarrow as pa  # only here, as in failed_keys

        keys = decode_removed(data, storage.url_of(rel))
        tables.append(pa.table({"key": keys, "_tbp_run": pa.array([k + 1] * len(keys), pa.int32())}))
    if not tables:
        return None
    import pyarrow as pa

    return pa.concat_tables(tables)


def decode_removed(data: bytes, where: str) -> Any:
    """The keys of a removed-keys file (:data:`REMOVED_FILE`, at ``where``), a ``pyarrow.ChunkedArray``.

    Raises:
        CheckpointCorruptError: the file is not an Arrow stream with a ``key`` column (damaged): its keys would be
            served again by a read-back, and deleted by none of the run's table transactions.
    """
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(data).read_all().column("key")
    except (pa.ArrowException, OSError, KeyError) as exc:  # cut short, garbled (an OSError); no "key" column
        raise CheckpointCorruptError(
            f"{where}: the keys this prune_missing=True run removes cannot be read ({exc}); it is damaged. "
            f"{CORRUPT_HINT}."
        ) from exc


def read_run_counts(storage: Storage, rel: str) -> dict[str, Any]:
    """:func:`read_counts` of a started run, whose counts must be there.

    Raises:
        CheckpointCorruptError: they are missing or damaged.
    """
    where = storage.url_of(rel)
    counts = parse_json(_run_file(storage, rel, "count file"), where)
    if not isinstance(counts, dict):
        raise CheckpointCorruptError(f"{where} is corrupt (not a JSON object). {CORRUPT_HINT}.")
    return counts


def read_counts(storage: Storage, rel: str) -> dict[str, Any]:
    """The planner's counts of a run (:data:`INCREMENT_FILE`, at ``rel``).

    Raises:
        FileNotFoundError: there is none.
        CheckpointCorruptError: it is not a JSON object (damaged): the run cannot check the dataset it resumes with.
    """
    where = storage.url_of(rel)
    counts = parse_json(storage.read_bytes(rel), where)
    if not isinstance(counts, dict):
        raise CheckpointCorruptError(f"{where} is corrupt (not a JSON object). {CORRUPT_HINT}.")
    return counts
