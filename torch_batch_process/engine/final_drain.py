"""A rank's final drain, committed as it goes: once its steps are done, the batches still in its generation engine
are delivered and committed every ``checkpoint_interval`` delivered batches (DESIGN §19), so a kill -9 during a long
drain loses only what was delivered since the last commit, as during the steps.

The ranks drain in rounds of at most :data:`ROUND_S` seconds, together: in a round each rank delivers what its
engine finishes, up to ``checkpoint_interval`` batches (answered batches beyond wait for the next round, so that a
commit never waits for a long run of deliveries); at the round's end they take one element-wise MAX of four integers
(a batch still in flight, a stop asked (SIGTERM, or a completed commit's votes), a failure, batches delivered since
the last commit). When a rank has delivered ``checkpoint_interval`` batches since the last commit, every rank
commits (``on_checkpoint_start()`` the same number of times on every rank, the gathered votes of the static schedule
at the same round; the queued votes of the dynamic schedule just as well). The drain ends on every rank at the same
round: when no batch is in flight anywhere (``DONE``: the closing commit follows), when a rank asked to stop
(``STOP``: each rank then drains within ``drain_s`` and keeps its partial answers, as at any stop), or when a rank
failed (``FAIL``). A rank whose engine is empty, or that delivered ``checkpoint_interval`` batches, ends its round
and waits for the others (at most a round), as it waited at the closing commit before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.engine.feed.in_flight import InFlight
from torch_batch_process.engine.schedule.agreement import Decision

__all__ = ["ROUND_S", "drain_committing"]

ROUND_S = 1.0
"""Seconds of a round of the final drain: a stop or a failure reaches every rank within one round."""


def drain_committing(
    in_flight: InFlight,
    collectives: Collectives,
    interval: int,
    commit: Callable[[], None],
    poll: Callable[[], bool],
    stopping: Callable[[], bool],
    failed: Callable[[], bool],
) -> Decision:
    """Drains this rank's batches in flight with the other ranks, committing every ``interval`` delivered batches
    (see the module docstring); returns ``DONE``, ``STOP`` or ``FAIL``, the same on every rank.

    Args:
        in_flight: this rank's batches in its generation engine.
        collectives: the library's collectives (one MAX per round).
        interval: ``checkpoint_interval``: commit once a rank delivered this many batches since the last commit.
        commit: ``on_checkpoint_start()`` and this rank's commit.
        poll: completes a commit whose votes arrived; whether a rank asked to stop.
        stopping: whether this rank received SIGTERM/SIGINT.
        failed: whether this rank failed.
    """
    delivered = 0
    while True:
        end = time.monotonic() + ROUND_S
        while in_flight.batches_in_flight and delivered < interval and not failed() and not stopping():
            wait = end - time.monotonic()
            if wait <= 0:
                break
            delivered += in_flight.pump(timeout=min(wait, 1.0), most=interval - delivered)
        stop = poll()
        left, stop, fail, most = collectives.start_max(
            [int(in_flight.batches_in_flight > 0), int(stop or stopping()), int(failed()), delivered]
        ).wait()
        if fail:
            return Decision.FAIL
        if stop:
            return Decision.STOP
        if not left:
            return Decision.DONE
        if most >= interval:
            commit()
            delivered = 0
