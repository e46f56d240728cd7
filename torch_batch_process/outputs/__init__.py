"""Outputs: ``upload_path()`` files and record outputs (``context.write()``), staged per rank and stage for the
committer to publish, and read back (``read_outputs``, ``iter_outputs``).

Promise: a batch's files and rows appear under ``outputs/`` only once the commit that covers them is durable, and
exactly once; read-back returns committed rows only, in dataset order, and checks their number against the commit
records. It reads the stored job (:mod:`torch_batch_process.jobstore`), never the engine.
"""
