"""How storage errors are named and which are worth retrying (object stores and local filesystems).

Every failure the library reports is a :class:`~torch_batch_process.errors.StorageError` naming the URL,
the action and a short human cause (permission denied, missing bucket, unreachable endpoint, read-only
filesystem, no space left...). Transient object-store errors (throttling, 5xx, timeouts, dropped
connections) are retried with jittered exponential backoff, at most ``TBP_STORAGE_RETRIES`` attempts
(default 5) and never past ``TBP_STORAGE_RETRY_S`` seconds (default 30) after the first one.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from torch_batch_process import settings
from torch_batch_process.errors import StorageError
from torch_batch_process.shell_commands import pip_install

__all__ = [
    "NotAFileError",
    "RETRY_BASE_DELAY_S",
    "RETRY_MAX_DELAY_S",
    "BACKEND_EXTRAS",
    "describe",
    "error_number",
    "file_error",
    "is_missing_backend",
    "missing_backend_hint",
    "is_missing_bucket",
    "is_out_of_space",
    "is_precondition_failed",
    "is_transient",
    "retry_attempts",
    "retry_budget_s",
    "storage_error",
    "with_retries",
]

logger = logging.getLogger(__name__)


class NotAFileError(OSError):
    """Something other than a file (a folder, a FIFO, a socket, a device) is where a stored file should be:
    damage to the storage, which callers name (a plain ``open`` of a FIFO would block until a writer comes)."""

T = TypeVar("T")


def retry_attempts() -> int:
    """Most attempts of one storage operation (``TBP_STORAGE_RETRIES``, default 5)."""
    return settings.current().storage_retries


def retry_budget_s() -> float:
    """No retry starts later than this many seconds after the first attempt (``TBP_STORAGE_RETRY_S``)."""
    return settings.current().storage_retry_s


RETRY_BASE_DELAY_S = 0.2
RETRY_MAX_DELAY_S = 5.0





def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _client_error(exc: BaseException) -> tuple[str, int] | None:
    """Error code and HTTP status of the object store's answer behind ``exc``, if any."""
    for cause in _causes(exc):
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response["Error"].get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code, status
    return None


def is_missing_bucket(exc: BaseException) -> bool:
    answer = _client_error(exc)
    if answer is not None:
        return answer[0] == "NoSuchBucket"
    return "bucket does not exist" in str(exc).lower()


def is_precondition_failed(exc: BaseException) -> bool:
    answer = _client_error(exc)
    return answer is not None and (answer[0] == "PreconditionFailed" or answer[1] == 412)


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


_UNREACHABLE = {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionRefusedError"}


_ERRNO_TEXT = re.compile(r"(?:os error|errno) (\d+)", re.IGNORECASE)


def error_number(exc: BaseException) -> int | None:
    """The ``errno`` of an ``OSError``, also one that only says it in its message (Lance's Rust errors: ``No space
    left on device (os error 28)``); ``None`` for anything else."""
    if not isinstance(exc, OSError):
        return None
    if isinstance(exc.errno, int):
        return exc.errno
    found = _ERRNO_TEXT.search(str(exc))
    return int(found.group(1)) if found else None


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is a full disk or quota."""
    return any(error_number(cause) in _NO_SPACE for cause in _causes(exc))


def describe(exc: BaseException) -> str:
    """A short human cause for ``exc``: permission denied, missing bucket, unreachable..."""
    answer = _client_error(exc)
    number = error_number(exc)
    if isinstance(exc, PermissionError) or (answer and answer[1] == 403):
        return f"permission denied ({exc})"
    if number == errno.EROFS:
        return f"read-only filesystem ({exc})"
    if number in (errno.EACCES, errno.EPERM):
        return f"permission denied ({exc})"
    if number in _NO_SPACE:
        return f"no space left ({exc})"
    if _class_names(exc) & _UNREACHABLE:
        return f"cannot reach the storage endpoint ({type(exc).__name__}: {exc})"
    if answer and answer[1] >= 500:
        return f"the object store answered HTTP {answer[1]} {answer[0]} ({exc})"
    return f"{type(exc).__name__}: {exc}"


def storage_error(url: str, action: str, exc: BaseException) -> StorageError:
    """The error of a failed storage operation: the storage's URL, the action and the cause (whose ``errno`` it
    keeps: ``errno.ENOSPC`` for a full disk)."""
    return _keep_errno(StorageError(f"storage {url!r}: cannot {action}: {describe(exc)}"), exc)


def file_error(path: str, action: str, exc: BaseException) -> StorageError:
    """The error of a failed write of a file the library writes itself (a record shard, a segment, a table's data
    file): a :class:`StorageError` naming the file, the action and the cause, with the cause's ``errno`` (a full
    disk: ``errno.ENOSPC``), instead of the bare ``OSError`` of pyarrow or Lance, which names neither."""
    return _keep_errno(StorageError(f"cannot {action} {path!r}: {describe(exc)}"), exc)


def _keep_errno(error: StorageError, cause: BaseException) -> StorageError:
    """``error`` with the ``errno`` of ``cause`` (its message stays its own)."""
    error.errno = error_number(cause)
    return error


BACKEND_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""Protocol -> the extra of this package that installs its fsspec backend (storage paths and sources alike)."""


