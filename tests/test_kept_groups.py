"""A rank that fails while a collective of the library's group is in flight exits instead of waiting forever in the
group's destructor (engine/kept_groups.py; the mesh kill chain's hang of notes/43-mesh.md §11)."""

import time

import pytest
from harness import REPO, spawn_ranks, wait_all


@pytest.mark.slow
def test_a_rank_that_fails_with_a_collective_in_flight_exits_while_its_peer_still_lives():
    procs = spawn_ranks(2, REPO / "tests" / "jobs" / "dropped_group_job.py")
    started = time.monotonic()
    try:
        rank0 = procs[0].wait(timeout=45)  # rank 1 sleeps 60 s: a join on its collective would outlast this
    finally:
        outcomes = wait_all(procs, timeout=0.1)  # kills rank 1 (and rank 0 when it hung)
    assert rank0 == 3, outcomes[0]
    out = outcomes[0][1]
    assert "raised: rank 0 failed with a collective in flight" in out and "released" in out, outcomes[0]
    assert time.monotonic() - started < 45
