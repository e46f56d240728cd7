"""Observation: progress, metrics, TensorBoard, profiler and stragglers, told by the loop and never driving it;
the job's timeline (batch times, commit latency); ``tbp status``, ``tbp failures``, ``tbp report`` and
``tbp dashboard``, which read the stored job (:mod:`torch_batch_process.jobstore`), never the
engine, and import no torch.

Promise: what it shows never changes what the job does (a display or an upload that fails is a warning) and costs
the loop an int compare per step between the times it is due.
"""
