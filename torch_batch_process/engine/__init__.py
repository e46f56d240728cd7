"""The engine: one call of :func:`~torch_batch_process.torch_batch_process` on one rank.

:mod:`~torch_batch_process.engine.loop` is the lifecycle (DESIGN §3) and only wires the components together, each
a sub-package with a small interface:

- :mod:`~torch_batch_process.engine.plan`: which global batches exist and which examples each holds;
- :mod:`~torch_batch_process.engine.schedule`: which batch a rank runs next, and when the ranks commit, stop or
  fail together;
- :mod:`~torch_batch_process.engine.feed`: the batches loaded and run, ``process_batch`` and what guards it;
- :mod:`~torch_batch_process.engine.commit`: votes, commit records, publication: exactly-once outputs.

Below the engine, and never importing it: the stored job (:mod:`~torch_batch_process.jobstore`), outputs,
observer, sources and storage.
"""
