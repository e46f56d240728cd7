"""Observation: progress, metrics, TensorBoard, profiler, stragglers and ``tbp status``; told by the loop, never driving it."""
