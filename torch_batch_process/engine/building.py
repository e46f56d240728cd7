"""Building the processor on every rank: ``cls(context)``, its restored state, and the first agreement.

A resume with the same world size gives rank ``r`` the processor state rank ``r`` saved at the last commit;
with another world size, the classmethod ``merge_state_dicts(states)`` (when the class defines it) turns
the earlier ranks' states into the one every new rank loads. A resumed job must wrap the same reducers
(their summaries of earlier attempts are slots of the final reduction).

The first agreement follows: a failure while building, or a SIGTERM that came while the job was opened or
the processors were built, stops every rank before its first step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch_batch_process.context import TorchBatchProcessorContext
from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.engine.rank_failure import RankFailure
from torch_batch_process.errors import JobMismatchError
from torch_batch_process.jobstore.formats import CommitRecord
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.processor import TorchBatchProcessor

__all__ = ["build_processor"]

logger = logging.getLogger(__name__)


def build_processor(
    processor_cls: type[TorchBatchProcessor],
    context: TorchBatchProcessorContext,
    latest: CommitRecord | None,
    store: JobStore,
    collectives: Collectives,
    rank_failure: RankFailure,
    preempt_requested: Callable[[], bool],
) -> tuple[TorchBatchProcessor, bool]:
    """Builds and restores this rank's processor; returns it and whether the ranks agreed to stop at once.

    Raises on every rank when building failed on any rank.
    """
    processor: TorchBatchProcessor | None = None
    try:
        processor = processor_cls(context)
    except Exception as exc:  # noqa: BLE001 - every rank raises below
        rank_failure.record(exc, f"{processor_cls.__name__}.__init__")
    if processor is not None and not rank_failure.failed:
        try:
            _restore(processor, context, latest, store, collectives)
        except Exception as exc:  # noqa: BLE001
            rank_failure.record(exc, "restoring the processor state")
    answers = collectives.all_gather((rank_failure.info, preempt_requested()))
    rank_failure.raise_for([info for info, _ in answers])
    assert processor is not None
    return processor, any(preempt for _, preempt in answers)


def _restore(
    processor: TorchBatchProcessor,
    context: TorchBatchProcessorContext,
    latest: CommitRecord | None,
    store: JobStore,
    collectives: Collectives,
) -> None:
    signature = context.reducers.signature()
    if latest is None:
        return
    if latest.slot_files() and latest.reducers != signature:
        raise JobMismatchError(
            f"the processor registers reducers {signature} but the stored job used {latest.reducers}; a resumed "
            "job must wrap the same reducers (same order, names and types). Start afresh with resume=False "
            "or a new storage_path."
        )
    cls = type(processor)
    if latest.world_size == collectives.world_size:
        rank = collectives.rank
        rel = latest.state_files[rank] if rank < len(latest.state_files) else None
        if rel:
            state: Any = store.load_state(rel).get("processor")
            if state is not None:
                processor.load_state_dict(state)
    elif callable(getattr(cls, "merge_state_dicts", None)):
        states = [store.load_state(rel).get("processor") if rel else None for rel in latest.state_files]
        merged = cls.merge_state_dicts(states)  # type: ignore[attr-defined]
        if merged is not None:
            processor.load_state_dict(merged)
    elif cls.state_dict is not TorchBatchProcessor.state_dict and collectives.rank == 0:
        logger.warning(
            "the world size changed from %d to %d: processor states are not restored (they belong to the ranks of "
            "the earlier attempt; define the classmethod merge_state_dicts(states) to combine them); reducer "
            "metrics stay exact",
            latest.world_size,
            collectives.world_size,
        )
