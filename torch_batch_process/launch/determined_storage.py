"""Determined's own ``checkpoint_storage`` mappings, read as the job's storage, so that an experiment config's
storage section runs unchanged under ``tbp run``.

==============  ==========================================================  =====================================
``type``        Determined's keys                                           storage
==============  ==========================================================  =====================================
``shared_fs``   ``host_path``, ``storage_path`` (in it; default: itself),   the local folder
                ``propagation`` (a mount option: ignored)
``directory``   ``container_path``                                          the local folder
``s3``          ``bucket``, ``prefix``, ``access_key``, ``secret_key``,     ``s3://bucket/prefix`` (keys and
                ``endpoint_url``                                            endpoint as fsspec options)
``gcs``         ``bucket``, ``prefix``                                      ``gs://bucket/prefix``
``azure``       ``container``, ``connection_string``, ``account_url``,      ``az://container`` (as adlfs options)
                ``credential``
==============  ==========================================================  =====================================

Determined's checkpoint garbage-collection keys (``save_experiment_best``, ``save_trial_best``,
``save_trial_latest``) are accepted and have no effect: the library keeps no model checkpoints to collect.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from torch_batch_process.launch.config_lines import KeyLines, type_name
from torch_batch_process.launch.paths import absolute_path

__all__ = ["DETERMINED_STORAGE_KEYS", "determined_storage"]

_GC_KEYS = ("save_experiment_best", "save_trial_best", "save_trial_latest")
DETERMINED_STORAGE_KEYS: dict[str, tuple[str, ...]] = {
    "shared_fs": ("host_path", "storage_path", "propagation"),
    "directory": ("container_path",),
    "s3": ("bucket", "prefix", "access_key", "secret_key", "endpoint_url"),
    "gcs": ("bucket", "prefix"),
    "azure": ("container", "connection_string", "account_url", "credential"),
}
"""The keys of each of Determined's storage types (besides ``type`` and the garbage-collection keys)."""

_REQUIRED = {"shared_fs": "host_path", "directory": "container_path", "s3": "bucket", "gcs": "bucket",
             "azure": "container"}  # fmt: skip


def determined_storage(
    value: dict[str, Any], base: Path, lines: KeyLines
) -> tuple[str, dict[str, Any] | None] | None:
    """The storage path and fsspec options of a ``checkpoint_storage`` mapping in Determined's shape, or ``None``
    when it is not in that shape (the library's own ``type``/``path``/``storage_options`` mapping).

    Raises:
        ConfigError: a Determined mapping with an unknown key, a missing or non-string value; naming the line.
    """
    kind = value.get("type")
    if kind not in DETERMINED_STORAGE_KEYS or "path" in value or "storage_options" in value:
        return None
    key = ("checkpoint_storage",)
    allowed = ("type", *DETERMINED_STORAGE_KEYS[kind], *_GC_KEYS)
    for name in value:
        if name not in allowed:
            message = f"unknown key for type {kind!r}; the keys allowed are {', '.join(allowed)}"
            raise lines.error(key + (name,), message)
    fields: dict[str, str] = {}
    for name in DETERMINED_STORAGE_KEYS[kind]:
        item = value.get(name)
        if item is None:
            continue
        if not isinstance(item, str) or not item.strip():
            raise lines.error(key + (name,), f"must be a non-empty string, got {type_name(item)}")
        fields[name] = item.strip()
    for name in ("bucket", "container"):
        if name in fields and ("/" in fields[name] or ":" in fields[name]):
            message = f"must be the {name}'s name alone, got {fields[name]!r}; give a path inside it as prefix"
            raise lines.error(key + (name,), message)
    required = _REQUIRED[kind]
    if required not in fields:
        raise lines.error(key, f"type {kind!r} needs {required}")
    if kind in ("shared_fs", "directory"):
        return _local(kind, fields, base, lines), None
    return _remote(kind, fields)


def _local(kind: str, fields: dict[str, str], base: Path, lines: KeyLines) -> str:
    if kind == "directory":
        return absolute_path(fields["container_path"], base)
    host = absolute_path(fields["host_path"], base)
    inner = fields.get("storage_path")
    if inner is None:
        return host
    path = inner if os.path.isabs(inner) else os.path.join(host, inner)
    path = os.path.normpath(path)
    if os.path.commonpath([path, host]) != host:
        message = f"must be inside host_path {host!r} (as in Determined), got {inner!r}"
        raise lines.error(("checkpoint_storage", "storage_path"), message)
    return path


def _remote(kind: str, fields: dict[str, str]) -> tuple[str, dict[str, Any] | None]:
    options: dict[str, Any] = {}
    if kind == "azure":
        for name in ("connection_string", "credential"):
            if name in fields:
                options[name] = fields[name]
        if "account_url" in fields:
            options["account_name"] = (urlparse(fields["account_url"]).hostname or "").split(".")[0]
        return f"az://{fields['container']}", options or None
    protocol = "s3" if kind == "s3" else "gs"
    prefix = fields.get("prefix", "").strip("/")
    if kind == "s3":
        names = {"access_key": "key", "secret_key": "secret", "endpoint_url": "endpoint_url"}
        options = {names[name]: fields[name] for name in names if name in fields}
    url = f"{protocol}://{fields['bucket']}" + (f"/{prefix}" if prefix else "")
    return url, options or None
