"""Every name the library stores under a job's storage path, in one place.

::

    outputs/commit_<s>/rank_<r>/...   committed files of stage s of rank r (upload_path() files, record shards)
    result.json                       the final result of a finished job (metrics, counts): a copy of the final
                                      commit record's result, written after it (the record makes a job finished)
    metrics.jsonl                     report_metrics() records, reduced metrics, progress, one JSON per line
    tensorboard/rank_<r>/             get_tensorboard_path() of each rank
    retries/<k>/                      the k-th retry_failed=True run: a job of its own (see the retry module), whose
                                      outputs are published to outputs/ above (commit_<s> after the job's stages)
    failures/<s>-rank_<r>.jsonl       examples that failed with on_error="skip" in stage s of rank r (one JSON a line;
                                      see engine/feed/failing_examples.py), published with the stage's outputs
    _tbp/job.json                     the job's fingerprint, plan and script, written at its first start
    _tbp/attempt.json                 the number of the latest attempt (also of attempts that never committed)
    _tbp/commits/<n>.json             the latest commit record: the durable truth (see the committer)
    _tbp/states/<s>/rank_<r>.pt       rank r's reducer summaries and processor state at its stage s
    _tbp/staging/<s>/rank_<r>/...     files of stage s of rank r before publication (and its failures, as
                                      _tbp_failures.jsonl: publication moves them to failures/)
    _tbp/segments/<s>-rank_<r>-<k>.arrow
                                      record rows (context.write) of stage s of rank r, committed with the stage and
                                      not yet in a published shard (Arrow IPC; see torch_batch_process.outputs.segments)
    _tbp/segments/<s>-rank_<r>-<k>.arrows
                                      local storage: rank r's segment log from stage s on, an Arrow IPC stream
                                      appended at each commit, a record batch per stage (the same module)
    _tbp/scratch/                     local storage: folders being written (upload_path() blocks, record shards)
    _tbp/lock, _tbp/lock.json         the job lock of local storage (an OS file lock) and its holder
    _tbp/lease.json                   the job lease of object stores
    _tbp/partials/<a>-rank_<r>.json   partial answers of the prompts rank r left unanswered at the stop of attempt a
                                      (a generation job; a hint the resume continues, see
                                      torch_batch_process.generation.partial_answers); named by the latest record
    _tbp/source_rows/<digest>.json    row counts of a streaming source's shards, counted once (see stream_counts)

The job lock is the stored job's (:mod:`torch_batch_process.jobstore.job_lock`,
:mod:`torch_batch_process.jobstore.lease`), built on what its storage offers (a local path, conditional writes); local
storage makes its scratch folders where the stored job says (``Storage.scratch_folder(SCRATCH_DIR, ...)``).

A *stage* is one rank's part of a commit: the files and state it committed together. With
``schedule="static"`` every rank commits at the same step and a stage number is the commit's number; with
``"dynamic"`` each rank commits on its own and its stages take numbers from a shared counter.
"""

from __future__ import annotations

__all__ = [
    "ATTEMPT_FILE",
    "COMMITS_DIR",
    "FAILURES_DIR",
    "INTERNAL_DIR",
    "JOB_FILE",
    "LEASE_FILE",
    "LOCK_FILE",
    "LOCK_INFO_FILE",
    "METRICS_FILE",
    "OUTPUTS_DIR",
    "PARTIALS_DIR",
    "RESULT_FILE",
    "RETRIES_DIR",
    "SCRATCH_DIR",
    "SEGMENTS_DIR",
    "STAGED_FAILURES_NAME",
    "STAGING_DIR",
    "SOURCE_ROWS_DIR",
    "STATES_DIR",
    "TENSORBOARD_DIR",
    "number_name",
    "failures_file",
    "outputs_dir",
    "partial_answers_file",
    "record_file",
    "segment_file",
    "segment_log_file",
    "source_rows_file",
    "staging_dir",
    "state_file",
    "tensorboard_dir",
]

