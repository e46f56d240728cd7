"""Typed payloads: what a commit participant adds to a vote, or rank 0 shares back with every rank (DESIGN §20,
:mod:`~torch_batch_process.engine.commit.participants`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar, TypeVar

__all__ = ["Payload", "Payloads"]


class Payload:
    """A participant's contribution to one vote: subclasses are small frozen dataclasses; :attr:`key` names the
    payload (the key it had in the votes of earlier versions)."""

    key: ClassVar[str]


P = TypeVar("P", bound=Payload)


class Payloads:
    """The typed payloads of one vote (or of one message rank 0 shares), at most one of each type."""

    __slots__ = ("_items",)

    def __init__(self, items: Sequence[Payload] = ()) -> None:
        self._items: dict[type[Payload], Payload] = {type(item): item for item in items}

    def get(self, kind: type[P]) -> P | None:
        """The payload of type ``kind``, or ``None`` when the vote carries none."""
        item = self._items.get(kind)
        return item if item is None or isinstance(item, kind) else None

    def __iter__(self) -> Iterator[Payload]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Payloads({list(self._items.values())!r})"
