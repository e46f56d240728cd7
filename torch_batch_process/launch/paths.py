"""Storage paths in a job config: a URL stays as it is, a local path is made absolute against the config's
folder (so that a job started from anywhere finds the storage the config names)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["absolute_path"]


def absolute_path(path: str, base: Path) -> str:
    """A URL as is; a local path made absolute against the config's directory."""
    if "://" in path and not path.startswith("file://"):
        return path
    local = path[len("file://") :] if path.startswith("file://") else path
    local = os.path.expanduser(local)
    return str(Path(local) if os.path.isabs(local) else (base / local).resolve())
