"""The stored job: everything a job keeps on its storage, and the only code that names or reads it.

What it holds: every stored name (:mod:`~torch_batch_process.jobstore.layout`), the job file and its fingerprint,
the commit records and the record schema they carry (:mod:`~torch_batch_process.jobstore.formats`,
:mod:`~torch_batch_process.jobstore.schema`), the state files, stages and their publication and repair
(:mod:`~torch_batch_process.jobstore.store`), the integrity checks before a resume
(:mod:`~torch_batch_process.jobstore.integrity`), rank 0's reading of the job at a start
(:mod:`~torch_batch_process.jobstore.opening`), the memory limits a job learned (kept in its commit records,
:mod:`~torch_batch_process.jobstore.memory_limits`) and the numbering of retries, whose outputs share the job's
``outputs/`` (:mod:`~torch_batch_process.jobstore.retries`).

What it promises: every write is idempotent and atomic per file, so that whatever a crash leaves, the next start
repairs it under the job lock to the state of the latest commit record; damaged progress is an error, never a
silent restart from zero; reading (``read_outputs``, ``tbp status``, ``tbp failures``) is safe while a job runs.

It sits below the engine: the engine writes the stored job through it, and the read side reads it without the
engine. It imports only storage and the package's base modules.
"""
