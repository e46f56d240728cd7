"""torch_batch_process with length bucketing (DESIGN §9): ``bucket_by`` token counts, default window.

The lengths are computed inside the timed job (one tokenizer pass through
:func:`torch_batch_process.lengths.tokenized_lengths`), so their cost is part of the figure and reported
as ``plan_seconds``; with 2 processes the schedule is ``"dynamic"`` (batches of different lengths take
different times). The CNN has no lengths to bucket by: there this contender runs the plain job.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import parse_options
from benchmarks.contenders import tbp


def token_lengths(dataset: Any) -> dict[str, Any]:
    """``bucket_by``: the MiniLM tokenizer's token count of each sentence, capped as the collate_fn truncates."""
    from transformers import AutoTokenizer

    from benchmarks.workloads import MINILM_MAX_LENGTH, minilm_dir
    from torch_batch_process.lengths import tokenized_lengths

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    return {"bucket_by": tokenized_lengths(dataset, tokenizer, max_length=MINILM_MAX_LENGTH)}


def main() -> None:
    opts = parse_options()
    options: dict[str, Any] = {"schedule": "dynamic"} if opts.nproc > 1 else {}
    tbp.run(opts, prepare=token_lengths if opts.workload.name == "minilm" else None, **options)


if __name__ == "__main__":
    main()
