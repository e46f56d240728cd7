"""The one-line summary of a call that rank 0 logs at its end."""

from __future__ import annotations

from torch_batch_process.result import BatchProcessResult

__all__ = ["PHASES", "summary_line"]

PHASES = ("data", "process", "commit", "hooks")
"""Where a rank's time goes (``result.timings``)."""


def summary_line(result: BatchProcessResult) -> str:
    """One line: what the call did, its rate, and where the time went (total and slowest rank)."""
    how = "preempted" if result.preempted else "finished" if result.finished else "stopped"
    rate = result.examples_processed / result.elapsed_s if result.elapsed_s > 0 else 0.0
    per_rank = result.timings_per_rank or []
    phases = []
    for key in PHASES:
        if key not in result.timings:
            continue
        slowest = max((t.get(key, 0.0) for t in per_rank), default=0.0)
        phases.append(f"{key} {result.timings[key]:.2f}/{slowest:.2f}")
    busy = [t.get("data", 0.0) + t.get("process", 0.0) for t in per_rank]
    slowest_rank = f"; busiest rank {max(range(len(busy)), key=busy.__getitem__)}" if len(busy) > 1 else ""
    return (
        f"{how}: {result.examples_processed} examples ({result.batches_processed} batches) processed in "
        f"{result.elapsed_s:.1f} s on {result.world_size} rank(s), {rate:.1f} examples/s; "
        f"{result.examples_committed}/{result.num_examples} examples committed "
        f"({100.0 * result.examples_committed / result.num_examples if result.num_examples else 100.0:.1f}%); "
        f"seconds sum/max over ranks: {', '.join(phases) or 'none'}{slowest_rank}"
    )
