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
    - ``on_finish()`` once when the whole dataset is processed (not when preempted).

    Define ``state_dict()`` / ``load_state_dict(state)`` to persist state with each commit.
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
        """Runs once per rank after every batch of the dataset is processed and committed."""

    def state_dict(self) -> Any:
        """Returns state to persist with each commit, or ``None`` (the default) for none."""
        return None

    def load_state_dict(self, state: Any) -> None:  # noqa: B027 - optional hook
        """Restores the state saved by ``state_dict()`` at the last commit, when resuming."""
