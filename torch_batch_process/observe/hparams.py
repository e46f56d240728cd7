"""The job config's hyperparameters as the observer logs them (``tbp run`` sets ``$TBP_HPARAMS``)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from torch_batch_process.environment import HPARAMS_ENV

__all__ = ["read_hparams"]

logger = logging.getLogger(__name__)


def read_hparams() -> dict[str, Any] | None:
    """The job config's hyperparameters from ``$TBP_HPARAMS`` (set by ``tbp run``), or None.

    None also when the variable is unset, empty, ``{}`` or not a JSON object (a warning then: the
    processor's ``context.get_hparams()`` raises for it; logging them is only a convenience).
    """
    raw = os.environ.get(HPARAMS_ENV)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        logger.warning("hyperparameters are not logged: %s is not valid JSON (%s)", HPARAMS_ENV, exc)
        return None
    if not isinstance(value, dict):
        logger.warning("hyperparameters are not logged: %s must hold a JSON object", HPARAMS_ENV)
        return None
    return value or None
