"""Profiling: ``torch.profiler`` over a few steps of chosen ranks, traces under the TensorBoard path.

With ``profile=True`` (or a dict, see :mod:`torch_batch_process.observe.options`), the chosen ranks
run ``torch.profiler.profile`` with the schedule ``wait`` steps skipped, ``warmup`` steps warmed up,
``active`` steps recorded, once; the trace is written by ``torch.profiler.tensorboard_trace_handler``
as ``rank_<r>.<time>.pt.trace.json`` in ``context.get_tensorboard_path()`` (open it with TensorBoard's
profiler plugin, ``chrome://tracing`` or Perfetto). The profiler stops right after, so the rest of
the job runs without its overhead. CPU activity is always recorded, CUDA activity on CUDA devices.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from torch_batch_process.observe.options import ProfileOptions

logger = logging.getLogger(__name__)


class StepProfiler:
    """Runs ``torch.profiler`` over the first ``wait + warmup + active`` steps of this rank."""

    def __init__(self, options: ProfileOptions, out_dir: Path, rank: int, device: torch.device) -> None:
        self.out_dir = out_dir
        self._steps_left = options.wait + options.warmup + options.active
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        out_dir.mkdir(parents=True, exist_ok=True)
        self._profiler: torch.profiler.profile | None = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=options.wait, warmup=options.warmup, active=options.active, repeat=1
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(out_dir), worker_name=f"rank_{rank}"),
            record_shapes=options.record_shapes,
            profile_memory=options.profile_memory,
            with_stack=options.with_stack,
        )
        self._profiler.start()
        logger.info(
            "profiling steps %d to %d of this attempt; the trace goes to %s",
            options.wait + options.warmup + 1,
            self._steps_left,
            out_dir,
        )

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def step(self) -> None:
        """Called after every step; stops the profiler once its schedule is done."""
        if self._profiler is None:
            return
        self._profiler.step()
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.close()

    def close(self) -> None:
        """Stops the profiler (a job shorter than the schedule gets the trace of what was recorded)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        try:
            profiler.stop()
        except Exception as exc:  # noqa: BLE001 - a profiler failure must not fail the job
            logger.warning("stopping the profiler failed: %s", exc)
