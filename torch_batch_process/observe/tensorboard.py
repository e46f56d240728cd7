"""TensorBoard: each rank's event files in ``context.get_tensorboard_path()``, and their upload.

Event files are written by :class:`~torch_batch_process.observe.event_file.EventFile` (only when the
``tensorboard`` package is installed: extra ``tensorboard``); TensorBoard reads them as its own. Each rank
writes its own folder ``rank_<r>``, so TensorBoard shows the ranks as runs side by side. Tags:

- ``<group>/<name>``: numbers of ``report_metrics(group, steps_completed, metrics)`` at step
  ``steps_completed`` (nested dicts are flattened with ``/``; strings and lists are only in JSONL).
- ``reduced/<name>``: reduced metrics (rank 0) at step = batches committed, when computed.
- ``progress/examples_per_s``, ``progress/fraction_done``, ``progress/examples_committed`` (rank 0)
  and ``throughput/examples_per_s``, ``time/<phase>_s`` (every rank: its own busy rate and seconds
  per phase), at step = batches committed, at most every 10 seconds and at the end.
- ``hparams`` (rank 0, once per attempt, at step = batches committed when it started): the job
  config's ``hyperparameters`` (``tbp run``, what ``context.get_hparams()`` returns), as a table in
  the Text tab and as the run's hyperparameters in the HParams tab (nested keys joined with ``/``,
  lists and other values as JSON text); the HParams tab lists the run's scalars as its metrics.

For local storage the folder *is* ``<storage_path>/tensorboard/rank_<r>``. For object stores it is a
fresh local temporary folder whose new or changed files (these event files, profiler traces, and whatever
the processor writes there) are uploaded to ``<storage_path>/tensorboard/rank_<r>/`` at commits (at most
every 30 seconds) and when the job returns (``storage.mirrored_folder``); the temporary folder is then
deleted. Point TensorBoard at ``<storage_path>/tensorboard``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from torch_batch_process.observe.event_file import EventFile

FLUSH_S = 10.0
"""Values written are on disk at most this long after they are added (and at :meth:`TensorBoardLog.flush`)."""


class TensorBoardLog:
    """One rank's event file, opened at its first use (see :mod:`~torch_batch_process.observe.event_file` for why
    the library writes it itself: no thread, no heavy import during the job). Raises ``ImportError`` at the
    first use when the ``tensorboard`` package is not installed."""

    def __init__(self, local_dir: Path, *, flush_s: float = FLUSH_S) -> None:
        local_dir.mkdir(parents=True, exist_ok=True)
        self._local_dir = local_dir
        self._flush_s = flush_s
        self._file: EventFile | None = None
        self._flushed = time.monotonic()

    def _open(self) -> EventFile:
        if self._file is None:
            self._file = EventFile(self._local_dir)
        return self._file

    def hparams(self, values: dict[str, Any], step: int) -> None:
        """Adds hyperparameters: a Markdown table (the Text tab) and the HParams tab's session, at ``step``."""
        file = self._open()
        file.text("hparams", hparams_markdown(values), step)
        flat = flatten_hparams(values)
        if flat:
            # Only the session's start info: without an experiment summary, TensorBoard's HParams tab
            # builds the experiment itself and lists the run's scalars (reduced/..., progress/...) as metrics.
            file.hparams(flat, step)
        self._due()

    def scalars(self, values: dict[str, Any], step: int, prefix: str = "") -> None:
        """Adds every number of ``values`` (flattening nested dicts) as a scalar at ``step``."""
        self._scalars(self._open(), values, step, prefix)
        self._due()

    def _scalars(self, file: EventFile, values: dict[str, Any], step: int, prefix: str) -> None:
        for key, value in values.items():
            tag = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, dict):
                self._scalars(file, value, step, tag)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                file.scalar(tag, value, step)

    def records(self, records: list[dict[str, Any]]) -> None:
        """Adds ``report_metrics`` records (``group``, ``steps_completed``, ``metrics``)."""
        for record in records:
            self.scalars(record["metrics"], record["steps_completed"], record["group"])

    def flush(self) -> None:
        """Writes what was added to the event file."""
        if self._file is not None:
            self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _due(self) -> None:
        if time.monotonic() - self._flushed >= self._flush_s:
            self.flush()


def flatten_hparams(values: dict[str, Any], prefix: str = "") -> dict[str, float | str]:
    """Nested hyperparameters as ``{"a/b": value}``: numbers and strings kept, booleans, lists and
    the rest as JSON text, ``None`` left out (what TensorBoard's HParams tab can show)."""
    flat: dict[str, float | str] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flatten_hparams(value, name))
        elif value is None:
            continue
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, sort_keys=True, default=str)
    return flat


def hparams_markdown(values: dict[str, Any]) -> str:
    """A Markdown table (TensorBoard's Text tab renders it) of the flattened hyperparameters."""
    rows = ["| hyperparameter | value |", "|---|---|"]
    for name, value in sorted(flatten_hparams(values).items()):
        rows.append(f"| {_cell(name)} | {_cell(value if isinstance(value, str) else repr(value))} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
