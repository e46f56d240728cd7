"""Exceptions raised by torch_batch_process.

Every error the library raises derives from :class:`BatchProcessError`, so callers can catch them all
at once, and also from the closest built-in exception, so code written against Determined (which
raises ``ValueError`` and plain ``Exception``) keeps working.
"""

from __future__ import annotations


class BatchProcessError(Exception):
    """Base class of every error raised by torch_batch_process."""


class InvalidArgumentError(BatchProcessError, TypeError, ValueError):
    """An argument has a wrong type or value.

    It is both a ``TypeError`` and a ``ValueError``: the message names the argument and the fix, and
    it is raised before any work is done or anything is written to storage.
    """


class MeshOutputError(InvalidArgumentError):
    """``mesh=``: a member of a replica that is not its writer wrote an ``upload_path()`` file that the writer did not
    write in the same commit: only the writer's files are outputs (docs/mesh.md). Raised before that commit."""


class SchemaConflictError(InvalidArgumentError):
    """``context.write()`` rows whose columns do not unify with the job's (another type, a tensor whose
    per-example shape changed; see :mod:`torch_batch_process.jobstore.schema`), or that the job's
    ``output_format`` cannot store (bytes, dates or decimals in JSONL). Raised before those rows are
    committed; it fails the job even with ``on_error="skip"``, since the code is at fault, not an example."""


class StorageError(BatchProcessError, OSError):
    """The storage path cannot be used (unreachable, missing bucket, no permission, read-only...)."""


class StorageUrlError(InvalidArgumentError, StorageError):
    """A storage path that is no usable path or URL: empty, a URL with a typo (``s3:/bucket``), an unknown
    protocol. A bad argument (``TypeError``/``ValueError``) that is also a :class:`StorageError`, as every failure
    to use a storage path is; raised before anything is opened or written."""


class JobLockedError(StorageError):
    """Another job holds the lock of this storage path."""


class JobMismatchError(BatchProcessError, ValueError):
    """The job stored at the storage path differs from this one (dataset, batch size, processor...)."""


class CheckpointCorruptError(BatchProcessError):
    """A checkpoint record or state file exists but cannot be read."""


CORRUPT_HINT = (  # what a CheckpointCorruptError tells the user to do
    "The job cannot resume from it: restore the file from a backup, or start the job afresh with resume=False "
    "(this erases the stored progress and outputs) or a new storage_path"
)


class NoJobError(BatchProcessError):
    """The storage path holds no job (``tbp status``, ``tbp failures``, ``tbp report``, :func:`read_failures`)."""


class OutputCorruptError(BatchProcessError, ValueError):
    """A committed record shard (``context.write()`` rows) exists but cannot be read back."""


class WorkerFailedError(BatchProcessError, RuntimeError):
    """Another rank raised an exception; raised on the ranks that did not fail."""


class WorkerLostError(BatchProcessError, RuntimeError):
    """Contact with another rank was lost (it crashed, was killed, or the network failed)."""


class MemberOutOfStepError(BatchProcessError, RuntimeError):
    """``mesh=``: a member of a replica ran out of memory where the other members wait for it in a collective of the
    model (inside a tensor-parallel forward), so the members cannot split the batch together; the job stops,
    resumable (docs/mesh.md)."""


LOST_HINT = (  # what a WorkerLostError tells the user to do
    "another rank of this job stopped answering (it crashed, was killed, or the network failed). "
    "The last commit is intact: run the job again to resume from it"
)
class LoaderWorkerDiedError(BatchProcessError, RuntimeError):
    """A ``DataLoader`` worker process of this rank died (killed by a signal, often the kernel's out-of-memory
    killer, or exited). No example's fault: it fails the job even with ``on_error="skip"``; the last commit is
    intact, so running the job again resumes."""

    @classmethod
    def reports(cls, exc: BaseException) -> bool:
        """Whether ``exc`` is the ``DataLoader``'s own report of a dead worker: a ``RuntimeError`` raised by its
        next batch, or by its SIGCHLD handler wherever the main thread is (in ``process_batch``, in a commit)."""
        if not isinstance(exc, RuntimeError) or isinstance(exc, cls):
            return False
        return str(exc).startswith("DataLoader worker (pid")

    @classmethod
    def wrap(cls, exc: BaseException) -> LoaderWorkerDiedError | None:
        """This error, with ``exc`` as its cause, for the loader's report ``exc`` (see :meth:`reports`); ``None`` for
        any other exception."""
        if not cls.reports(exc):
            return None
        report = str(exc).strip().rstrip(".")
        error = cls(
            f"{report}. A DataLoader worker of this rank died: no example's fault (the kernel's "
            "out-of-memory killer is the usual cause: lower num_workers, prefetch_factor or the batch size). The job "
            "stops, even with on_error='skip'; the last commit is intact: run it again to resume."
        )
        error.__cause__ = exc
        return error


class BatchTimeoutError(BatchProcessError, TimeoutError):
    """A batch ran longer than ``batch_timeout`` seconds (see :mod:`torch_batch_process.engine.feed.watchdog`)."""


class TooManyFailuresError(BatchProcessError, RuntimeError):
    """More examples failed than ``max_failures`` allows (``on_error="skip"``)."""


class ExampleTooLargeError(BatchProcessError, RuntimeError):
    """One example does not fit in the device's memory even alone (DESIGN §15): its ``process_batch`` ran out of
    memory in a part of its own. Raised with ``on_error="raise"`` (with ``"skip"`` it is a failing example); the
    message names the example, its batch and its length (with ``bucket_by``)."""


class PreemptedError(BatchProcessError, RuntimeError):
    """:func:`~torch_batch_process.predict` was preempted (SIGTERM/SIGINT) before every batch was committed: it has no
    output for every example to return. What was committed stays stored; running the same command again resumes."""

