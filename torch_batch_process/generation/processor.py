"""The ready processor of generation jobs: ``generation.Generate(model=..., prompt=..., ...)`` is a
:class:`~torch_batch_process.TorchBatchProcessor` class that answers one prompt per example, with a continuous-batching
engine kept full across batch boundaries, one row per prompt (DESIGN §19). A user writes no loop::

    Summarize = generation.Generate(model=lambda device: build_model().to(device), tokenizer=tokenizer,
                                    prompt="doc", max_new_tokens=64)
    torch_batch_process(Summarize, dataset, batch_size=32, storage_path="runs/summaries")

Each rank builds the model (``model(device)``), starts a :class:`~torch_batch_process.generation.TransformersEngine`
(or a :class:`~torch_batch_process.generation.VLLMEngine` with ``engine="vllm"``), tokenizes each batch's prompts and
hands them to the engine with ``context.generate``: the batch is committed with its rows once its last prompt is
answered. Rows: ``index`` (the library's), ``text`` (with a tokenizer), ``finish_reason``, ``prompt_tokens``,
``completion_tokens``, and ``token_ids`` when asked for.

Decisions: tokenization runs in ``process_batch`` on the main thread (fast tokenizers take microseconds per prompt;
a ``collate_fn`` that returns token ids moves it into the loader's workers: pass ``prompt`` a column of token ids).
The job's fingerprint holds the engine, the model's name (``model_id``, else the model object's ``name_or_path``,
else the callable's qualified name) and ``revision``, the tokenizer's name and a hash of its vocabulary, the
sampling, ``max_new_tokens`` and the prompt: a resume with other values is refused. It does not hash the weights
(too costly for large models): name a changed checkpoint with ``revision``; nor a function's code (``prompt`` and
``max_new_tokens`` functions are held by their qualified names): name a changed prompt template with ``revision`` too.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.generation.engine import CacheBudget, GenerationEngine
from torch_batch_process.generation.limits import check_drain_s, check_max_in_flight
from torch_batch_process.generation.requests import Completion, Prompt
from torch_batch_process.generation.sampling import Sampling
from torch_batch_process.integers import is_int, is_integer
from torch_batch_process.processor import TorchBatchProcessor

__all__ = ["COLUMNS", "DEFAULT_COLUMNS", "Generate"]

COLUMNS = ("text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens")
"""The columns a :func:`Generate` job may write (besides the library's ``index``)."""
DEFAULT_COLUMNS = ("text", "finish_reason", "prompt_tokens", "completion_tokens")
ENGINES = ("transformers", "vllm")


def Generate(  # noqa: N802 - it makes a processor class: named like one
    *,
    model: Any,
    prompt: str | Callable[[dict[str, Any]], Any],
    max_new_tokens: int | str | Callable[[dict[str, Any]], int],
    tokenizer: Any = None,
    sampling: Sampling | None = None,
    engine: str = "transformers",
    budget: CacheBudget | None = None,
    columns: Sequence[str] | None = None,
    eos_token_id: int | tuple[int, ...] | None = None,
    context_length: int | None = None,
    max_in_flight: int | None = None,
    drain_s: float | None = None,
    model_id: str | None = None,
    revision: str | None = None,
) -> type[TorchBatchProcessor]:
    """A processor class answering one prompt per example (see the module docstring); every argument is checked
    here, before any work.

    Args:
        model: ``device -> model`` (built on every rank, on its device), or a ``transformers`` causal language model
            (moved to the rank's device); with ``engine="vllm"`` a model name or folder.
        prompt: the column holding each example's prompt, or ``row -> prompt`` (``row``: the example, a dict of its
            columns when the dataset yields dicts); a prompt is a string (tokenized
            with the tokenizer's special tokens), chat messages (a list of ``{"role", "content"}`` dicts: the
            tokenizer's chat template, with the generation prompt) or token ids (a list of ints, a 1-d tensor).
        max_new_tokens: the most tokens an answer holds: an int, a column name, or ``row -> int``.
        tokenizer: a tokenizer, or its name or folder (``AutoTokenizer.from_pretrained``); ``None``: prompts are
            token ids and rows hold no ``text``.
        sampling: greedy (default) or sampled with a seed per dataset index (:class:`Sampling`).
        engine: ``"transformers"`` (continuous batching in ``transformers``, CPU and GPU) or ``"vllm"`` (GPU).
        budget: the engine's cache (:class:`CacheBudget`; default ``CacheBudget()``).
        columns: the row's columns among :data:`COLUMNS` (default :data:`DEFAULT_COLUMNS`, ``text`` only with a
            tokenizer).
        eos_token_id: the token(s) ending an answer: an int or a tuple of ints (a list or a 1-d tensor too; ``None``:
            the model's; ``()``: none; with ``engine="vllm"`` only ``None`` or ``()``).
        context_length: the most tokens a prompt and its answer hold (``None``: the model's).
        max_in_flight: prompts in flight at most (``None``: 4 x ``budget.max_sequences``; ``schedule="dynamic"`` on
            several ranks: ``budget.max_sequences``).
        drain_s: at a stop, seconds to let the batches in flight finish (``None``: 30); the answers still being
            written then are kept with the stop's commit and continued by the resume (``docs/generation.md``).
        model_id: the model's name in the job's fingerprint; revision: its revision (both optional; with
            ``engine="vllm"`` the revision vLLM loads).

    Raises:
        InvalidArgumentError: an argument has a wrong type or value (the message names it).
    """
    if engine not in ENGINES:
        raise InvalidArgumentError(f"Generate(engine={engine!r}): use 'transformers' or 'vllm'")
    if model is None or (engine == "vllm" and not isinstance(model, str)):
        need = "a model name or folder" if engine == "vllm" else "a transformers model or a function device -> model"
        raise InvalidArgumentError(f"Generate(model=...) must be {need}, got {model!r}")
    if engine == "transformers" and not callable(model) and not hasattr(model, "init_continuous_batching"):
        raise InvalidArgumentError(
            f"Generate(model=...) must be a transformers causal language model or a function device -> model, got "
            f"{type(model).__name__}"
        )
    if not (isinstance(prompt, str) and prompt) and not callable(prompt):
        raise InvalidArgumentError(
            f"Generate(prompt=...) must be a column name or a function row -> prompt, got {prompt!r}"
        )
    if not (isinstance(max_new_tokens, str) and max_new_tokens) and not callable(max_new_tokens) and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1
    ):
        raise InvalidArgumentError(
            f"Generate(max_new_tokens=...) must be an int >= 1, a column name or a function row -> int, got "
            f"{max_new_tokens!r}"
        )
    if isinstance(max_new_tokens, numbers.Integral):
        max_new_tokens = int(max_new_tokens)  # a numpy integer as the int it is (the fingerprint stores it)
    sampling = sampling if sampling is not None else Sampling()
    if not isinstance(sampling, Sampling):
        raise InvalidArgumentError(
            f"Generate(sampling=...) must be a generation.Sampling (e.g. Sampling(temperature=0.7, seed=1)), got "
            f"{type(sampling).__name__}"
        )
    budget = budget if budget is not None else CacheBudget()
    if not isinstance(budget, CacheBudget):
        raise InvalidArgumentError(
            f"Generate(budget=...) must be a generation.CacheBudget, got {type(budget).__name__}"
        )
    max_in_flight = check_max_in_flight(max_in_flight, "Generate")
    drain_s = check_drain_s(drain_s, "Generate")
    if context_length is not None and (not is_int(context_length) or context_length < 2):
        raise InvalidArgumentError(
            f"Generate(context_length=...) must be None (the model's max_position_embeddings) or an int >= 2 (the most "
            f"tokens a prompt and its answer hold), got {context_length!r}"
        )
    if context_length is not None:
        budget.resolved(context_length)  # a cache that cannot hold one whole context: refused now, not on every rank
    eos_token_id = _eos_token_ids(eos_token_id)
    if engine == "vllm" and eos_token_id not in (None, ()):
        raise InvalidArgumentError(
            f"Generate(engine='vllm', eos_token_id={eos_token_id!r}): vLLM takes None (the model's end-of-sequence "
            "tokens) or () (none: answers run to max_new_tokens)"
        )
    for name, value in (("model_id", model_id), ("revision", revision)):
        if value is not None and not (isinstance(value, str) and value):
            raise InvalidArgumentError(
                f"Generate({name}=...) must be None or a non-empty str (it names the model in the job's "
                f"fingerprint), got {value!r}"
            )
    tokenizer = _load_tokenizer(tokenizer)
    if isinstance(columns, str):  # a tuple of its letters would be refused less clearly
        raise InvalidArgumentError(
            f"Generate(columns=...) takes a sequence of column names, e.g. ('text',), got {columns!r}"
        )
    columns = tuple(columns) if columns is not None else tuple(
        c for c in DEFAULT_COLUMNS if c != "text" or tokenizer is not None
    )
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown or not columns:
        raise InvalidArgumentError(f"Generate(columns=...): choose among {COLUMNS}, got {columns!r}")
    if "text" in columns and tokenizer is None:
        raise InvalidArgumentError("Generate(columns=...) holds 'text' but no tokenizer was given to decode answers")
    spec = _Spec(
        model, prompt, max_new_tokens, tokenizer, sampling, engine, budget, columns, eos_token_id, context_length,
        max_in_flight, drain_s, revision,
    )
    fingerprint = {
        "engine": engine,
        "model": model_id or _model_name(model),
        "revision": revision,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "sampling": sampling.fingerprint(),
        "max_new_tokens": max_new_tokens if isinstance(max_new_tokens, (int, str)) else _qualname(max_new_tokens),
        "prompt": prompt if isinstance(prompt, str) else _qualname(prompt),
        "eos": eos_token_id if not isinstance(eos_token_id, tuple) else list(eos_token_id),
        "context_length": context_length,
        "columns": list(columns),
    }
    return type(
        "Generate", (_Generate,), {"spec": spec, "generation_fingerprint": fingerprint, "__module__": __name__}
    )


