"""The join's handshake (engine/join.py) in one process: two ranks as two threads, each with its own store client."""

from __future__ import annotations

import threading
import time

from harness import free_port

from torch_batch_process.engine import join


def test_the_join_wakes_each_waiting_rank_when_its_step_is_there(monkeypatch):
    """The ranks' pauses between their looks at the store are made 2 s here: a rank that waits for a step of the
    handshake (rank 0 for the others to join and acknowledge, another rank for rank 0's ready and go) is woken when
    the step is there, not at its next look. Before: each step waited for the waiting rank's next look, up to the
    longest pause (0.1 s in a job; here 2 s per step, the join > 2 s)."""
    monkeypatch.setattr(join, "_FIRST_POLL_S", 2.0)
    monkeypatch.setattr(join, "_POLL_S", 2.0)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    done: dict[int, float] = {}
    stores: list[object] = []  # rank 0's hosts the store: kept until both ranks are done
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            stores.append(join.join_job(r, 2)[0])
            done[r] = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    first = threading.Thread(target=rank, args=(0,))
    first.start()
    time.sleep(0.5)  # rank 0 is in its first 2-s pause when rank 1 comes
    arrived = time.monotonic()
    second = threading.Thread(target=rank, args=(1,))
    second.start()
    first.join(30)
    second.join(30)
    assert not errors, errors
    assert max(done.values()) - arrived < 1.0, {r: round(t - arrived, 3) for r, t in done.items()}
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tbp-join")]  # no thread of the join left
