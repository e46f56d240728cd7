"""A static commit's exchange (engine/commit/gathered.py, issue 45): every rank's flags reach every rank and its vote
rank 0 in one collective (a gather of the votes and a MAX all_reduce of the flags took two, each a gloo op's fixed
CPU), and a vote too large for the buffer still arrives whole. Two real ranks (gloo)."""

from __future__ import annotations

import json

import pytest
from harness import REPO, spawn_ranks, wait_all

JOB = REPO / "tests" / "jobs" / "commit_exchange_job.py"


@pytest.mark.slow
def test_a_static_commit_is_one_collective_that_brings_every_rank_the_flags_and_rank_0_the_votes(tmp_path):
    outcomes = wait_all(spawn_ranks(2, JOB, str(tmp_path)), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    rank0, rank1 = (json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1))
    small, large = rank0
    # the same flags on both ranks: rank 1's stop request, rank 0's durable record, counts and news
    expected = {"preempt": True, "failed": False, "overflow": False, "durable": 7, "batches_committed": 10,
                "examples_committed": 20, "shared": 1}
    assert small["flags"] == rank1[0]["flags"] == expected
    assert small["votes"] == [[0, 0], [1, 0]] and rank1[0]["votes"] == [[1, 0]]  # rank 0 gets them all
    assert small["collectives"] == rank1[0]["collectives"] == 1, (rank0, rank1)
    # a vote that does not fit: every rank knows, and the votes are gathered again (one collective more)
    assert large["flags"] == rank1[1]["flags"] == dict(expected, overflow=True)
    assert large["votes"] == [[0, 0], [1, 300]] and rank1[1]["votes"] == [[1, 300]]