class _Spec:
    """What a :func:`Generate` class was made with (checked)."""

    def __init__(self, *values: Any) -> None:
        (
            self.model, self.prompt, self.max_new_tokens, self.tokenizer, self.sampling, self.engine, self.budget,
            self.columns, self.eos_token_id, self.context_length, self.max_in_flight, self.drain_s, self.revision,
        ) = values


class _Generate(TorchBatchProcessor):
    """The processor :func:`Generate` makes: one engine per rank, one prompt per example, one row per answer."""

    spec: _Spec
    generation_fingerprint: dict[str, Any]

    def __init__(self, context: Any) -> None:
        self.context = context
        spec = self.spec
        self.engine = _build_engine(spec, context.device)
        context.use_generation_engine(self.engine, max_in_flight=spec.max_in_flight, drain_s=spec.drain_s)

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        spec = self.spec
        indices = self.context.batch_indices
        rows = _rows(batch, len(indices))
        prompts = []
        for index, row in zip(indices, rows, strict=True):
            ids = _token_ids(spec.prompt(row) if callable(spec.prompt) else _column(row, spec.prompt), spec, index)
            limit = spec.max_new_tokens
            limit = _scalar(limit(row)) if callable(limit) else _column(row, limit) if isinstance(limit, str) else limit
            if not is_integer(limit) or limit < 1:  # from the data: 2.5, True or 0 is no count of tokens
                raise InvalidArgumentError(
                    f"Generate(max_new_tokens=...): the example of index {index} asks for {limit!r} new tokens; "
                    "it must be an int >= 1"
                )
            prompts.append(Prompt(int(index), ids, int(limit)))
        self.context.generate(prompts, self._write)

    def _write(self, completions: list[Completion]) -> None:
        if not completions:
            return
        tokenizer, columns = self.spec.tokenizer, self.spec.columns
        values: dict[str, Any] = {
            "text": lambda: [tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in completions],
            "token_ids": lambda: [list(c.token_ids) for c in completions],
            "finish_reason": lambda: [c.finish_reason for c in completions],
            "prompt_tokens": lambda: [c.prompt_tokens for c in completions],
            "completion_tokens": lambda: [c.completion_tokens for c in completions],
        }
        self.context.write({name: values[name]() for name in columns})


