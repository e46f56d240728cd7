"""Logging: the library logs through ``logging`` under ``torch_batch_process``, with the rank in each record.

When the application has configured no logging, the library adds one stderr handler: rank 0 shows
INFO and above (a few lines per job), the other ranks WARNING and above. Configure the
``torch_batch_process`` logger (or the root logger) to change that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback

LOGGER_NAME = "torch_batch_process"


class _RankFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.rank = 0

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _RankFormatter(logging.Formatter):
    """Also formats records of loggers created after :func:`setup_logging` (no filter on them yet)."""

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "rank"):
            record.rank = _filter.rank
        return super().format(record)


_filter = _RankFilter()
_handler: logging.Handler | None = None


def setup_logging(rank: int) -> None:
    """Tags records with ``rank`` and, if nothing is configured, shows them on stderr."""
    global _handler
    _filter.rank = rank
    logger = logging.getLogger(LOGGER_NAME)
    if _filter not in logger.filters:
        logger.addFilter(_filter)
    for child in list(logging.Logger.manager.loggerDict):
        if child.startswith(LOGGER_NAME + "."):
            child_logger = logging.getLogger(child)
            if _filter not in child_logger.filters:
                child_logger.addFilter(_filter)
    if _handler is None and not logging.getLogger().handlers and not logger.handlers:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(_RankFormatter("%(asctime)s [tbp rank %(rank)s] %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(_handler)
        logger.propagate = False
    if _handler is not None:
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def thread_stacks() -> str:
    """The Python stack of every thread of this process (logged before a process ends itself)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def end_process() -> None:
    """Ends this process at once with exit code 1 (``os._exit``: from a watching thread, while the main thread is
    blocked where nothing else can release it), after flushing the logs and the standard streams."""
    for handler in logging.getLogger().handlers + logging.getLogger(LOGGER_NAME).handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(1)
