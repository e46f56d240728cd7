"""The engine: one call of :func:`~torch_batch_process.torch_batch_process` on one rank.

:mod:`~torch_batch_process.engine.loop` is the lifecycle (DESIGN §3) and only wires the components together, each
a sub-package with a small interface:

- :mod:`~torch_batch_process.engine.plan`: which global batches exist and which examples each holds;
- :mod:`~torch_batch_process.engine.schedule`: which batch a rank runs next, and when the ranks commit, stop or
  fail together;
- :mod:`~torch_batch_process.engine.feed`: the batches loaded and run, ``process_batch`` and what guards it;
- :mod:`~torch_batch_process.engine.commit`: votes, commit records, publication: exactly-once outputs; what a
  capability stores with a commit plugs in as a participant (:mod:`~torch_batch_process.engine.commit.participants`);
- :mod:`~torch_batch_process.engine.capabilities`: each capability's participant, between the feed and the commit.

Sub-layers, top first (``tools/import_graph.py`` checks them): the loop and its helpers; the capabilities; the feed
and the commit, side by side (neither imports the other); the schedule; the plan; the engine's core (the ranks'
collectives, the join, a rank's work and failure: :mod:`~torch_batch_process.engine.distributed`,
:mod:`~torch_batch_process.engine.join`, :mod:`~torch_batch_process.engine.work`,
:mod:`~torch_batch_process.engine.rank_failure`).

Below the engine, and never importing it: the stored job (:mod:`~torch_batch_process.jobstore`), outputs,
observer, sources and storage.
"""
