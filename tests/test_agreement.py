"""The static schedule's agreement on a time cadence (issue 45): fewer collectives, the same decision on every rank.

Two real ranks (gloo) run :class:`~torch_batch_process.engine.schedule.agreement.StepAgreement` alone, steps of a few
milliseconds (rank 0's half again as long as rank 1's), a commit every 50 steps.
"""

from __future__ import annotations

import json
import math

import pytest
from harness import REPO, spawn_ranks, wait_all

JOB = REPO / "tests" / "jobs" / "agreement_job.py"
STEP_S, PERIOD_S = 0.002, 0.05


def _run(tmp_path, **spec):
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}"
    report.mkdir()
    spec = {"steps": 300, "step_s": STEP_S, "interval": 50, "period_s": PERIOD_S, "preempt_at": None,
            "report": str(report), **spec}
    outcomes = wait_all(spawn_ranks(2, JOB, json.dumps(spec)), timeout=120)
    assert [rc for rc, _, _ in outcomes] == [0, 0], outcomes
    return [json.loads((report / f"rank_{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_ranks_agree_every_period_not_every_step_and_stop_at_the_same_step_within_one_period(tmp_path):
    ranks = _run(tmp_path)
    assert ranks[0]["decisions"] == ranks[1]["decisions"] and len(ranks[0]["decisions"]) == 300
    assert ranks[0]["decisions"].count("commit") == 6
    # every ~50 ms of steps of 2-3 ms (and after each commit): a few dozen agreements, not one per step (300)
    assert 3 <= ranks[0]["agreements"] == ranks[1]["agreements"] <= 60, ranks

    stopped = _run(tmp_path, preempt_at=120)
    decisions = stopped[0]["decisions"]
    assert decisions == stopped[1]["decisions"] and decisions[-1] == "stop", stopped
    # rank 1 raises its flag at step 120: it joins the next agreement (at most a period of steps away, the
    # shortest steps proposing the most) and is read one step later
    most_steps = math.ceil(PERIOD_S / STEP_S)
    assert 120 <= len(decisions) - 1 <= 120 + most_steps + 1, len(decisions)
