"""What one rank plots in TensorBoard while the job runs (see :mod:`~torch_batch_process.observe.tensorboard`
for the tags and the event files).

At every commit: the rank's ``report_metrics`` records and rank 0's reduced metrics. At most every
:data:`TB_SCALAR_INTERVAL_S` seconds, and at the end: rank 0's progress, and every rank's throughput and
seconds per phase over the commits since the last time. Event files are a convenience: a failure to write
them turns them off for the run, with a warning, and never fails the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_batch_process.observe.stragglers import RankInterval
from torch_batch_process.observe.summary import PHASES
from torch_batch_process.observe.tensorboard import TensorBoardLog
from torch_batch_process.result import to_jsonable

__all__ = ["TB_SCALAR_INTERVAL_S", "TensorBoardFeed"]

logger = logging.getLogger(__name__)

TB_SCALAR_INTERVAL_S = 10.0
"""Progress and throughput scalars go to TensorBoard at most this often (and at the end)."""


class TensorBoardFeed:
    """One rank's TensorBoard scalars.

    Args:
        folder: the rank's TensorBoard folder.
        rank: this rank.
        progress: rank 0's progress scalars (``examples_per_s``, ``fraction_done``, ``examples_committed``)
            given the examples committed, or ``None`` on the other ranks.
    """

    def __init__(self, folder: Path, rank: int, progress: Callable[[int], dict[str, float]] | None) -> None:
        self._rank = rank
        self._progress = progress
        self._log: TensorBoardLog | None = None
        try:
            self._log = TensorBoardLog(folder)
        except Exception as exc:  # noqa: BLE001 - event files are a convenience
            logger.warning("TensorBoard event files are off: cannot open %s (%s)", folder, exc)
        self._window = RankInterval(0, 0, {})  # this rank's work since the last scalars
        self._next_scalars = time.monotonic() + TB_SCALAR_INTERVAL_S

    @property
    def active(self) -> bool:
        """Whether event files are being written (not off after a failure)."""
        return self._log is not None

    def hparams(self, values: dict[str, Any], step: int) -> None:
        """The job's hyperparameters (rank 0, once per attempt)."""
        if self._log is None:
            return
        try:
            self._log.hparams(values, step)
        except Exception as exc:  # noqa: BLE001 - e.g. the tensorboard package cannot be imported
            self._off(exc)

    def on_commit(
        self, mine: RankInterval, own_records: list[dict[str, Any]], metrics: dict[str, Any] | None, batches: int,
        examples: int,
    ) -> None:
        """A commit is complete: ``mine`` is this rank's part of it, ``batches`` and ``examples`` the job's
        committed counts."""
        if self._log is None:
            return
        window = self._window
        window.batches += mine.batches
        window.examples += mine.examples
        for key, value in mine.timings.items():
            window.timings[key] = window.timings.get(key, 0.0) + value
        try:
            self._log.records(own_records)
            if metrics and self._rank == 0:
                self._log.scalars(to_jsonable(metrics), batches, "reduced")
            if time.monotonic() >= self._next_scalars:
                self._scalars(batches, examples)
        except Exception as exc:  # noqa: BLE001 - event files are a convenience
            self._off(exc)

    def flush(self) -> None:
        """Writes what was added to the event file (before the folder is uploaded)."""
        if self._log is None:
            return
        try:
            self._log.flush()
        except Exception as exc:  # noqa: BLE001 - e.g. the disk is full
            self._off(exc)

    def finish(self, batches: int, examples: int) -> None:
        """After the call's last commit: the last scalars."""
        if self._log is None:
            return
        try:
            self._scalars(batches, examples)
        except Exception as exc:  # noqa: BLE001
            logger.warning("writing TensorBoard event files failed: %s", exc)

    def close(self) -> None:
        """Closes the event file (always, when the call ends)."""
        log, self._log = self._log, None
        if log is None:
            return
        try:
            log.close()
        except Exception as exc:  # noqa: BLE001
            logger.warning("closing the TensorBoard event file failed: %s", exc)

    def _scalars(self, batches: int, examples: int) -> None:
        assert self._log is not None
        self._next_scalars = time.monotonic() + TB_SCALAR_INTERVAL_S
        if self._progress is not None:
            self._log.scalars(self._progress(examples), batches, "progress")
        window, self._window = self._window, RankInterval(0, 0, {})
        if window.batches:
            rate = window.examples / window.busy_s if window.busy_s > 0 else 0.0
            self._log.scalars({"examples_per_s": rate}, batches, "throughput")
            self._log.scalars({f"{key}_s": window.timings.get(key, 0.0) for key in PHASES}, batches, "time")

    def _off(self, exc: BaseException) -> None:
        logger.warning("writing TensorBoard event files failed (%s); they are off for this run", exc)
        self._log = None
