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


# ----------------------------------------------------------------------- issue 48: a README a newcomer follows

_RUNS = re.compile(r"<!-- snippet: runs -->\n```python\n(.*?)```(?:\n\n```\n(.*?)```)?", flags=re.S)


def _runnable_snippets() -> list[tuple[str, str, str | None]]:
    """(where, code, the output shown right after it, if any) of every block marked ``<!-- snippet: runs -->``."""
    return [(f"{path.name}:{i}", m.group(1), m.group(2)) for path in _DOCS
            for i, m in enumerate(_RUNS.finditer(path.read_text()))]


def test_the_runnable_snippets_are_found():
    assert {where.split(":")[0] for where, _, _ in _runnable_snippets()} >= {"README.md", "api.md"}


@pytest.mark.parametrize(("where", "code", "shown"), _runnable_snippets(), ids=lambda value: str(value)[:20])
def test_a_snippet_runs_as_pasted_and_prints_what_the_docs_show(where, code, shown, tmp_path, monkeypatch, capsys):
    """Issue 48 item 4: the README's first example used an undefined build_model() and dataset; the first job
    (context.write, then read_outputs) had no complete example. Each marked block runs as written, in a fresh
    folder, as a script would (``__main__``), and prints what the block after it shows."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    exec(compile(code, where, "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    if shown is not None:
        assert printed == shown, printed
    assert list((tmp_path / "tbp_runs").iterdir()), "the snippet's job is stored below the working directory"


def test_the_argument_table_and_signature_list_every_public_argument():
    """Issue 48 item 3: ``table=`` (the main example uses it) was missing from the signature and the table."""
    import inspect

    text = (REPO / "docs" / "api.md").read_text()
    signature = re.search(r"`torch_batch_process\((batch_processor_cls.*?)\)`", text, flags=re.S).group(1)
    shown = [part.split("=")[0].strip() for part in " ".join(signature.split()).split(",")]
    parameters = inspect.signature(torch_batch_process).parameters
    assert [name for name in shown if name != "*"] == list(parameters)
    defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    for part in " ".join(signature.split()).split(","):
        if "=" in part:
            name, value = (s.strip() for s in part.split("=", 1))
            assert ast.literal_eval(value) == defaults[name], (name, value)
    rows = re.findall(r"^\| (`[^|]*`) \|", text, flags=re.M)
    in_table = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert set(parameters) <= in_table, sorted(set(parameters) - in_table)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_docs_leads_somewhere():
    """The README and docs/ point at each other's files and sections (issue 48 item 9 moved reference material from
    the README to docs/): every relative link names a file that exists and, with ``#anchor``, one of its headings."""
    broken = []
    for path in [*_DOCS, REPO / "BENCHMARKS.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{path.name}: {target}")
    assert not broken, broken


def _bash_lines(text: str) -> list[str]:
    return [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for line in block.splitlines()]


def test_the_readme_installs_once_then_runs_its_commands_as_written():
    """Issue 48 items 1 and 2: the quick lane failed with "No module named pytest" (the only [dev] install was inside
    the whole suite's command), and bare ``tbp`` commands were "command not found" (the README never activates its
    venv). CI runs the README's install block, then its whole-suite command, verbatim (.ci/run --print)."""
    import subprocess

    text = (REPO / "README.md").read_text()
    lines = _bash_lines(text)
    install = lines.index('python3 -m venv .venv && .venv/bin/pip install -e ".[dev]"')
    assert install < lines.index('.venv/bin/python -m pytest -q -m "not slow"') < lines.index(
        ".venv/bin/python -m pytest -q")
    assert [line for line in lines if "pip install" in line and "[dev]" in line] == [lines[install]], "once"
    bare = [line for line in lines if not line.startswith((".venv/bin/", "python3 -m venv .venv && "))]
    assert not bare, bare
    printed = subprocess.run(["bash", str(REPO / ".ci" / "run"), "--print"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    assert printed == f"{lines[install]} && .venv/bin/python -m pytest -q\n", printed
    assert '.venv/bin/pip install -e ".[examples]"' in lines[0]


def test_the_quick_starts_install_draws_the_report_of_its_own_job():
    """Issue 41 item 1: after the Quick start's install (``[examples]``), ``tbp report`` of the main job said
    "plotly is not installed"."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    extras = config["options.extras_require"]
    report = {line.split(">")[0].split("=")[0].strip() for line in extras["report"].split() if line.strip()}
    examples = {line.split(">")[0].split("=")[0].strip() for line in extras["examples"].split() if line.strip()}
    assert report <= examples, report - examples


def test_the_readme_says_what_a_glob_reader_and_read_outputs_see_while_a_job_runs():
    """Issue 41 item 4: DESIGN §14 promised glob readers every committed row at every moment; the protocol shows
    mid-job rows to a glob only at a shard's roll-over (test_record_shards checks both behaviours). The README's
    records paragraph says both in one sentence."""
    paragraphs = (REPO / "README.md").read_text().split("\n\n")
    (said,) = [p for p in paragraphs if "While a job runs, a reader of the" in p]
    sentence = " ".join(said.split()).split("While a job runs, ")[1].split("; once")[0]
    assert "at most once" in sentence and "rolls over" in sentence and "read_outputs" in sentence
    assert "exactly once at every moment" in sentence
