"""A rank that fails while a collective of the library's group is in flight neither hangs in the group's destructor
nor at its exit (engine/pending_collectives.py; the mesh kill chain's hang of notes/43-mesh.md §11)."""

import time

import pytest
from harness import REPO, base_env, spawn_ranks, wait_all


@pytest.mark.slow
def test_a_rank_that_fails_with_a_collective_in_flight_exits_while_its_peer_still_lives():
    procs = spawn_ranks(2, REPO / "tests" / "jobs" / "dropped_group_job.py")
    started = time.monotonic()
    try:
        rank0 = procs[0].wait(timeout=45)  # rank 1 sleeps 60 s: a join on its collective would outlast this
    finally:
        outcomes = wait_all(procs, timeout=0.1)  # kills rank 1 (and rank 0 when it hung)
    elapsed = time.monotonic() - started
    out, err = outcomes[0][1], outcomes[0][2]
    # the call's failure is the user's to handle (caught, groups released, the user's code ran on)...
    assert "raised: rank 0 failed with a collective in flight" in out and "released" in out, outcomes[0]
    # ...and the exit ends what a live peer never joins: code 1 and why, after the bounded wait (EXIT_WAIT_S = 2)
    assert rank0 == 1, outcomes[0]
    assert "collective(s) of a failed call still wait on a peer" in err, outcomes[0]
    assert 2 <= elapsed < 45, elapsed


@pytest.mark.slow
def test_a_failed_call_whose_collectives_finished_exits_with_its_own_code():
    procs = spawn_ranks(2, REPO / "tests" / "jobs" / "dropped_group_job.py", env={**base_env(), "JOIN_AFTER_S": "0.5"})
    try:
        codes = [proc.wait(timeout=60) for proc in procs]
    finally:
        outcomes = wait_all(procs, timeout=0.1)
    # rank 1 joins the collective 0.5 s late: rank 0's exit waits for it, then ends as the user's code says
    assert codes == [3, 0], outcomes
    assert "still wait on a peer" not in outcomes[0][2], outcomes[0]


class _Work:
    """Stands for a torch ``Work`` (only ``is_completed`` is read)."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_the_registry_forgets_finished_collectives_and_names_the_groups_of_those_in_flight():
    from torch_batch_process.engine import pending_collectives

    group = object()
    done = [_Work(True) for _ in range(200)]  # dropped without waiting (a job that ended): never settled
    stuck = _Work(False)
    try:
        for work in done:
            pending_collectives.started(work, None)
        pending_collectives.started(stuck, group)
        assert len(pending_collectives._in_flight) <= pending_collectives._PRUNE_AT + 1  # bounded
        assert pending_collectives.pending_groups() == [group]
        stuck.done = True
        assert pending_collectives.pending_groups() == []
    finally:
        for work in [*done, stuck]:
            pending_collectives.settled(work)
    assert not pending_collectives._in_flight
