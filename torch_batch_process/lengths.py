"""Cheap ways to get the example lengths that ``bucket_by`` takes (DESIGN §9).

``torch_batch_process(..., bucket_by=lengths)`` sorts the examples of each window by length so that a
batch holds examples of similar length and pads little. ``bucket_by`` is one int per example, in
dataset order, or a callable ``index -> int``. Three common ways to get them:

- **A list you already have**: any sequence of ints works as is (a list, a numpy array, a CPU tensor,
  a pyarrow array), e.g. ``bucket_by=[len(t) for t in texts]`` or ``bucket_by=df["n_tokens"].to_numpy()``.
- **A column of a Hugging Face dataset**: :func:`column_lengths` reads the lengths with Arrow compute,
  without decoding a single row in Python: for a list column (``input_ids`` of a tokenized dataset)
  the list lengths, which are exact token counts; for a string column the number of characters
  (Unicode code points). Characters are counted at memory speed (tens of ms per million strings),
  while splitting on whitespace is about 50 times slower and, as a proxy for subword tokens, worse.
  Characters are only a proxy: on the 12,922 docstring sentences of Python's standard library
  (all-MiniLM-L6-v2 tokens, batches of 32, default window) sorting by characters cuts the padded
  tokens from 844,530 (dataset order) to 507,342, sorting by exact token counts to 320,690 (the
  sentences hold 311,069 tokens; whitespace words give 597,416). Code, numbers and rare words make
  tokens per character vary; prefer exact counts when the data allows.
- **A tokenizer pass**: :func:`tokenized_lengths` tokenizes the texts once, in batches, through a
  ``torch.utils.data.DataLoader`` (optionally with workers), and returns the exact token counts. It
  works with any Hugging Face tokenizer and with any callable that maps a list of
  strings to their token sequences. With the fast MiniLM tokenizer it counts 10,000-20,000 sentences
  a second on 2 CPU cores, a few hundred times the rate at which the same CPU embeds them, so well
  under 1% of such a job; on a GPU the model may be as fast as the tokenizer, so compute the lengths
  once and store them (``numpy.save``), or keep a tokenized dataset and use :func:`column_lengths`.

Example::

    from torch_batch_process import torch_batch_process
    from torch_batch_process.lengths import column_lengths, tokenized_lengths

    lengths = column_lengths(hf_dataset, "input_ids")            # a tokenized HF dataset
    lengths = tokenized_lengths(hf_dataset, tokenizer, column="text")  # or: tokenize once
    torch_batch_process(Processor, hf_dataset, batch_size=64, bucket_by=lengths)

The lengths only order and cut the batches, so a proxy is safe (it just pads more than exact counts),
but they are part of the job's fingerprint: a resume must pass the same lengths again (all helpers
here are deterministic).

**At 10^8 examples** (DESIGN §14) the lengths' container decides the cost before the plan starts: a Python
list of 10^8 ints takes over 3 GB, a callable is called 10^8 times (minutes), and a tokenizer pass at
10,000-20,000 texts a second takes hours. The cheapest ways, cheapest first:

- an **Arrow array straight from the data**: ``pyarrow.compute.utf8_length(table["text"])`` (characters of
  a string column), ``pyarrow.compute.list_value_length(table["input_ids"])`` (exact token counts of a
  tokenized column), or :func:`column_lengths` on a Hugging Face dataset: one pass at memory speed, an
  ``int32`` result (400 MB for 10^8 rows) that ``bucket_by`` takes as it is, without a copy (a
  ``ChunkedArray``'s chunks are joined once, into ``uint16`` for token counts: 200 MB);
- a **numpy array** you stored (``numpy.save`` / ``numpy.load(..., mmap_mode="r")``), in the narrowest
  integer type that holds the lengths (``uint16`` for token counts): used as it is, no copy;
- exact token counts for texts that are not tokenized yet: tokenize the dataset once and store the
  ``input_ids`` column (e.g. ``datasets.Dataset.map(..., batched=True, num_proc=...)``), then take
  :func:`column_lengths` of it; :func:`tokenized_lengths` suits up to a few million texts.

The plan itself keeps no array of the dataset's size (8 bytes per batch) and plans about a million examples
at a time: 10^8 lengths (a numpy ``int32`` array, batches of 32) plan in ~9 s on one core of this project's
2-core test machine with ~100 MB of memory over the lengths (``python -m benchmarks.scale`` measures it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.integers import is_integer

__all__ = ["column_lengths", "tokenized_lengths"]


def _is_hf_dataset(value: Any) -> bool:
    """Whether ``value`` looks like a map-style Hugging Face ``datasets.Dataset`` (without importing datasets)."""
    return hasattr(value, "column_names") and hasattr(value, "data") and hasattr(value, "select_columns")


def column_lengths(dataset: Any, column: str) -> np.ndarray:
    """Length of each row's ``column`` value of a Hugging Face ``datasets.Dataset``, via Arrow compute.

    Args:
        dataset: a map-style ``datasets.Dataset`` (also after ``select``, ``shuffle``, ``filter``: the
            lengths follow the dataset's own row order).
        column: a string column (lengths in characters, i.e. Unicode code points), a binary column
            (bytes) or a list column such as ``input_ids`` (number of items). A null counts as 0.

    Returns:
        An integer numpy array with one length per row, in dataset order, ready for ``bucket_by``: Arrow's own
        length type (``int32``, 4 bytes per row, or ``int64`` for the ``large_*`` types), without a copy to int64.

    Raises:
        InvalidArgumentError: ``dataset`` is not a map-style HF dataset, or ``column`` is missing or of
            another type.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if not _is_hf_dataset(dataset):
        raise InvalidArgumentError(
            f"column_lengths takes a map-style Hugging Face datasets.Dataset, got {type(dataset).__name__}; for "
            f"other data use tokenized_lengths(...) or pass bucket_by a list of ints"
        )
    if column not in dataset.column_names:
        raise InvalidArgumentError(
            f"column_lengths: the dataset has no column {column!r}; its columns are {list(dataset.column_names)}"
        )
    values = dataset.data.column(column)
    kind = values.type

    def is_any(*checks: str) -> bool:  # the *_view types only exist in recent pyarrow versions
        return any(getattr(pa.types, check, lambda _: False)(kind) for check in checks)

    if is_any("is_string", "is_large_string", "is_string_view"):
        lengths = pc.utf8_length(values)
    elif is_any("is_binary", "is_large_binary", "is_binary_view"):
        lengths = pc.binary_length(values)
    elif is_any("is_list", "is_large_list", "is_fixed_size_list", "is_list_view", "is_large_list_view"):
        lengths = pc.list_value_length(values)
    else:
        raise InvalidArgumentError(
            f"column_lengths: column {column!r} has Arrow type {kind}; it needs a string, binary or list column "
            f"(for example the text, or the input_ids of a tokenized dataset)"
        )
    result = np.asarray(pc.fill_null(lengths, 0).to_numpy())
    # A dataset after select/shuffle/filter keeps its table and maps its rows through an indices table
    # (`_indices`, a documented part of datasets' internals for years); measure the whole table once and
    # gather the small int lengths instead of gathering the strings themselves.
    indices = getattr(dataset, "_indices", None)
    if indices is not None:
        result = result[np.asarray(indices.column(0).to_numpy(), dtype=np.int64)]
    if len(result) != len(dataset):
        raise InvalidArgumentError(
            f"column_lengths: got {len(result)} lengths for a dataset of {len(dataset)} rows; this version of "
            f"datasets maps rows in a way this function does not know: compute the lengths with "
            f"tokenized_lengths(...) instead"
        )
    return result


def _identity(item: Any) -> Any:
    """``collate_fn`` that keeps a chunk's numpy array as it is (module level, so workers can pickle it)."""
    return item


class _LeanHFCall:
    """Calls a Hugging Face tokenizer without the attention mask and token type ids (about twice as fast;
    only ``input_ids`` are counted). A class, not a lambda, so that loader workers can pickle it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, texts: list[str]) -> Any:
        return self.tokenizer(texts, return_attention_mask=False, return_token_type_ids=False)


def _is_hf_tokenizer(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a ``transformers`` tokenizer (if it is, ``transformers`` is already imported)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedTokenizerBase", None) if transformers is not None else None
    return base is not None and isinstance(tokenizer, base)


class _TokenCounts(torch.utils.data.Dataset):
    """Item ``k``: the token counts of texts ``[k * chunk, (k + 1) * chunk)``, computed where it is loaded."""

    def __init__(self, texts: Any, tokenizer: Callable[[list[str]], Any], column: str | None, chunk: int) -> None:
        self.column = column
        self.chunk = chunk
        self.tokenizer = tokenizer
        self.columnar = _is_hf_dataset(texts)
        # Only the text column, in plain Python form: slices come back as {column: [str, ...]}.
        self.texts = texts.select_columns([column]).with_format(None) if self.columnar else texts
        self.size = len(texts)

    def __len__(self) -> int:
        return -(-self.size // self.chunk)

    def _texts(self, start: int, stop: int) -> list[str]:
        if self.columnar:
            return list(self.texts[start:stop][self.column])
        if isinstance(self.texts, (list, tuple)):
            items = self.texts[start:stop]
        else:
            items = [self.texts[i] for i in range(start, stop)]
        if self.column is None:
            return list(items)
        return [item[self.column] for item in items]

    def __getitem__(self, k: int) -> np.ndarray:
        start = k * self.chunk
        texts = self._texts(start, min(start + self.chunk, self.size))
        encoded = self.tokenizer(texts)
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
        if len(ids) != len(texts):
            raise InvalidArgumentError(
                f"tokenized_lengths: the tokenizer returned {len(ids)} token sequences for {len(texts)} texts; it "
                f"must return one per text (no overflowing tokens, no padding to tensors)"
            )
        return np.fromiter((len(sequence) for sequence in ids), dtype=np.int64, count=len(texts))


def tokenized_lengths(
    texts_or_dataset: Sequence[str] | Any,
    tokenizer: Callable[[list[str]], Any],
    *,
    column: str | None = None,
    batch_size: int = 1000,
    num_workers: int = 0,
    max_length: int | None = None,
) -> np.ndarray:
    """Exact token counts of texts, from one batched tokenizer pass through a ``DataLoader``.

    Args:
        texts_or_dataset: a sequence of strings; a Hugging Face ``datasets.Dataset`` (with ``column``,
            read column-wise in slices); or any map-style dataset whose items are strings, or mappings
            holding the text under ``column``.
        tokenizer: called with a list of up to ``batch_size`` strings; returns a mapping with
            ``"input_ids"`` (what Hugging Face tokenizers return; do not ask it for padded tensors) or a
            sequence with one token sequence per string. Special tokens it adds are counted, as they
            are in the padded batch.
        column: the text column or key, for datasets whose items are rows.
        batch_size: texts per tokenizer call.
        num_workers: ``DataLoader`` worker processes. ``0`` (the default) suits a fast (Rust)
            tokenizer, which already uses several threads for one batch; workers help a tokenizer
            written in Python. (With workers, do not force ``TOKENIZERS_PARALLELISM=true``: a fast
            tokenizer that used its threads before the fork can then hang in the workers.)
        max_length: if set, counts are capped at it, as ``truncation=True, max_length=...`` would.

    Returns:
        int64 array of one token count per text, in order, ready for ``bucket_by``.

    Raises:
        InvalidArgumentError: a bad argument (named), or a tokenizer that does not return one sequence per text.
    """
    if not is_integer(batch_size) or batch_size < 1:
        raise InvalidArgumentError(f"tokenized_lengths: batch_size must be an int >= 1, got {batch_size!r}")
    if not is_integer(num_workers) or num_workers < 0:
        raise InvalidArgumentError(f"tokenized_lengths: num_workers must be an int >= 0, got {num_workers!r}")
    if max_length is not None and (not is_integer(max_length) or max_length < 1):
        raise InvalidArgumentError(f"tokenized_lengths: max_length must be None or an int >= 1, got {max_length!r}")
    if not callable(tokenizer):
        raise InvalidArgumentError(
            f"tokenized_lengths: tokenizer must be callable on a list of strings, got {type(tokenizer).__name__}"
        )
    if isinstance(texts_or_dataset, (str, bytes)) or not hasattr(texts_or_dataset, "__len__"):
        raise InvalidArgumentError(
            f"tokenized_lengths: texts_or_dataset must be a sequence of strings or a map-style dataset, got "
            f"{type(texts_or_dataset).__name__}"
        )
    if _is_hf_dataset(texts_or_dataset):
        if column is None or column not in texts_or_dataset.column_names:
            raise InvalidArgumentError(
                f"tokenized_lengths: pass column=<the text column> for a Hugging Face dataset; its columns are "
                f"{list(texts_or_dataset.column_names)}, got column={column!r}"
            )
    if len(texts_or_dataset) == 0:
        return np.zeros(0, dtype=np.int64)
    if _is_hf_tokenizer(tokenizer):
        tokenizer = _LeanHFCall(tokenizer)
    loader = torch.utils.data.DataLoader(
        _TokenCounts(texts_or_dataset, tokenizer, column, batch_size),
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_identity,
    )
    counts = np.concatenate(list(loader))
    if max_length is not None:
        np.minimum(counts, max_length, out=counts)
    return counts
