"""TensorBoard: each rank's event files in ``context.get_tensorboard_path()``, and their upload.

Event files are written with ``torch.utils.tensorboard.SummaryWriter`` (only when the
``tensorboard`` package is installed: extra ``tensorboard``). Each rank writes its own folder
``rank_<r>``, so TensorBoard shows the ranks as runs side by side. Tags:

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
import logging
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 120.0  # importing tensorboard on a loaded machine: seconds, never minutes


class TensorBoardLog:
    """One rank's event file (``SummaryWriter``), opened in the background.

    Importing ``torch.utils.tensorboard`` (tensorboard, protobuf) takes ~0.2 s, as long as a whole
    short job's other start-up. :meth:`open_in_background` does it in a thread, overlapped with the
    first steps; values added before the writer is ready are kept and written once it is.
    The loop calls it after its DataLoader workers are started, so that no ``fork`` happens while the
    thread holds an import lock. Without that call, the first use opens the writer in place.
    """

    def __init__(self, local_dir: Path, *, flush_secs: int = 10) -> None:
        local_dir.mkdir(parents=True, exist_ok=True)
        self._local_dir = local_dir
        self._flush_secs = flush_secs
        self._writer: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending: list[tuple[str, float, int]] = []
        self._pending_hparams: list[tuple[dict[str, Any], int]] = []

    def open_in_background(self) -> None:
        """Starts opening the writer in a daemon thread (once)."""
        if self._thread is None and not self._ready.is_set():
            self._thread = threading.Thread(target=self._open, name="tbp-tensorboard-open", daemon=True)
            self._thread.start()

    def _open(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self._local_dir), flush_secs=self._flush_secs)
        except Exception as exc:  # noqa: BLE001 - reported at the next use, on the loop's thread
            self._error = exc
        finally:
            self._ready.set()

    def _get_writer(self, *, wait: bool) -> Any:
        """The writer, or None while it is still opening (``wait=False``); raises if opening failed."""
        if not self._ready.is_set():
            if self._thread is None:
                self._open()  # never started in the background: open it here
            elif not wait:
                return None
            elif not self._ready.wait(OPEN_TIMEOUT_S):
                raise TimeoutError(f"opening the TensorBoard event file took more than {OPEN_TIMEOUT_S:g} s")
        if self._error is not None:
            raise self._error
        if self._writer is None:
            raise RuntimeError("the TensorBoard event file could not be opened")
        for tag, value, step in self._pending:
            self._writer.add_scalar(tag, value, step)
        self._pending.clear()
        while self._pending_hparams:
            _write_hparams(self._writer, *self._pending_hparams.pop(0))
        return self._writer

    def hparams(self, values: dict[str, Any], step: int) -> None:
        """Adds hyperparameters (a Text table and the HParams tab's session) at ``step``.

        Kept until the writer is open; it never opens the writer itself (see :meth:`open_in_background`).
        """
        self._pending_hparams.append((dict(values), step))
        if self._ready.is_set():
            self._get_writer(wait=False)

    def scalars(self, values: dict[str, Any], step: int, prefix: str = "") -> None:
        """Adds every number of ``values`` (flattening nested dicts) as a scalar at ``step``."""
        writer = self._get_writer(wait=False)
        for key, value in values.items():
            tag = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, dict):
                self.scalars(value, step, tag)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                if writer is None:
                    self._pending.append((tag, value, step))
                else:
                    writer.add_scalar(tag, value, step)

    def records(self, records: list[dict[str, Any]]) -> None:
        """Adds ``report_metrics`` records (``group``, ``steps_completed``, ``metrics``)."""
        for record in records:
            self.scalars(record["metrics"], record["steps_completed"], record["group"])

    def flush(self) -> None:
        """Writes what was added to the event file (waits for the writer when it is still opening)."""
        self._get_writer(wait=True).flush()

    def close(self) -> None:
        self._get_writer(wait=True).close()


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


def _write_hparams(writer: Any, values: dict[str, Any], step: int) -> None:
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    writer.add_text("hparams", hparams_markdown(values), step)
    flat = flatten_hparams(values)
    if flat:
        # Only the session's start info: without an experiment summary, TensorBoard's HParams tab
        # builds the experiment itself and lists the run's scalars (reduced/..., progress/...) as metrics.
        _, session_start, _ = hparams_summaries(flat, {})
        writer.file_writer.add_summary(session_start, step)


