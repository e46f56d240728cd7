"""The documentation's code: the ``dataloader_kwargs`` of every snippet of README.md and docs/*.md run on a CPU
machine of two cores without a torch warning (issue 26 item 12: ``pin_memory=True`` without an accelerator and
``num_workers=4`` on 2 cores printed warnings when the README's snippet was copied)."""

from __future__ import annotations

import ast
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

from harness import REPO

_KWARGS = re.compile(r"dataloader_kwargs=(\{[^{}]*\})")
_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _snippet_kwargs() -> list[tuple[str, dict]]:
    found = []
    for path in _DOCS:
        for match in _KWARGS.finditer(path.read_text()):
            try:
                kwargs = ast.literal_eval(match.group(1))
            except ValueError:  # names of the snippet's own (a collate_fn...): not a literal
                continue
            found.append((f"{path.name}: {match.group(0)}", kwargs))
    return found


def test_the_snippets_dataloader_options_are_found():
    assert len(_snippet_kwargs()) >= 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs 2 cores")
@pytest.mark.parametrize(("where", "kwargs"), _snippet_kwargs(), ids=lambda value: str(value)[:60])
def test_a_snippets_dataloader_options_give_no_warning_on_a_two_core_cpu_machine(where, kwargs, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine, whatever this one has
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, **kwargs)
        assert [len(batch) for batch in loader] == [2, 2, 2, 2], where
