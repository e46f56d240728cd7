"""The stored formats: a job's fingerprint (``_tbp/job.json``) and its commit records (``_tbp/commits/<n>.json``).

A commit record is the durable truth of a job: the set of committed global batches, the stages whose files
are committed (published or to be published), each rank's latest state file, the state files of earlier
attempts (their reducer summaries stay slots of the final reduction), and the reducers' signature. The
committer (:mod:`torch_batch_process.engine.commit.committer`) writes one atomically at each commit point.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch_batch_process import settings
from torch_batch_process.arguments import Script
from torch_batch_process.errors import CORRUPT_HINT, CheckpointCorruptError, JobMismatchError
from torch_batch_process.jobstore.memory_limits import MemoryLimits
from torch_batch_process.jobstore.ranges import RangeSet
from torch_batch_process.jobstore.schema import RecordSchema
from torch_batch_process.settings import ALLOW_SCRIPT_CHANGE_ENV

if TYPE_CHECKING:
    from torch_batch_process.arguments import JobArguments

__all__ = [
    "ALLOW_SCRIPT_CHANGE_ENV",
    "CommitRecord",
    "JobInfo",
    "JobSpec",
    "check_fingerprint",
    "check_script",
    "parse_json",
    "qualified_name",
]

logger = logging.getLogger(__name__)

RECORD_FORMAT = "torch_batch_process/commit/1"
JOB_FORMAT = "torch_batch_process/job/1"
DEFAULT_OUTPUT_FORMAT = "parquet"
"""The record shards' format when a spec names none."""


@dataclass
class JobSpec:
    """What identifies a job: a resume must match it exactly (its fingerprint)."""

    dataset_length: int
    batch_size: int
    processor: str
    """Module-qualified class name (``module.Class``): two jobs with the same class name differ."""
    max_batches: int | None
    dataset_type: str
    """Module-qualified type of the dataset."""
    plan: dict[str, Any] | None = None
    """The plan's own fingerprint (``None``: contiguous batches; bucketing and streams say more)."""
    output_format: str = DEFAULT_OUTPUT_FORMAT
    """Format of record shards: a resume in another format would mix formats (stored only when not the default)."""
    table: dict[str, Any] | None = None
    """The table target of record outputs (``table=``; its :meth:`~TableTarget.describe`), ``None``: shards."""
    keyed: dict[str, Any] | None = None
    """A keyed job's key and version (``key=``, DESIGN §21), ``None``: not keyed."""
    generation: dict[str, Any] | None = None
    """A generation job's engine, model, tokenizer, sampling and prompt (``generation.Generate``'s class attribute
    ``generation_fingerprint``), ``None``: no such processor."""

    @classmethod
    def of_call(cls, args: JobArguments, dataset_length: int, plan: dict[str, Any] | None) -> JobSpec:
        """The spec of a call's checked arguments (``dataset_length``: a source's rows, counted)."""
        return cls(
            dataset_length,
            args.batch_size,
            qualified_name(args.processor_cls),
            args.max_batches,
            qualified_name(type(args.dataset)),
            plan,
            output_format=args.output_format,
            table=_table_of(args),
            keyed=args.keyed.describe() if args.keyed is not None else None,
            generation=getattr(args.processor_cls, "generation_fingerprint", None),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset_length": self.dataset_length,
            "batch_size": self.batch_size,
            "processor": self.processor,
            "max_batches": self.max_batches,
            "dataset_type": self.dataset_type,
            **({"plan": self.plan} if self.plan is not None else {}),
            **self.outputs_entries(self.output_format, self.table),
            **({"keyed": self.keyed} if self.keyed is not None else {}),
            **({"generation": self.generation} if self.generation is not None else {}),
        }

    @staticmethod
    def outputs_entries(output_format: str, table: dict[str, Any] | None) -> dict[str, Any]:
        """Where a job writes its rows, as :meth:`to_json` stores it: ``output_format`` only when it is not the
        default (job files of earlier versions have none), ``table`` only with one."""
        return {
            **({"output_format": output_format} if output_format != DEFAULT_OUTPUT_FORMAT else {}),
            **({"table": table} if table is not None else {}),
        }

    @staticmethod
    def stored_outputs(spec: dict[str, Any]) -> dict[str, Any]:
        """``output_format`` and ``table`` of a stored spec (:meth:`to_json` read back), the defaults filled in."""
        return {"output_format": spec.get("output_format", DEFAULT_OUTPUT_FORMAT), "table": spec.get("table")}

    @classmethod
    def call_outputs(cls, args: JobArguments) -> dict[str, Any]:
        """:meth:`stored_outputs` of the spec a call with ``args`` stores (its table's description as JSON gives it
        back): what a run stored with a job (``retries/<k>/``) compares with the job's."""
        return cls.stored_outputs(json.loads(json.dumps(cls.outputs_entries(args.output_format, _table_of(args)))))

    def differences(self, stored: dict[str, Any]) -> list[str]:
        """Human-readable differences between this spec and a stored one."""
        mine = self.to_json()
        keys = sorted(set(mine) | set(stored))
        changed = [key for key in keys if stored.get(key) != mine.get(key)]
        return [f"{key}: stored {stored.get(key)!r}, now {mine.get(key)!r}" for key in changed]


