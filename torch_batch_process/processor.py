"""The user's side of the contract: a :class:`TorchBatchProcessor` subclass."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_batch_process.context import TorchBatchProcessorContext


class TorchBatchProcessor(metaclass=abc.ABCMeta):
    """Per-rank processing logic, driven by :func:`torch_batch_process`.

    The class (not an instance) is given to :func:`torch_batch_process`, which builds one instance
    per rank as ``cls(context)`` and calls its hooks:

    - ``process_batch(batch, batch_idx)`` for each batch dealt to this rank, under
      ``torch.inference_mode()`` unless disabled;
    - ``on_checkpoint_start()`` before every commit, the same number of times on every rank;
    - ``on_finish()`` once when the whole dataset is processed (not when preempted);

    the two hooks run in the mode ``process_batch`` runs in (``torch.inference_mode()`` unless disabled), so they
    may update its tensors in place.

    Define ``state_dict()`` / ``load_state_dict(state)`` to persist state with each commit. A resume with
    the same world size gives rank ``r`` the state rank ``r`` saved. A resume with another world size gives
    the states to the classmethod ``merge_state_dicts(states)`` when the class defines it (opt-in): it
    receives the earlier ranks' states (``None`` for a rank that saved none), in rank order, and returns the
    state that every new rank's ``load_state_dict`` receives (use ``self.context.get_distributed_rank()``
    there to keep, e.g., a merged counter on one rank only). Without it, states are not restored then.
    """

    def __init__(self, context: TorchBatchProcessorContext) -> None:  # noqa: B027 - meant to be overridden
        """Builds per-rank resources (model, clients...) with the help of ``context``."""

    @abc.abstractmethod
    def process_batch(self, batch: Any, batch_idx: int) -> None:
        """Processes one batch.

        Args:
            batch: what the DataLoader yields for this batch (collated examples).
            batch_idx: the *global* batch index ``g``: the batch holds examples
                ``[g * batch_size, (g + 1) * batch_size)`` of the dataset. It is unique across ranks and
                resumes, so it makes a good output file name.
        """

    def on_checkpoint_start(self) -> None:  # noqa: B027 - optional hook
        """Runs on every rank right before each commit; flush buffered outputs here."""

    def on_finish(self) -> None:  # noqa: B027 - optional hook
        """Runs once per rank after every batch of the dataset is processed and committed, once every rank's files
        are published under ``<storage_path>/outputs/`` (rank 0 may gather them there)."""

    def state_dict(self) -> Any:
        """Returns state to persist with each commit, or ``None`` (the default) for none."""
        return None

    def load_state_dict(self, state: Any) -> None:  # noqa: B027 - optional hook
        """Restores the state saved by ``state_dict()`` at the last commit, when resuming."""
