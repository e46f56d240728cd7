"""``benchmarks.step_cost`` runs its 2-rank variants end to end and prints a row per variant (the figures are
BENCHMARKS.md's, never asserted here)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_step_cost_prints_a_row_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.step_cost import VARIANTS, main

    # one variant per branch of the benchmark's rank code: the hand loop, the collective alone, the library (the
    # schedule is only an argument of the call there; each schedule's steps are the engine tests' subject)
    variants = ["hand", "collective", "static"]
    assert main(["--batches", "40", "--rounds", "1", "--variants", ",".join(variants)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| Variant")]
    assert [row.split("|")[1].strip() for row in rows] == [VARIANTS[v] for v in variants], out
    for row in rows:
        per_step, outside = float(row.split("|")[2]), float(row.split("|")[5])
        assert per_step > 0 and outside > 0, row


def test_step_cost_refuses_an_unknown_variant() -> None:
    from benchmarks.step_cost import main

    with pytest.raises(SystemExit):
        main(["--variants", "hand,nope"])
