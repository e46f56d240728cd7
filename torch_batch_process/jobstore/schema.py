"""The job's record schema: which column types and per-example shapes ``context.write()`` batches may mix.

One rule decides, for a rank's batches (its shard writer, :mod:`torch_batch_process.outputs.records`) and for
the ranks and attempts of a job (rank 0 checks each commit vote against the job's schema before the record
that commits it, :class:`~torch_batch_process.engine.commit.keeper.RecordKeeper`): two types *unify* when

- they are equal;
- one is ``null`` (a column that was all ``None`` so far), or a list of ``null`` (all empty lists so far): the
  other wins;
- both are numbers: the wider wins (``int32`` and ``int64``: ``int64``; an integer and a float: ``float64``);
- both are lists: their values unify, and their per-example shapes agree: fixed-size lists of the same size
  stay fixed. A fixed size that changes, or a fixed size against a variable-length list, unifies (into a
  variable-length list) only for a *ragged* column: one written as a list of per-example values (Python lists,
  or a list of per-example tensors whose shapes may differ), never one written as a tensor or array, whose
  per-example shape is fixed (``(N, 3)`` then ``(N, 4)`` is an error, not a silent change of type);
- both are structs (per-example dicts): fields by name, each unified, missing ones added.

Anything else (a string against a number, a tensor whose per-example shape changed) raises
:class:`~torch_batch_process.errors.SchemaConflictError` (an ``InvalidArgumentError``) naming the column,
both types and where each came from, before the rows are committed: the stored shards of a job always unify
into one table. It fails the job even with ``on_error="skip"``: the code is at fault, not an example.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from torch_batch_process.errors import SchemaConflictError

__all__ = ["RecordSchema", "describe_type", "unify"]

FIX_HINT = (
    "give every batch the same types and per-example shapes (pad to a fixed shape, or write a list of per-example "
    "tensors for shapes that vary)"
)


@dataclass(frozen=True)
class RecordSchema:
    """The columns of record rows: their Arrow schema, which of them are ragged, and where it was first seen.

    Attributes:
        schema: the ``pyarrow.Schema`` (``index`` first).
        ragged: columns written as lists of per-example values (see the module docstring).
        origin: where the schema was first seen, for messages (``"batch 12 (rank 1)"``).
    """

    schema: Any
    ragged: frozenset[str]
    origin: str

    def to_json(self) -> dict[str, Any]:
        """For a commit record: the schema in Arrow's IPC encoding (base64), the ragged columns, the origin."""
        encoded = base64.b64encode(self.schema.serialize().to_pybytes()).decode("ascii")
        return {"arrow": encoded, "ragged": sorted(self.ragged), "origin": self.origin}

    @classmethod
    def from_json(cls, value: Any, where: str) -> RecordSchema:
        """The schema :meth:`to_json` stored (its origin then says it was committed by an earlier run); raises
        ``ValueError`` naming ``where`` when it is damaged."""
        try:
            import pyarrow as pa

            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(value["arrow"], validate=True)))
            ragged = value["ragged"]
            if not isinstance(ragged, list) or not all(isinstance(name, str) for name in ragged):
                raise TypeError("ragged is not a list of column names")
            origin = str(value["origin"])
            return cls(schema, frozenset(ragged), origin if origin.endswith(EARLIER_RUN) else origin + EARLIER_RUN)
        except Exception as exc:  # noqa: BLE001 - any damage reads the same
            raise ValueError(f"{where}: the record outputs' schema is damaged ({exc})") from exc


EARLIER_RUN = ", committed by an earlier run"


def unify(earlier: RecordSchema | None, later: RecordSchema) -> RecordSchema:
    """The schema that holds the rows of both (``earlier``'s column order and origin).

    Raises:
        SchemaConflictError: the columns differ, or a column's types do not unify (see the module docstring).
    """
    if earlier is None:
        return later
    ragged = earlier.ragged | later.ragged
    if earlier.schema.equals(later.schema):
        return earlier if ragged == earlier.ragged else RecordSchema(earlier.schema, ragged, earlier.origin)
    names, other = earlier.schema.names, later.schema.names
    if set(names) != set(other):
        raise SchemaConflictError(
            f"context.write(): {later.origin} wrote the columns {other[1:]}, {earlier.origin} {names[1:]}; write the "
            "same columns in every batch"
        )
    import pyarrow as pa

    fields = []
    for field in earlier.schema:
        theirs = later.schema.field(field.name).type
        try:
            fields.append(pa.field(field.name, _unify_type(field.type, theirs, field.name in ragged)))
        except _Mismatch as exc:
            raise SchemaConflictError(
                f"context.write(): column {field.name!r} is {describe_type(theirs)} in {later.origin}, "
                f"{describe_type(field.type)} in {earlier.origin}{exc.detail}; {FIX_HINT}"
            ) from None
    return RecordSchema(pa.schema(fields), ragged, earlier.origin)


class _Mismatch(Exception):
    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail


def _unify_type(a: Any, b: Any, ragged: bool) -> Any:
    import pyarrow as pa

    types = pa.types
    if a.equals(b):
        return a
    if types.is_null(a):
        return b
    if types.is_null(b):
        return a
    if _is_list(a) and _is_list(b):
        if _all_empty(a):  # lists that were all empty so far
            return b
        if _all_empty(b):
            return a
        value = _unify_type(a.value_type, b.value_type, ragged)
        if types.is_fixed_size_list(a) and types.is_fixed_size_list(b) and a.list_size == b.list_size:
            return pa.list_(value, a.list_size)
        if not ragged and (types.is_fixed_size_list(a) or types.is_fixed_size_list(b)):
            raise _Mismatch(" (a tensor's per-example shape changed; only a list of per-example values may vary)")
        large = types.is_large_list(a) or types.is_large_list(b)
        return pa.large_list(value) if large else pa.list_(value)
    if types.is_struct(a) and types.is_struct(b):
        theirs = {field.name: field.type for field in b}
        fields = [
            pa.field(f.name, _unify_type(f.type, theirs[f.name], ragged) if f.name in theirs else f.type) for f in a
        ]
        fields += [f for f in b if a.get_field_index(f.name) < 0]
        return pa.struct(fields)
    if _is_number(a) and _is_number(b):
        pair = [pa.schema([("v", a)]), pa.schema([("v", b)])]
        return pa.unify_schemas(pair, promote_options="permissive").field(0).type
    raise _Mismatch()


def _is_list(arrow_type: Any) -> bool:
    import pyarrow as pa

    types = pa.types
    return bool(types.is_list(arrow_type) or types.is_large_list(arrow_type) or types.is_fixed_size_list(arrow_type))


def _all_empty(arrow_type: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_null(arrow_type.value_type) and not pa.types.is_fixed_size_list(arrow_type))


def _is_number(arrow_type: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type))


def describe_type(arrow_type: Any) -> str:
    """A stored type as a user wrote it: ``float (2, 3)`` for a ``(N, 2, 3)`` tensor, ``list of int64``..."""
    import pyarrow as pa

    shape: list[int] = []
    while pa.types.is_fixed_size_list(arrow_type):
        shape.append(arrow_type.list_size)
        arrow_type = arrow_type.value_type
    if _is_list(arrow_type):
        inner = f"list of {describe_type(arrow_type.value_type)}"
        return f"{inner} per element of shape {tuple(shape)}" if shape else inner
    if shape:
        return f"{arrow_type} of per-example shape {tuple(shape)}"
    return str(arrow_type)