def missing_backend_hint(protocol: str) -> str:
    """How to install the fsspec backend of ``protocol`` (the fix in a missing-backend error)."""
    extra = BACKEND_EXTRAS.get(protocol)
    if extra:
        return pip_install(extra)
    return f"install the fsspec implementation of the {protocol!r} protocol"


def is_missing_backend(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, ImportError) or "install" in text or "not available" in text or "unknown protocol" in text


_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "OperationAborted",
    "XAmzContentSHA256Mismatch",
}
_TRANSIENT_CLASSES = {
    # botocore
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "HTTPClientError",
    "ResponseStreamingError",
    "ResponseParserError",
    "IncompleteReadError",
    "IncompleteRead",
    # aiohttp (gcsfs, http)
    "ClientConnectionError",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
}
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE}
if hasattr(errno, "EREMOTEIO"):
    _TRANSIENT_ERRNOS.add(errno.EREMOTEIO)
_TRANSIENT_TEXT = ("throttl", "slow down", "service unavailable", "temporarily", "timed out", "connection reset")


def is_transient(exc: BaseException) -> bool:
    """Whether an object-store error is worth retrying (throttling, timeouts, 5xx, dropped connections)."""
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                        NotAFileError)):
        return False
    answer = _client_error(exc)
    if answer is not None:
        code, status = answer
        return code in _TRANSIENT_CODES or status >= 500 or status in (408, 429)
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if any(_class_names(cause) & _TRANSIENT_CLASSES for cause in _causes(exc)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return any(name in text for name in _TRANSIENT_TEXT)


def with_retries(
    url: str,
    bucket: str,
    action: str,
    fn: Callable[[], T],
    *,
    passthrough: tuple[type[BaseException], ...] = (),
) -> T:
    """Runs a remote operation of the storage at ``url``, retrying transient errors with bounded backoff
    (:func:`retry_attempts` tries within :func:`retry_budget_s`), and maps the rest to :class:`StorageError`.

    ``FileNotFoundError`` passes through (callers decide what a missing file means), except for a missing
    ``bucket``, which is a :class:`StorageError`. So do the exception types in ``passthrough``.
    """
    attempts = retry_attempts()
    deadline = time.monotonic() + retry_budget_s()
    delay = RETRY_BASE_DELAY_S
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except passthrough:
            raise
        except FileNotFoundError as exc:
            if is_missing_bucket(exc):
                raise StorageError(
                    f"storage {url!r}: cannot {action}: the bucket {bucket!r} does not exist ({exc})"
                ) from exc
            raise
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - classify every backend error
            pause = min(delay, RETRY_MAX_DELAY_S) * (0.5 + random.random())
            if attempt < attempts and is_transient(exc) and time.monotonic() + pause < deadline:
                logger.warning(
                    "storage %s: %s failed (%s); retry %d/%d in %.1fs",
                    url, action, describe(exc), attempt, attempts - 1, pause,
                )
                time.sleep(pause)
                delay *= 2
                continue
            tried = f" (after {attempt} attempts)" if attempt > 1 else ""
            raise StorageError(f"storage {url!r}: cannot {action}{tried}: {describe(exc)}") from exc
    raise AssertionError("unreachable")
