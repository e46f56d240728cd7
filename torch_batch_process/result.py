"""The result of a job, returned by :func:`torch_batch_process` on every rank."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class BatchProcessResult:
    """What a call of :func:`torch_batch_process` did. Identical on every rank.

    Attributes:
        metrics: the reduced metrics of every wrapped reducer, over the whole job (all attempts).
            Empty while the job is not finished (preempted).
        preempted: the job stopped early on SIGTERM/SIGINT after committing; run it again to resume.
        finished: every batch of the job is processed and committed.
        already_finished: the job had finished before this call, which did no work.
        storage_path: where the job's records and outputs are (of a ``retry_failed=True`` or ``incremental=True`` run
            too: the job's path, where its rows are read back, not its run folder ``retries/<k>``).
        outputs_path: where the committed ``upload_path()`` files are (``<storage_path>/outputs``).
        num_batches: global batches in the job (after ``max_batches``).
        num_examples: examples in those batches.
        batches_committed: batches committed so far, over all attempts.
        examples_committed: examples in them.
        batches_processed: batches processed by this call, over all ranks.
        examples_processed: examples in them.
        batches_skipped: batches already committed when this call started (resume).
        attempt: 1 for the first run of the job, 2 for its first resume, ...
        world_size: number of ranks of this call.
        commits: commits made by this call.
        elapsed_s: wall time of this call, in seconds.
        timings: seconds spent per phase, summed over ranks: ``data`` (waiting for the data loader),
            ``process`` (in ``process_batch``), ``commit`` (saving and committing), ``hooks``
            (``__init__``, ``on_checkpoint_start``, ``on_finish``).
        timings_per_rank: the same seconds for each rank (index = rank), to spot a slow one.
        failed_examples: examples that failed and were skipped (``on_error="skip"``), committed, over all
            attempts; listed in ``<storage_path>/failures/`` (``tbp failures STORAGE``).
        ooms: out-of-memory errors this call's ranks met and recovered from (``on_oom="split"``, DESIGN §15), a
            generation engine's included.
        split_batches: batches this call ran in parts to fit in the device's memory.
        memory_limits: what the job learned about the device's memory, over all attempts (``None``: it never ran
            out): ``unit`` (``"tokens"``, i.e. ``len(batch) * max length``, with ``bucket_by``; else
            ``"examples"``), ``budget`` (the largest size known to fit for the longest examples that met a
            limit: with ``bucket_by``, the ``max_tokens`` it learned), ``ranges`` (per length range: ``lengths``,
            ``fits``, ``oom``) and ``text`` (the same in one line, as logged).
        generation_budget: the KV-cache budget a generation job's engine learned with ``on_oom="split"``, over all
            attempts (``None``: it never ran out of memory): ``device``, ``cache_tokens``, ``batch_tokens``,
            ``max_sequences``, ``page_size``, ``ooms``; a resumed job's engines start within it (DESIGN §19).
        increment: an incremental run's counts (``incremental=True``, DESIGN §21): ``total``, ``new``, ``changed``,
            ``recompute``, ``unchanged``, ``removed`` (keys gone from the dataset, kept), ``selected``...;
            ``None`` for other calls.
    """

    metrics: dict[str, Any]
    preempted: bool
    finished: bool
    storage_path: str
    outputs_path: str
    num_batches: int
    num_examples: int
    batches_committed: int
    examples_committed: int
    batches_processed: int
    examples_processed: int
    batches_skipped: int
    attempt: int
    world_size: int
    commits: int
    elapsed_s: float
    already_finished: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    timings_per_rank: list[dict[str, float]] = field(default_factory=list)
    failed_examples: int = 0
    ooms: int = 0
    split_batches: int = 0
    memory_limits: dict[str, Any] | None = None
    generation_budget: dict[str, Any] | None = None
    increment: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict (tensors and numpy values become plain numbers)."""
        return {key: to_jsonable(value) for key, value in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, value: dict[str, Any], **overrides: Any) -> BatchProcessResult:
        names = {f.name for f in dataclasses.fields(cls)}
        data = {key: val for key, val in value.items() if key in names}
        data.update(overrides)
        return cls(**data)


def to_jsonable(value: Any) -> Any:
    """Turns tensors and numpy values (nested in dicts and lists) into plain Python values."""
    if isinstance(value, torch.Tensor):
        return to_jsonable(value.item() if value.numel() == 1 else value.tolist())
    if type(value).__module__ == "numpy":
        item = value.item() if getattr(value, "ndim", 0) == 0 else value.tolist()
        return to_jsonable(item)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)
