"""Facts about other processes on this machine."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists on this machine (one we may not signal counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
