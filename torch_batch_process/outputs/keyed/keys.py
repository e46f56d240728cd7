"""Keys and content of the examples of a keyed job (DESIGN §21): which key each example has, what of it is hashed.

``torch_batch_process(..., key=..., content=...)`` names them:

- ``key``: the name of a field of each example (a column of a streamed source, a key of a dict example), or a
  function of the example. A key is an ``int`` (numpy integers and 0-d integer tensors are taken as ints; it must
  fit in int64) or a ``str``, the same type for every example of the job; anything else (floats, whose equality is
  fragile, bytes, tuples, ``None``) is refused naming the example, so that no two examples share a key by accident.
- ``content``: what is hashed (:mod:`~torch_batch_process.outputs.keyed.content_hash`): ``None``, the whole example
  (what ``process_batch`` receives, before collation); a list of field names; or a function of the example.
  Naming a few columns (the text, not the precomputed features) makes the hash cheap and ignores fields that do
  not change the outputs.

:class:`KeySpec` holds both; :meth:`KeySpec.key_batch` turns examples into the Arrow columns (``key``, ``hash``) that
the planner (:mod:`~torch_batch_process.outputs.keyed.diff`) takes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.outputs.columns import require_pyarrow
from torch_batch_process.outputs.keyed.content_hash import HASH_SCHEME, content_hash

__all__ = ["HASH_COLUMN", "KEY_COLUMN", "KeySpec", "check_key_spec", "key_array", "key_value"]

KEY_COLUMN = "key"
"""The key column of the planner's inputs (and the stored column's name when ``key`` is a function)."""
HASH_COLUMN = "hash"
"""The content hash column of the planner's inputs."""


def key_value(value: Any, where: str) -> int | str:
    """``value`` as a key (an int or a str), or :class:`InvalidArgumentError` naming ``where`` it came from."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        number = int(value)
    elif _is_int_tensor(value):
        number = int(value.item())
    else:
        raise InvalidArgumentError(
            f"key: {where} has the key {value!r:.80} of type {type(value).__name__}; a key must be an int or a str "
            "(cast it in the key function, e.g. key=lambda example: str(example['id']))"
        )
    if not -(2**63) <= number < 2**63:
        raise InvalidArgumentError(f"key: {where} has the key {number}, which does not fit in int64; use a str key")
    return number


def _is_int_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return (
        torch is not None and isinstance(value, torch.Tensor) and value.dim() == 0
        and not value.dtype.is_floating_point and not value.dtype.is_complex and value.dtype != torch.bool
    )


@dataclass(frozen=True)
class KeySpec:
    """The key and content of a keyed job's examples (see the module docstring)."""

    key: str | Callable[[Any], Any]
    content: tuple[str, ...] | Callable[[Any], Any] | None = None

    @property
    def column(self) -> str:
        """The name of the key's column in the outputs: the field's name, or ``"key"`` for a key function."""
        return self.key if isinstance(self.key, str) else KEY_COLUMN

    @property
    def fields(self) -> tuple[str, ...] | None:
        """The only fields of an example its key and hash read (a named key and ``content=`` names), ``None`` when
        a function or the whole example is involved: a columnar source can read just these."""
        if not isinstance(self.key, str) or not isinstance(self.content, tuple):
            return None
        return tuple(dict.fromkeys((self.key, *self.content)))

    def key_of(self, example: Any, index: int) -> int | str:
        """The key of ``example`` (dataset index ``index``, for messages)."""
        if isinstance(self.key, str):
            if not isinstance(example, Mapping):
                raise InvalidArgumentError(
                    f"key={self.key!r}: example {index} is a {type(example).__name__}, not a dict with a field "
                    f"{self.key!r}; give a function of the example instead (key=lambda example: ...)"
                )
            if self.key not in example:
                raise InvalidArgumentError(
                    f"key={self.key!r}: example {index} has no field {self.key!r} "
                    f"(it has {sorted(map(str, example))[:20]})"
                )
            return key_value(example[self.key], f"example {index}")
        return key_value(_apply(self.key, example, "key", index), f"example {index}")

    def hash_of(self, example: Any, index: int) -> int:
        """The content hash of ``example`` (dataset index ``index``, for messages)."""
        if self.content is None:
            return content_hash(example)
        if callable(self.content):
            return content_hash(_apply(self.content, example, "content", index))
        if not isinstance(example, Mapping):
            raise InvalidArgumentError(
                f"content={list(self.content)}: example {index} is a {type(example).__name__}, not a dict; give a "
                "function of the example instead (content=lambda example: ...)"
            )
        missing = [name for name in self.content if name not in example]
        if missing:
            raise InvalidArgumentError(f"content: example {index} has no field {missing[0]!r}")
        return content_hash({name: example[name] for name in self.content})

    def key_batch(self, examples: Iterable[Any], first_index: int) -> Any:
        """The keys and content hashes of ``examples`` (dataset indices from ``first_index`` on) as a
        ``pyarrow.RecordBatch`` of columns ``key`` (int64 or string) and ``hash`` (int64)."""
        pa = require_pyarrow()
        keys: list[int | str] = []
        hashes: list[int] = []
        for offset, example in enumerate(examples):
            index = first_index + offset
            keys.append(self.key_of(example, index))
            hashes.append(self.hash_of(example, index))
        return pa.record_batch(
            [key_array(keys, first_index), pa.array(hashes, pa.int64())], names=[KEY_COLUMN, HASH_COLUMN]
        )

    def describe(self) -> dict[str, Any]:
        """What identifies the key and content in the job's fingerprint."""
        return {
            "key": self.key if isinstance(self.key, str) else _qualname(self.key),
            "content": (
                None if self.content is None
                else _qualname(self.content) if callable(self.content) else list(self.content)
            ),
            "hash": HASH_SCHEME,
        }


