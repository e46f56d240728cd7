"""The documentation's code: the ``dataloader_kwargs`` of every snippet of README.md and docs/*.md run on a CPU
machine of two cores without a torch warning (issue 26 item 12: ``pin_memory=True`` without an accelerator and
``num_workers=4`` on 2 cores printed warnings when the README's snippet was copied), and the reader lines of
docs/records.md run as written."""

from __future__ import annotations

import ast
import glob
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

from harness import REPO

from torch_batch_process import TorchBatchProcessor, torch_batch_process

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


def _reader_snippets() -> list[list[str]]:
    """The lines of each Python block of docs/records.md that reads the record shards by their glob (Spark's and
    the JSONL line, which need a Spark session or a ``shard`` of the reader's choosing, left out)."""
    text = (REPO / "docs" / "records.md").read_text()
    blocks = []
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        if "records/part-*" not in block and "shards" not in block:
            continue
        lines = [line.split("  #")[0].strip() for line in block.splitlines()]
        blocks.append([line for line in lines if line and not line.startswith("spark.") and "(shard," not in line])
    return blocks


class _Rows(TorchBatchProcessor):
    widen = False

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        late = not _Rows.widen or batch_idx >= 3  # widened: all-None strings and ints in the first batches
        self.context.write({"text": [f"t{int(i)}" if late else None for i in batch],
                            "value": [int(i) + (0.5 if late else 0) for i in batch]})


@pytest.mark.parametrize("widen", [False, True], ids=["plain", "widened"])
def test_the_reader_snippets_of_docs_records_run_as_written(widen, tmp_path, monkeypatch):
    """Every reader line of docs/records.md, copied as written (``path`` being the job's storage), reads every row
    once; the widened job's shards differ in schema (a shard per commit), as the second block is for."""
    namespace = {"glob": glob, "path": str(tmp_path / "job")}
    for module in ("pandas", "polars", "duckdb", "datasets", "torch_batch_process"):
        namespace[module] = pytest.importorskip(module)
    monkeypatch.setenv("TBP_SHARD_BYTES", "1")  # a shard per commit
    _Rows.widen = widen
    torch_batch_process(_Rows, torch.arange(40), batch_size=4, checkpoint_interval=2, storage_path=namespace["path"])
    blocks = _reader_snippets()
    assert len(blocks) == 2 and len(blocks[0]) == 4 and len(blocks[1]) == 4, blocks
    for line in blocks[1] if widen else [line for block in blocks for line in block]:
        if re.match(r"^\w+ = ", line):
            exec(line, namespace)
            continue
        result = eval(line, namespace)
        if hasattr(result, "fetchall"):  # a DuckDB relation
            index = [row[0] for row in result.fetchall()]
        else:  # a polars or pandas DataFrame, a datasets.Dataset
            index = [int(i) for i in result["index"]]
        ordered = "ORDER BY" in line or ".sort(" in line or "read_outputs" in line
        assert (index if ordered else sorted(index)) == list(range(40)), line
