"""What a call did, as rank 0 counted it from the votes: the same result on every rank comes from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Summary"]


@dataclass
class Summary:
    """The call's counts (the commit protocol's) and its participants' (failing examples, memory)."""

    batches_committed: int = 0
    examples_committed: int = 0
    batches_processed: int = 0
    examples_processed: int = 0
    commits: int = 0
    failed_examples: int = 0
    """Examples recorded as failed (``on_error="skip"``), committed, over all attempts."""
    ooms: int = 0
    """Out-of-memory errors the call's ranks met (``on_oom="split"``)."""
    split_batches: int = 0
    """Batches the call's ranks ran in parts to fit in the device's memory."""
    memory_limits: dict[str, Any] | None = None
    """What the job learned about the device's memory, over all attempts
    (:meth:`~torch_batch_process.jobstore.memory_limits.MemoryLimits.summary`); ``None``: nothing."""
    engine_ooms: int = 0
    """Out-of-memory errors the call's generation engines met (each restarted with a smaller budget)."""
    generation_budget: dict[str, Any] | None = None
    """The KV-cache budget a generation job learned, over all attempts (the record's ``generation_budget``)."""
    timings: dict[str, float] = field(default_factory=dict)
    timings_per_rank: list[dict[str, float]] = field(default_factory=list)
    elapsed_s: float = 0.0
