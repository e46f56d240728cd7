"""Do sentence-transformers and torch_batch_process compute the same embeddings? Sentence by sentence.

The lead of the ``tbp_bucket`` contender over the ``sentence_transformers`` contender in ``benchmarks.run``
only counts if both embed every sentence alike. This runs, on the MiniLM workload's sentences:

- the ``tbp_bucket`` contender's job (``bucket_by`` token counts, 1 process) in this process, each batch also
  writing ``context.batch_indices`` so that its rows can be put back in dataset order;
- the ``sentence_transformers`` contender's ``encode`` on 1 process and on its pool of 2 processes;

and prints, per pair, the cosine similarity of every sentence's two embeddings (min, median) and the largest
absolute difference of one component. Batches differ between the two (length-sorted windows against
sentence-transformers' own sort, so different padding), which moves the float results a little; the check
is cosine > 0.999 for every sentence. Exit code 1 when a sentence falls below it.

    python -m benchmarks.st_agreement [--num-examples 768] [--no-pool]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Options
from benchmarks.contenders import sentence_transformers as st_contender
from benchmarks.contenders import tbp, tbp_bucket
from benchmarks.workloads import SIZES, Workload, configure_process

THRESHOLD = 0.999


class IndexedProcessor(tbp.BenchProcessor):
    """The ``tbp`` contender's processor that also writes the batch's dataset indices next to its output."""

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        super().process_batch(batch, batch_idx)
        with self.context.upload_path() as path:
            torch.save(torch.tensor(list(self.context.batch_indices)), Path(path) / f"indices_{batch_idx:07d}.idx")


def library_embeddings(workload: Workload, folder: Path) -> torch.Tensor:
    """The ``tbp_bucket`` contender's embeddings (1 process), in dataset order."""
    opts = Options(workload, folder / "out", folder / "report", nproc=1, workers=1, threads=1)
    tbp.run(opts, prepare=tbp_bucket.token_lengths, processor=IndexedProcessor)
    result = torch.full((workload.num_examples, 384), float("nan"))
    seen = 0
    for indices_file in sorted(opts.out.rglob("indices_*.idx")):
        batch_idx = indices_file.stem.split("_")[1]
        outputs = list(opts.out.rglob(f"batch_{batch_idx}.pt"))
        if len(outputs) != 1:
            raise RuntimeError(f"batch {batch_idx}: {len(outputs)} output files, expected 1")
        indices = torch.load(indices_file, weights_only=True)
        result[indices] = torch.load(outputs[0], weights_only=True)
        seen += len(indices)
    if seen != workload.num_examples or torch.isnan(result).any():
        raise RuntimeError(f"the library's outputs cover {seen} sentences, expected {workload.num_examples}")
    return result


def compare(name: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Prints one row of the table; True when every sentence's cosine is above the threshold."""
    cosine = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)
    worst = int(cosine.argmin())
    ok = bool((cosine > THRESHOLD).all())
    print(
        f"| {name} | {len(cosine)} | {cosine.min():.7f} (sentence {worst}) | {cosine.median():.7f} "
        f"| {(a - b).abs().max():.2e} | {'yes' if ok else 'NO'} |"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-examples", type=int, default=SIZES["minilm"]["full"][0])
    parser.add_argument("--no-pool", action="store_true", help="skip sentence-transformers' 2-process pool")
    args = parser.parse_args(argv)
    configure_process(1)
    with tempfile.TemporaryDirectory(prefix="st_agreement_") as tmp:
        folder = Path(tmp)
        workload = Workload("minilm", args.num_examples, SIZES["minilm"]["full"][1], folder / "cache")
        workload.warm_imports()
        library = library_embeddings(workload, folder)
        sentences = workload.dataset().sentences  # type: ignore[attr-defined]
    model = st_contender.load_model()
    single = st_contender.encode(model, sentences, workload.batch_size)
    print("| embeddings compared | sentences | min cosine | median cosine | max abs difference | all > 0.999 |")
    print("|---|---:|---:|---:|---:|---|")
    ok = compare("torch_batch_process (tbp_bucket, 1 process) vs sentence-transformers encode", library, single)
    if not args.no_pool:
        pool = model.start_multi_process_pool(["cpu"] * 2)
        try:
            pooled = st_contender.encode(model, sentences, workload.batch_size, pool)
        finally:
            model.stop_multi_process_pool(pool)
        ok &= compare("torch_batch_process (tbp_bucket) vs sentence-transformers pool of 2", library, pooled)
        ok &= compare("sentence-transformers encode vs its pool of 2", single, pooled)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
