"""Provenance: which model versions and checkpoints a job used (Determined's ``report_task_using_*``).

In Determined these calls link the task to a model registry entry. Here they are recorded with the job:
each call becomes an entry of the commit records (``provenance``, shown by ``tbp status``) and a line of
``metrics.jsonl`` (group ``"provenance"``). An entry describes the object by the attributes Determined's
objects have (``uuid`` of a checkpoint; ``model_id``, ``model_version``, ``name`` and the checkpoint's
``uuid`` of a model version); a string or path is recorded as given; anything else by its ``repr``.
"""

from __future__ import annotations

import os
from typing import Any

_CHECKPOINT_ATTRS = ("uuid", "storage_id", "state")
_MODEL_VERSION_ATTRS = ("model_id", "model_version", "version", "name", "model_name")


def _plain(value: Any) -> Any:
    """``value`` if it is a JSON scalar, else its ``str``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def describe_checkpoint(checkpoint: Any) -> dict[str, Any]:
    """A JSON entry for a checkpoint: a Determined ``Checkpoint``, a path or URL, or any object."""
    entry: dict[str, Any] = {"kind": "checkpoint"}
    if isinstance(checkpoint, (str, os.PathLike)):
        entry["path"] = os.fspath(checkpoint)
        return entry
    found = {name: _plain(getattr(checkpoint, name)) for name in _CHECKPOINT_ATTRS if getattr(checkpoint, name, None) is not None}
    entry.update(found or {"repr": repr(checkpoint)[:500]})
    return entry


def describe_model_version(model_version: Any) -> dict[str, Any]:
    """A JSON entry for a model version: a Determined ``ModelVersion``, a string, or any object."""
    entry: dict[str, Any] = {"kind": "model_version"}
    if isinstance(model_version, (str, os.PathLike)):
        entry["name"] = os.fspath(model_version)
        return entry
    found = {name: _plain(getattr(model_version, name)) for name in _MODEL_VERSION_ATTRS if getattr(model_version, name, None) is not None}
    checkpoint = getattr(model_version, "checkpoint", None)
    if checkpoint is not None:
        found["checkpoint_uuid"] = _plain(getattr(checkpoint, "uuid", None) or checkpoint)
    entry.update(found or {"repr": repr(model_version)[:500]})
    return entry


def merge_entries(known: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``known`` followed by the entries of ``new`` not in it yet (ranks and resumes report the same ones)."""
    merged = list(known)
    for entry in new:
        if entry not in merged:
            merged.append(entry)
    return merged