def _table_of(args: JobArguments) -> dict[str, Any] | None:
    """The call's table target as a spec names it (its description), ``None``: shards."""
    return args.table.describe() if args.table is not None else None


@dataclass
class JobInfo:
    """Contents of ``_tbp/job.json``: the fingerprint and the plan fixed at the job's first start."""

    spec: dict[str, Any]
    planned_batches: int
    job_name: str
    created: float
    planned_examples: int | None = None
    """Examples in the planned batches (``None`` in job files of older versions: contiguous batches)."""
    script: Script | None = None
    """The script that started the job (``None``: an interactive session, or a job file of an older version)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": JOB_FORMAT,
            "spec": self.spec,
            "planned_batches": self.planned_batches,
            "planned_examples": self.planned_examples,
            "job_name": self.job_name,
            "created": self.created,
            **({"script": self.script.path, "workdir": self.script.workdir} if self.script is not None else {}),
        }

    @property
    def uid(self) -> str:
        """A name unique to this job (its name and the microsecond its job file was written): table outputs tag
        their data files and transactions with it (a job erased by ``resume=False`` and started again gets another)."""
        return f"{self.job_name}-{int(self.created * 1e6):x}"

    @property
    def examples_total(self) -> int:
        """Examples in the planned batches."""
        if self.planned_examples is not None:
            return self.planned_examples
        return min(self.planned_batches * int(self.spec["batch_size"]), int(self.spec["dataset_length"]))

    @classmethod
    def from_json(cls, value: Any, where: str) -> JobInfo:
        try:
            if value.get("format") != JOB_FORMAT:
                raise ValueError(f"unknown format {value.get('format')!r}")
            return cls(
                spec=dict(value["spec"]),
                planned_batches=int(value["planned_batches"]),
                job_name=str(value["job_name"]),
                created=float(value["created"]),
                planned_examples=int(value["planned_examples"]) if value.get("planned_examples") is not None else None,
                script=Script(str(value["script"]), str(value["workdir"])) if value.get("script") else None,
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            message = f"job file {where} is not a valid job record ({exc}). {CORRUPT_HINT}."
            raise CheckpointCorruptError(message) from exc


@dataclass
class CommitRecord:
    """A durable commit: the state of the job right after commit ``commit``."""

    commit: int
    attempt: int
    world_size: int
    committed: RangeSet
    state_files: list[str | None]
    """State file of each rank of this attempt at this commit (``None``: that rank wrote none)."""
    frozen_state_files: list[str]
    """Last state files of the ranks of earlier attempts: extra reducer slots."""
    reducers: list[dict[str, Any]]
    finished: bool = False
    result: dict[str, Any] | None = None
    time: float = field(default_factory=time.time)
    stats: dict[str, Any] = field(default_factory=dict)
    provenance: list[dict[str, Any]] = field(default_factory=list)
    """Model versions and checkpoints the job reported using (see :mod:`torch_batch_process.provenance`)."""
    stages: RangeSet | None = None
    """Stages whose files and states are committed; ``None`` (records of older versions): every stage up
    to ``commit`` (with ``schedule="static"`` stage numbers are commit numbers)."""
    last_stage: int = 0
    """The highest stage number used so far (committed or not): the next attempt numbers its stages after it."""
    output_stages: RangeSet | None = None
    """Committed stages with output files (``outputs/commit_<s>/`` exists once published); ``None`` (records of
    older versions, and the jobs resumed from them): unknown."""
    record_schema: RecordSchema | None = None
    """The schema of the committed record outputs (``context.write()``); ``None``: no rows committed yet."""
    table: dict[str, Any] | None = None
    """A table target's data files committed by this or earlier records and not yet seen in the table
    (``{"pending": [...]}``, see :mod:`torch_batch_process.outputs.tables.commits`); ``None``: none."""
    memory_limits: dict[str, Any] | None = None
    """What the job learned about the device's memory (the JSON form of
    :class:`~torch_batch_process.jobstore.memory_limits.MemoryLimits`); ``None``: nothing yet."""
    partial_answers: list[str] = field(default_factory=list)
    """A generation job's partial-answer files left by its stops (see
    :mod:`torch_batch_process.generation.partial_answers`): hints, not needed to resume (:meth:`hint_files`)."""
    generation_budget: dict[str, Any] | None = None
    """The KV-cache budget a generation job's engines learned (``on_oom="split"``): ``device``, ``cache_tokens``,
    ``batch_tokens``, ``max_sequences``, ``page_size``, ``ooms``; ``None``: none learned."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "commit": self.commit,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "committed": self.committed.to_json(),
            "state_files": self.state_files,
            "frozen_state_files": self.frozen_state_files,
            "reducers": self.reducers,
            "finished": self.finished,
            "result": self.result,
            "time": self.time,
            "stats": self.stats,
            "provenance": self.provenance,
            "stages": self.stages.to_json() if self.stages is not None else None,
            "last_stage": self.last_stage,
            "output_stages": self.output_stages.to_json() if self.output_stages is not None else None,
            "record_schema": self.record_schema.to_json() if self.record_schema is not None else None,
            **({"table": self.table} if self.table is not None else {}),
            "memory_limits": self.memory_limits,
            **({"partial_answers": self.partial_answers} if self.partial_answers else {}),
            **({"generation_budget": self.generation_budget} if self.generation_budget is not None else {}),
        }

    @classmethod
    def from_json(cls, value: Any, where: str) -> CommitRecord:
        try:
            if value.get("format") != RECORD_FORMAT:
                raise ValueError(f"unknown format {value.get('format')!r}")
            return cls(
                commit=int(value["commit"]),
                attempt=int(value["attempt"]),
                world_size=int(value["world_size"]),
                committed=RangeSet.from_json(value["committed"]),
                state_files=list(value["state_files"]),
                frozen_state_files=list(value["frozen_state_files"]),
                reducers=list(value["reducers"]),
                finished=bool(value["finished"]),
                result=value.get("result"),
                time=float(value["time"]),
                stats=dict(value.get("stats") or {}),
                provenance=list(value.get("provenance") or []),
                stages=RangeSet.from_json(value["stages"]) if value.get("stages") is not None else None,
                last_stage=int(value.get("last_stage") or value["commit"]),
                output_stages=(
                    RangeSet.from_json(value["output_stages"]) if value.get("output_stages") is not None else None
                ),
                record_schema=_record_schema(value.get("record_schema"), where),
                table=dict(value["table"]) if value.get("table") is not None else None,
                memory_limits=_memory_limits(value.get("memory_limits")),
                partial_answers=[str(rel) for rel in value.get("partial_answers") or []],
                generation_budget=_generation_budget(value.get("generation_budget")),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            message = f"commit record {where} is not a valid record ({exc}). {CORRUPT_HINT}."
            raise CheckpointCorruptError(message) from exc

    def referenced_files(self) -> set[str]:
        """State files this record needs."""
        return {f for f in self.state_files if f} | set(self.frozen_state_files)

    def hint_files(self) -> set[str]:
        """Files this record names that a resume may do without (partial answers): kept while it is the latest,
        deleted once superseded, never required."""
        return set(self.partial_answers)

    def has_stage(self, stage: int) -> bool:
        """Whether the files of ``stage`` are committed by this record."""
        return stage in self.stages if self.stages is not None else stage <= self.commit

    def slot_files(self) -> list[str]:
        """State files whose reducer summaries are slots of the final reduction."""
        return list(self.frozen_state_files) + [f for f in self.state_files if f]


def _record_schema(value: Any, where: str) -> RecordSchema | None:
    return None if value is None else RecordSchema.from_json(value, where)  # pyarrow: only for jobs with records


def _memory_limits(value: Any) -> dict[str, Any] | None:
    if value is not None:
        MemoryLimits.from_json(value)  # a ValueError names what is wrong
    return value


def _generation_budget(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    budget = dict(value)
    for name in ("cache_tokens", "batch_tokens"):
        if not isinstance(budget.get(name), int) or budget[name] < 1:
            raise ValueError(f"generation_budget.{name} is {budget.get(name)!r}, not a positive int")
    return budget


def qualified_name(cls: type) -> str:
    """``module.QualifiedName`` of a class, as stored in a job's fingerprint."""
    return f"{cls.__module__}.{cls.__qualname__}"


def parse_json(raw: bytes, where: str) -> Any:
    """Parses a stored JSON file; a :class:`CheckpointCorruptError` naming it when it is not JSON."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{where} is corrupt ({exc}). {CORRUPT_HINT}."
        ) from exc


def check_fingerprint(job: JobInfo, spec: JobSpec, url: str, run_of: str | None = None) -> None:
    """Raises :class:`JobMismatchError` when the stored job is not this one (``run_of``: the URL of the job whose
    unfinished run, ``retries/<k>``, is stored at ``url``: its advice is to finish the run, since ``resume=False``
    would erase the whole job)."""
    differences = spec.differences(job.spec)
    if differences and run_of is not None:
        raise JobMismatchError(
            f"the job at {run_of!r} has an unfinished run ({url}) that started with other settings "
            f"({'; '.join(differences)}). Nothing was changed. Call again with the settings it started with to finish "
            "it (a run resumes with its own plan); then the next run takes the new ones. resume=False would erase "
            "the whole job, every run included"
        )
    if differences:
        raise JobMismatchError(
            f"storage_path {url!r} holds another job ({'; '.join(differences)}). Nothing was changed. "
            "To resume it, run it with its original settings; to start this job afresh there, pass "
            "resume=False (this erases the stored progress and outputs), or use a new storage_path or job_name "
            "(a second job in the same script needs one of its own: the default ./tbp_runs/<job_name> is named after "
            "the script)."
        )




def check_script(job: JobInfo, script: Script | None, url: str) -> None:
    """Raises :class:`JobMismatchError` when another script started the stored job (before anything is written).

    The fingerprint cannot tell two scripts apart when their processors have the same name (``__main__.P``)
    and their datasets the same length, and the default storage path (``./tbp_runs/<script stem>``) is the same
    for ``a/job.py`` and ``b/job.py`` started from one folder: the second would resume, or return the result of,
    the first. So the job file records the script that started the job, and a call from another script is
    refused. The same script is the same file, or the same path from the working directory (a moved checkout, a
    cluster that copies the code to a new folder for each run); ``python job.py``, ``python -m``, torchrun, the
    library's launcher and ``tbp run`` all run the same ``__main__`` file. Nothing is checked when either side has
    no script (an interactive session, where a storage path or job name is required, or a job file written
    before scripts were recorded). ``TBP_ALLOW_SCRIPT_CHANGE=1`` resumes anyway (a renamed script), with a
    warning.
    """
    if job.script is None or script is None or job.script.same_as(script):
        return
    if settings.current().allow_script_change:
        logger.warning(
            "storage_path %s holds a job started by %s; resuming it from %s (%s=1)",
            url, job.script.path, script.path, ALLOW_SCRIPT_CHANGE_ENV,
        )
        return
    raise JobMismatchError(
        f"storage_path {url!r} holds a job started by another script: {job.script.path} (this is {script.path}). "
        "Nothing was changed. Two scripts of the same name share the default ./tbp_runs/<script name>: give this "
        "one its own storage_path=... or job_name=..., or pass resume=False to erase the stored job and start this "
        f"one there. If it is the same script, renamed or moved, run it as before, or set {ALLOW_SCRIPT_CHANGE_ENV}=1 "
        "to resume the stored job from this one."
    )
