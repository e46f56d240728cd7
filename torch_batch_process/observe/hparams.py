"""The job config's hyperparameters as the observer logs them (``tbp run`` sets ``$TBP_HPARAMS``)."""

from __future__ import annotations

import logging
from typing import Any

from torch_batch_process import settings

__all__ = ["read_hparams"]

logger = logging.getLogger(__name__)


def read_hparams() -> dict[str, Any] | None:
    """The job config's hyperparameters from ``$TBP_HPARAMS`` (set by ``tbp run``; the call's settings), or None.

    None also when the variable is unset, empty, ``{}`` or not a JSON object (a warning then: the
    processor's ``context.get_hparams()`` raises for it; logging them is only a convenience).
    """
    hparams = settings.current().hparams
    if hparams.error is not None:
        logger.warning("hyperparameters are not logged: %s", hparams.error)
        return None
    return hparams.value or None