def _build_engine(spec: _Spec, device: Any) -> GenerationEngine:
    if spec.engine == "vllm":
        from torch_batch_process.generation.vllm_engine import VLLMEngine

        return VLLMEngine(
            spec.model, sampling=spec.sampling, budget=spec.budget, context_length=spec.context_length,
            eos_token_id=spec.eos_token_id, revision=spec.revision,  # the one the fingerprint names
        )
    from torch_batch_process.generation.transformers_engine import TransformersEngine

    model = spec.model
    if not hasattr(model, "init_continuous_batching"):
        model = model(device)
        if not callable(getattr(model, "init_continuous_batching", None)):  # before .eval(): named, not on None
            raise InvalidArgumentError(
                f"Generate(model=...): the function {_qualname(spec.model)} returned {type(model).__name__}, not a "
                "transformers causal language model; it must return the model built on the device it is given "
                "(e.g. lambda device: AutoModelForCausalLM.from_pretrained(path).to(device))"
            )
    else:
        model = model.to(device)
    model.eval()
    return TransformersEngine(
        model, sampling=spec.sampling, budget=spec.budget, eos_token_id=spec.eos_token_id,
        context_length=spec.context_length,
    )


def _rows(batch: Any, n: int) -> list[Any]:
    """The batch's examples: rows from a dict of columns (the default ``collate_fn``'s), else the batch's elements
    (a list of rows from ``collate_fn=list``, or a tensor's rows)."""
    if isinstance(batch, dict):
        for name, values in batch.items():
            try:
                size = len(values)
            except TypeError:  # a scalar (a 0-d tensor): no value per example
                size = None
            if size != n:  # PyTorch's default collate_fn turns a column of lists into a list of per-position values
                raise InvalidArgumentError(
                    f"Generate takes batches of {n} examples, and the batch's column {name!r} holds {size} values: "
                    "the default collate_fn transposes a column of lists (token ids, chat messages) into one value "
                    "per position; pass dataloader_kwargs={'collate_fn': list} (a list of rows)"
                )
        return [{name: values[i] for name, values in batch.items()} for i in range(n)]
    if hasattr(batch, "__len__") and len(batch) == n:
        return list(batch)
    raise InvalidArgumentError(
        f"Generate takes batches of {n} examples (a dict of columns, a list of rows), got {type(batch).__name__}"
    )


