"""Heartbeats of a dynamic job's ranks, so that a rank that dies stops the others promptly (DESIGN §8).

With ``schedule="dynamic"`` no collective runs per step: a rank killed outright (``kill -9``, a lost node, a
launcher that does not stop the others) would go unnoticed by the other ranks until the closing commit, after
they processed every batch left. So every rank's heartbeat thread adds 1 to a counter of its own in the
call's rendezvous store every :data:`BEAT_S` seconds, from the start of its steps to the end of the call, and
rank 0's thread also reads every rank's counter while rank 0 runs its steps. When one has not moved for
:data:`SILENCE_S` seconds, rank 0 records a :class:`~torch_batch_process.errors.WorkerLostError` and tells
every rank to stop at its next batch (the scheduler's failure mark); the closing commit then makes every rank
raise. Rank 0 dying is seen by the others at their next claim, since the store lives in rank 0's process (or
torchrun's agent).

A heartbeat only says that the process runs: a rank stuck in a batch is ``batch_timeout``'s job. When rank 0's
own thread did not run for a while (the whole job suspended, e.g. by Slurm, or a starved process), every rank
gets a fresh :data:`SILENCE_S` before it counts as silent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from torch_batch_process import settings
from torch_batch_process.errors import WorkerLostError
from torch_batch_process.settings import HEARTBEAT_S, HEARTBEAT_SILENCE_ENV, HEARTBEAT_SILENCE_S

__all__ = ["BEAT_S", "SILENCE_ENV", "SILENCE_S", "Heartbeats", "StoreConnection", "heartbeat_silence_s", "watch_peers"]

logger = logging.getLogger(__name__)

BEAT_S = HEARTBEAT_S
"""Seconds between two heartbeats of a rank (one store request each; rank 0 also reads every rank's counter, in
one request)."""

SILENCE_S = HEARTBEAT_SILENCE_S
"""A rank whose heartbeats stopped for this long is lost (default of ``TBP_HEARTBEAT_SILENCE_S``)."""

SILENCE_ENV = HEARTBEAT_SILENCE_ENV


def heartbeat_silence_s() -> float:
    """Seconds of silence after which a rank is lost: ``TBP_HEARTBEAT_SILENCE_S`` (the call's settings), default
    :data:`SILENCE_S`.

    Raise it when a rank may legitimately not run Python for longer: the heartbeat is a Python thread, so a batch
    that holds the GIL in one long C call (one that does not release it), or a process suspended on its own,
    looks silent. A value that is not a number of seconds >= 2 is refused when the call starts."""
    return settings.current().heartbeat_silence_s


class Heartbeats:
    """This rank's heartbeat thread; on rank 0 it also watches the others' (see the module docstring).

    Args:
        store: factory of a rendezvous store connection for the thread.
        rank: this rank.
        world_size: the number of ranks.
        on_lost: rank 0: called once, from the thread, with the error of a rank that went silent.
        beat_s: seconds between heartbeats.
        silence_s: seconds without a heartbeat after which a rank is lost (``None``: :func:`heartbeat_silence_s`).
    """

    def __init__(
        self,
        store: Callable[[], Any],
        rank: int,
        world_size: int,
        on_lost: Callable[[WorkerLostError], None],
        *,
        beat_s: float = BEAT_S,
        silence_s: float | None = None,
    ) -> None:
        self._store_factory = store
        self._rank = rank
        self._world_size = world_size
        self._on_lost = on_lost
        self._beat_s = beat_s
        self._silence_s = silence_s if silence_s is not None else heartbeat_silence_s()
        self._watching = rank == 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tbp-heartbeats", daemon=True)

    def start(self) -> Heartbeats:
        """Starts the thread; returns ``self``."""
        self._thread.start()
        return self

    def stop_watching(self) -> None:
        """Rank 0's steps are over: it stops judging the others (its heartbeats go on until :meth:`close`)."""
        self._watching = False

    def close(self) -> None:
        """Stops the thread (the end of the call)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        try:
            store = self._store_factory()
        except Exception as exc:  # noqa: BLE001 - the main thread sees a lost store at its next claim
            logger.debug("rank %d: no heartbeats (%s)", self._rank, exc)
            return
        own = f"alive/{self._rank}"
        counts: dict[int, int] = {}
        heard: dict[int, float] = {}
        last_tick = time.monotonic()
        others = [rank for rank in range(self._world_size) if rank != self._rank]
        if self._watching:
            try:
                for rank in others:  # every counter exists from now on: one request reads them all at each beat
                    store.add(f"alive/{rank}", 0)
            except Exception as exc:  # noqa: BLE001 - rank 0's store is its own: this only fails as it stops
                logger.debug("rank %d: no heartbeats (%s)", self._rank, exc)
                return
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_tick > 3 * self._beat_s:  # this thread did not run: nobody's silence counts meanwhile
                heard = dict.fromkeys(heard, now)
            last_tick = now
            try:
                store.add(own, 1)
                if self._watching and others:
                    lost = self._silent_rank(store, others, counts, heard, now)
                    if lost is not None:
                        self._report(lost, now - heard[lost])
                        return
            except Exception as exc:  # noqa: BLE001 - rank 0 is gone: the main thread raises at its next claim
                logger.debug("rank %d: heartbeats stopped (%s)", self._rank, exc)
                return
            self._stop.wait(self._beat_s)

    def _silent_rank(
        self, store: Any, others: list[int], counts: dict[int, int], heard: dict[int, float], now: float
    ) -> int | None:
        """Reads every other rank's counter (one request for all: rank 0's work per beat stays one request at any
        world size); returns a rank silent for longer than allowed, or ``None``."""
        values = store.multi_get([f"alive/{rank}" for rank in others])
        for rank, raw in zip(others, values, strict=True):
            count = int(raw)
            if counts.get(rank) != count:
                counts[rank], heard[rank] = count, now
            elif now - heard[rank] > self._silence_s:
                return rank
        return None

    def _report(self, rank: int, silent_s: float) -> None:
        message = (
            f"rank {rank} stopped answering: no heartbeat for {silent_s:.0f} s (it crashed, was killed, or its host "
            "or network failed). The last commit is intact: run the job again to resume from it"
        )
        logger.error("rank %d: %s; every rank stops at its next batch", self._rank, message)
        self._on_lost(WorkerLostError(message))


class StoreConnection(Protocol):
    """What the heartbeats need of the call's rendezvous store
    (:class:`~torch_batch_process.engine.distributed.RendezvousStore`): a connection of their own. Named by this
    interface, not the class, because the join of the process group (:mod:`torch_batch_process.engine.join`, which
    :mod:`~torch_batch_process.engine.distributed` runs) uses this module's heartbeat settings."""

    def clone(self) -> Any: ...


def watch_peers(
    store: StoreConnection | None, rank: int, world_size: int, on_lost: Callable[[WorkerLostError], None]
) -> Heartbeats | None:
    """The started heartbeats of this rank with the dynamic schedule on several ranks (the call's rendezvous
    ``store``; ``None`` otherwise: no heartbeats). Rank 0 calls ``on_lost`` (from its heartbeat thread) with the
    error of a rank that went silent: it records it as its own failure and stops every rank at its next batch."""
    if store is None:
        return None
    return Heartbeats(store.clone, rank, world_size, on_lost).start()
