"""Length bucketing (DESIGN §9): padded tokens and the plan's cost on the MiniLM benchmark's sentences.

Prints, for the sentences of the MiniLM workload (batches of 32, token counts of all-MiniLM-L6-v2's tokenizer
capped at 128 as the workload's ``collate_fn`` truncates): the real tokens, the padded tokens in dataset order,
with ``bucket_by`` at windows of 16 batches, at the default window and over the whole job, and what computing
the plan costs (the tokenizer pass of :func:`~torch_batch_process.lengths.tokenized_lengths` plus the layout).
The throughput this buys is in the table of ``python -m benchmarks.run --contenders hand_loop,tbp_bucket``.

    python -m benchmarks.bucketing [--examples 768,12288]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import configure_process
from benchmarks.workloads import MINILM_MAX_LENGTH, load_sentences, minilm_dir
from torch_batch_process.arguments import DEFAULT_BUCKET_WINDOW
from torch_batch_process.engine.plan.bucketing import bucket_layout, contiguous_padded_tokens

BATCH_SIZE = 32


def measure(n: int) -> dict[str, float]:
    """Padded tokens and plan cost for the first ``n`` sentences of the workload."""
    from transformers import AutoTokenizer

    from torch_batch_process.lengths import tokenized_lengths

    sentences = load_sentences(n)
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    started = time.perf_counter()
    lengths = tokenized_lengths(sentences, tokenizer, max_length=MINILM_MAX_LENGTH)
    lengths_s = time.perf_counter() - started
    started = time.perf_counter()
    layout = bucket_layout(lengths, BATCH_SIZE, DEFAULT_BUCKET_WINDOW, None)
    layout_s = time.perf_counter() - started
    whole = -(-n // BATCH_SIZE)
    return {
        "examples": n,
        "real": int(np.sum(lengths)),
        "dataset order": contiguous_padded_tokens(lengths, BATCH_SIZE),
        "window 16": bucket_layout(lengths, BATCH_SIZE, 16, None).padded_tokens(lengths),
        f"window {DEFAULT_BUCKET_WINDOW} (default)": layout.padded_tokens(lengths),
        "whole job": bucket_layout(lengths, BATCH_SIZE, whole, None).padded_tokens(lengths),
        "lengths s": lengths_s,
        "layout s": layout_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", default="768,12288", help="comma-separated numbers of sentences")
    args = parser.parse_args(argv)
    configure_process(1)
    rows = [measure(int(n)) for n in args.examples.split(",")]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:.3f}" if isinstance(row[k], float) else f"{row[k]:,}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
