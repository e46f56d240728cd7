"""The job's rendezvous store as the dynamic schedule uses it: shared counters and queues between ranks."""

from __future__ import annotations

from typing import Any

from torch_batch_process.errors import LOST_HINT, WorkerLostError

__all__ = ["RendezvousStore"]


class RendezvousStore:
    """Counters and queues in the job's rendezvous store; losing the store (rank 0's process hosts it under
    the plain env contract, torchrun's agent otherwise) means losing the job's other ranks, so every error
    is a :class:`WorkerLostError` (except the timeout of a blocking :meth:`queue_pop`, which just waited)."""

    def __init__(self, store: Any, rank: int) -> None:
        self._store = store
        self._rank = rank

    def _lost(self, exc: BaseException) -> WorkerLostError:
        return WorkerLostError(f"rank {self._rank}: the job's rendezvous store stopped answering ({exc}); {LOST_HINT}")

    def add(self, key: str, amount: int) -> int:
        try:
            return int(self._store.add(key, amount))
        except Exception as exc:  # noqa: BLE001 - connection refused, reset, timeout...
            raise self._lost(exc) from exc

    def set(self, key: str, value: bytes) -> None:
        try:
            self._store.set(key, value)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc

    def get(self, key: str) -> bytes:
        """The value of a key that was set (a key that was not makes the store wait, then time out)."""
        try:
            return bytes(self._store.get(key))
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys`` in one request (each must exist: the store waits for a missing key)."""
        try:
            return list(self._store.multi_get(keys))
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc

    def queue_push(self, key: str, value: bytes) -> None:
        try:
            self._store.queue_push(key, value)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc

    def queue_len(self, key: str) -> int:
        try:
            return int(self._store.queue_len(key))
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc

    def queue_pop(self, key: str) -> bytes | None:
        """The next item, waiting for one; ``None`` when the store's wait timed out (call again)."""
        try:
            return self._store.queue_pop(key, block=True)
        except Exception as exc:  # noqa: BLE001
            if "timeout" in str(exc).lower():
                return None
            raise self._lost(exc) from exc

    def clone(self) -> RendezvousStore:
        """A connection of its own (for another thread)."""
        try:
            return RendezvousStore(self._store.clone(), self._rank)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(exc) from exc
