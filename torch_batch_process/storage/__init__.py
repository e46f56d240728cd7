"""Storage: one small interface (:mod:`~torch_batch_process.storage.base`) with a backend per kind: local and
network-mounted folders (:mod:`~torch_batch_process.storage.local`), object stores
(:mod:`~torch_batch_process.storage.object_store`) and S3 (:mod:`~torch_batch_process.storage.s3`), opened by
:func:`~torch_batch_process.storage.registry.open_storage`; and the job lock (an OS file lock locally, a heartbeat
lease on object stores).

Promise: every write is atomic per file; every failure is a :class:`~torch_batch_process.errors.StorageError`
naming the URL, the action and the cause, after bounded retries of what is transient; one job at a time per
storage path, and a lock left by a killed job never blocks its resume. It knows nothing of jobs: what is stored
where is the stored job's (:mod:`torch_batch_process.jobstore`).
"""
