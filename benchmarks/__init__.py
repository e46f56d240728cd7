"""Benchmarks of torch_batch_process against a hand-written loop and its peers (see BENCHMARKS.md).

Nothing here is imported by the library or its tests. Run everything with ``python -m benchmarks.run``.
"""