def _column(row: Any, name: str) -> Any:
    if not isinstance(row, dict) or name not in row:
        have = sorted(row) if isinstance(row, dict) else f"an example of type {type(row).__name__}"
        raise InvalidArgumentError(
            f"Generate: the examples have no column {name!r} ({have}); pass a function row -> value instead"
        )
    return _scalar(row[name])


def _scalar(value: Any) -> Any:
    """A 0-d tensor or array as its Python value (the default collate_fn makes a column of ints a tensor)."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value


def _token_ids(prompt: Any, spec: _Spec, index: int) -> list[int]:
    """A prompt (text, chat messages or token ids) as token ids."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        if spec.tokenizer is None:
            raise InvalidArgumentError(
                f"Generate: the prompt of index {index} is text but no tokenizer was given: pass "
                "Generate(tokenizer=...)"
            )
        try:
            return list(spec.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        except Exception as exc:  # e.g. a lone surrogate, which no UTF-8 tokenizer encodes: that example's failure
            raise _cannot_encode(index, exc) from exc
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        if spec.tokenizer is None:
            raise InvalidArgumentError(
                f"Generate: the prompt of index {index} is chat messages but no tokenizer was given: pass "
                "Generate(tokenizer=...)"
            )
        try:  # a message holding a lone surrogate fails as a text prompt does: that example's failure, named
            ids = spec.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:
            raise _cannot_encode(index, exc) from exc
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # a BatchEncoding is no dict
    if isinstance(prompt, (list, tuple)) and all(is_integer(t) for t in prompt):
        return [int(t) for t in prompt]
    raise InvalidArgumentError(
        f"Generate(prompt=...): the prompt of index {index} is a {type(prompt).__name__}; a prompt is a str, chat "
        "messages (a list of {'role', 'content'} dicts) or token ids (a list of ints)"
    )


def _cannot_encode(index: int, exc: Exception) -> InvalidArgumentError:
    """The error of a prompt the tokenizer (or its chat template) cannot turn into tokens, naming its index."""
    return InvalidArgumentError(
        f"Generate: the tokenizer cannot encode the prompt of index {index} ({type(exc).__name__}: {exc})"
    )


def _eos_token_ids(value: Any) -> int | tuple[int, ...] | None:
    """``eos_token_id`` checked: ``None`` (the model's), an int >= 0, or token ids >= 0 (a tuple, a list, a 1-d
    tensor or array; ``()``: none) as a tuple of Python ints (what the fingerprint stores)."""
    if value is None or (is_integer(value) and value >= 0):
        return None if value is None else int(value)
    if hasattr(value, "tolist") and getattr(value, "ndim", 1) == 1:
        value = value.tolist()
    if isinstance(value, (list, tuple)) and all(is_integer(t) and t >= 0 for t in value):
        return tuple(int(t) for t in value)
    raise InvalidArgumentError(
        f"Generate(eos_token_id=...) must be None (the model's end-of-sequence tokens), a token id >= 0, or a tuple "
        f"of them (() for none: answers run to max_new_tokens), got {value!r}"
    )


def _load_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None or not isinstance(tokenizer, str):
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise InvalidArgumentError(
                "Generate(tokenizer=...) must be a tokenizer, its name or folder, or None; got "
                f"{type(tokenizer).__name__}"
            )
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer)


def _model_name(model: Any) -> str:
    if isinstance(model, str):
        return model
    name = getattr(model, "name_or_path", None)
    return name if name else _qualname(model)


def _qualname(value: Any) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


def _tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any] | None:
    """The tokenizer's name and a hash of its vocabulary and chat template (``None``: no tokenizer)."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab() if callable(getattr(tokenizer, "get_vocab", None)) else {}
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()
    template = getattr(tokenizer, "chat_template", None) or ""
    name = str(getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__)
    return {  # a folder by its name only: the job resumes where the files live elsewhere (the hash is the check)
        "name": os.path.basename(name.rstrip("/")) if os.path.isabs(name) else name,
        "vocab_sha256": digest[:16],
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest()[:16] if template else None,
    }