SCRATCH_DIR = "_tbp/scratch"
"""Local storage: where folders are written before their files move into place (same filesystem as the outputs)."""
LOCK_FILE = "_tbp/lock"
"""The OS file lock of local storage."""
LOCK_INFO_FILE = "_tbp/lock.json"
"""Who holds the lock: host, pid, since when."""
LEASE_FILE = "_tbp/lease.json"
"""The job lease of object stores."""

INTERNAL_DIR = "_tbp"
JOB_FILE = f"{INTERNAL_DIR}/job.json"
ATTEMPT_FILE = f"{INTERNAL_DIR}/attempt.json"
COMMITS_DIR = f"{INTERNAL_DIR}/commits"
STATES_DIR = f"{INTERNAL_DIR}/states"
STAGING_DIR = f"{INTERNAL_DIR}/staging"
SEGMENTS_DIR = f"{INTERNAL_DIR}/segments"
"""Committed record rows not yet rolled into a published shard (see :mod:`torch_batch_process.outputs.segments`)."""
OUTPUTS_DIR = "outputs"
RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
FAILURES_DIR = "failures"
SOURCE_ROWS_DIR = f"{INTERNAL_DIR}/source_rows"
PARTIALS_DIR = f"{INTERNAL_DIR}/partials"
"""Partial answers a generation job's stop left (see :func:`partial_answers_file`)."""
RETRIES_DIR = "retries"
"""``retries/<k>/``: the k-th ``retry_failed=True`` run, a job of its own (see the retry module)."""
STAGED_FAILURES_NAME = "_tbp_failures.jsonl"
"""A rank stage's failure records, next to its files; publication moves them to :func:`failures_file`."""

_DIGITS = 8


def number_name(number: int) -> str:
    """Zero-padded name of a commit or stage number (names sort in number order)."""
    return f"{number:0{_DIGITS}d}"


def record_file(commit: int) -> str:
    """The commit record of commit ``commit``."""
    return f"{COMMITS_DIR}/{number_name(commit)}.json"


def segment_file(stage: int, rank: int, part: int = 0) -> str:
    """Part ``part`` of rank ``rank``'s record segment of stage ``stage`` (a new part when the rows' types widen)."""
    return f"{SEGMENTS_DIR}/{number_name(stage)}-rank_{rank}-{part}.arrow"


def segment_log_file(stage: int, rank: int, part: int = 0) -> str:
    """Rank ``rank``'s segment log whose first rows are of stage ``stage`` (part ``part``: a new log when the rows'
    types widen within the stage)."""
    return f"{SEGMENTS_DIR}/{number_name(stage)}-rank_{rank}-{part}.arrows"


def staging_dir(stage: int, rank: int | None = None) -> str:
    """The staged files of stage ``stage`` (of one rank when ``rank`` is given)."""
    base = f"{STAGING_DIR}/{number_name(stage)}"
    return base if rank is None else f"{base}/rank_{rank}"


def outputs_dir(stage: int, rank: int | None = None) -> str:
    """The published files of stage ``stage`` (of one rank when ``rank`` is given)."""
    base = f"{OUTPUTS_DIR}/commit_{number_name(stage)}"
    return base if rank is None else f"{base}/rank_{rank}"


def partial_answers_file(attempt: int, rank: int) -> str:
    """The partial answers rank ``rank`` left at the stop of attempt ``attempt`` (a rank stops once an attempt)."""
    return f"{PARTIALS_DIR}/{number_name(attempt)}-rank_{rank}.json"


def failures_file(stage: int, rank: int) -> str:
    """The published failure records of stage ``stage`` of rank ``rank``."""
    return f"{FAILURES_DIR}/{number_name(stage)}-rank_{rank}.jsonl"


def state_file(stage: int, rank: int) -> str:
    """Rank ``rank``'s state file at stage ``stage``."""
    return f"{STATES_DIR}/{number_name(stage)}/rank_{rank}.pt"


def tensorboard_dir(rank: int) -> str:
    """Rank ``rank``'s TensorBoard folder."""
    return f"{TENSORBOARD_DIR}/rank_{rank}"


def source_rows_file(digest: str) -> str:
    """The stored row counts of the source whose fingerprint has digest ``digest``."""
    return f"{SOURCE_ROWS_DIR}/{digest}.json"