def key_array(keys: Sequence[int | str], first_index: int) -> Any:
    """Keys (already checked by :func:`key_value`) as one Arrow array: int64 or string, never both."""
    pa = require_pyarrow()
    if not keys:
        return pa.array([], pa.int64())
    kind = type(keys[0])
    for offset, key in enumerate(keys):
        if type(key) is not kind:
            raise InvalidArgumentError(
                f"key: example {first_index + offset} has a {type(key).__name__} key ({key!r:.80}) but example "
                f"{first_index} has a {kind.__name__} key; every key of a job has one type"
            )
    try:
        return pa.array(keys, pa.int64() if kind is int else pa.string())
    except (UnicodeEncodeError, pa.ArrowException):
        for offset, key in enumerate(keys):  # a str that is not Unicode text (a lone surrogate): no UTF-8 for it
            try:
                str(key).encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidArgumentError(
                    f"key: example {first_index + offset} has the key {key!r:.80}, which is not Unicode text "
                    f"({exc.reason} at position {exc.start}): keys are stored as UTF-8; mend the text, or give a key "
                    "function that does (e.g. key=lambda example: example['id'].encode('utf-8', 'replace').decode())"
                ) from exc
        raise


def _is_text(name: str) -> bool:
    """Whether ``name`` has a UTF-8 encoding (no lone surrogate)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _apply(fn: Callable[[Any], Any], example: Any, argument: str, index: int) -> Any:
    """``fn(example)``: a key or content function's value, or :class:`InvalidArgumentError` naming the function,
    the example and what it raised (planning calls it on every example before any work)."""
    try:
        return fn(example)
    except Exception as exc:  # noqa: BLE001 - the user's function: named with its error, which is chained
        raise InvalidArgumentError(
            f"{argument}: the function {_qualname(fn)} raised {type(exc).__name__} on example {index} ({exc!s:.200}); "
            f"it must give every example's {argument}: mend the function (or the example)"
        ) from exc


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def check_key_spec(key: Any, content: Any) -> KeySpec | None:
    """Checks ``key=`` and ``content=`` before any work; ``None`` when the job is not keyed."""
    if key is None:
        if content is not None:
            raise InvalidArgumentError("content= names what to hash of a keyed job's examples; give key= too")
        return None
    if isinstance(key, str):
        if not key or key.startswith("_tbp_") or key == "index":
            raise InvalidArgumentError(
                f"key={key!r}: name a field of the examples (not empty, not 'index' nor a '_tbp_' column: the "
                "library stores those)"
            )
        if not key.isascii() and not _is_text(key):  # it names the key's column, which Arrow stores as UTF-8
            raise InvalidArgumentError(
                f"key={key!r}: the name is not Unicode text (a lone surrogate, as a name decoded with "
                "'surrogateescape' holds) and cannot name the key's column; give a key function instead "
                f"(key=lambda example: example[{key!r}]: its column is then named 'key')"
            )
    elif not callable(key):
        raise InvalidArgumentError(
            f"key must be the name of a field of the examples or a function of the example, got {key!r:.80}"
        )
    if content is None or callable(content):
        return KeySpec(key, content)
    if isinstance(content, (str, bytes)) or not isinstance(content, Iterable):
        raise InvalidArgumentError(
            f"content must be None (the whole example), a list of field names or a function, got {content!r:.80}"
        )
    names = tuple(content)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise InvalidArgumentError(f"content must list one or more field names, got {list(names)!r:.80}")
    return KeySpec(key, names)
