"""The keyed-job options of a call (DESIGN §21): ``key=``, ``content=``, ``version=``, ``incremental=``,
``on_change=``, checked before any work, and the columns they add to every row the job writes.

A keyed job's rows carry, next to ``index`` and the user's columns:

==================  ==============  ===========================================================================
column              type            meaning
==================  ==============  ===========================================================================
the key's name      int64 / string  the example's key (``key="id"``: ``id``; a key function: ``key``)
``_tbp_hash``       int64           the content hash of the example when it was processed
``_tbp_version``    string          the version (digest) of the run that wrote the row
``_tbp_run``        int32           the run that wrote it: 1 for the job's first run, ``k + 1`` for ``retries/<k>``
==================  ==============  ===========================================================================

The *version* is a digest of what determines a row's values besides its content: the processor's qualified name and,
for a ``generation.Generate`` processor, what it declares (its ``generation_fingerprint``: engine, model, tokenizer,
sampling, prompt...), the user's ``version=`` (any JSON value: a model revision, a prompt's name; kept as JSON gives it
back, so a tuple is a list; NaN and infinities, which JSON lacks, are refused), the hash scheme, ``autocast`` and
``inference_mode``. Not the batch size, the world size or the schedule, which do not change the outputs.

The key and hash of a processed example are computed in the main process when its batch's rows are written
(:class:`RowStamp`: one more ``dataset[i]`` per processed example; cheap for in-memory and Arrow-backed
datasets). The rows of a batch must be one per example of ``context.batch_indices`` (what ``context.write``
already requires).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.jobstore.formats import qualified_name
from torch_batch_process.outputs.columns import require_pyarrow
from torch_batch_process.outputs.keyed.content_hash import HASH_SCHEME
from torch_batch_process.outputs.keyed.diff import ON_CHANGE
from torch_batch_process.outputs.keyed.keys import KeySpec, check_key_spec, key_array

__all__ = [
    "HASH_FIELD",
    "KEYED_COLUMNS",
    "RUN_FIELD",
    "VERSION_FIELD",
    "KeyedOptions",
    "RowStamp",
    "check_keyed_options",
]

HASH_FIELD = "_tbp_hash"
VERSION_FIELD = "_tbp_version"
RUN_FIELD = "_tbp_run"
KEYED_COLUMNS = (HASH_FIELD, VERSION_FIELD, RUN_FIELD)
"""The columns the library adds to a keyed job's rows (besides the key)."""


@dataclass(frozen=True)
class KeyedOptions:
    """A keyed job's options, checked (see the module docstring)."""

    spec: KeySpec
    version: Any = None
    """The user's ``version=`` (a JSON value), or ``None``."""
    digest: str = ""
    """The run's version: a digest of what determines the outputs (see the module docstring)."""
    incremental: bool = False
    on_change: str = "refuse"
    run: int = 1
    """The run that writes rows: 1 for the job's first run, ``k + 1`` for ``retries/<k>``."""
    increment: dict[str, Any] | None = field(default=None, compare=False)
    """The planner's counts of this run (``None``: the job's first run or a plain retry)."""
    prune_missing: bool = False
    """Stored keys the dataset no longer has leave the outputs (``prune_missing=True``)."""
    removed: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    """This run's removed keys when it prunes them (a table's first transaction deletes them)."""

    @property
    def column(self) -> str:
        """The key's column in the rows."""
        return self.spec.column

    def describe(self) -> dict[str, Any]:
        """What a job's spec keeps (its fingerprint): the key's identity and the run's version."""
        return {**self.spec.describe(), "column": self.column, "version": self.digest, "version_value": self.version}

    def for_run(self, run: int, increment: dict[str, Any] | None = None, removed: Sequence[Any] = ()) -> KeyedOptions:
        """The same options for run ``run`` (``removed``: the keys it prunes)."""
        return replace(self, run=run, increment=increment, removed=tuple(removed))


def check_keyed_options(
    key: Any,
    content: Any,
    version: Any,
    incremental: Any,
    on_change: Any,
    *,
    prune_missing: Any = False,
    processor: type,
    dataset: Any,
    autocast: Any,
    inference_mode: bool,
    retry_failed: bool,
    table: Any,
) -> KeyedOptions | None:
    """Checks the keyed options of a call before any work; ``None`` when the job is not keyed (``processor``: the
    processor class, whose name and declared fingerprint are part of the version)."""
    if not isinstance(incremental, bool):
        raise InvalidArgumentError(f"incremental must be True or False, got {incremental!r:.80}")
    if on_change not in ON_CHANGE:
        raise InvalidArgumentError(f"on_change must be one of {list(ON_CHANGE)}, got {on_change!r:.80}")
    if not isinstance(prune_missing, bool):
        raise InvalidArgumentError(f"prune_missing must be True or False, got {prune_missing!r:.80}")
    spec = check_key_spec(key, content)
    if spec is None:
        for name, value, default in (("version", version, None), ("incremental", incremental, False),
                                     ("on_change", on_change, "refuse"), ("prune_missing", prune_missing, False)):
            if value != default:
                raise InvalidArgumentError(
                    f"{name}={value!r:.80} is for a keyed job: give key= too (the field of each example, or a "
                    "function of the example, that identifies it)"
                )
        return None
    if prune_missing and not incremental:
        raise InvalidArgumentError(
            "prune_missing=True removes the keys an incremental run no longer finds in the dataset: give "
            "incremental=True too"
        )
    if on_change != "refuse" and not incremental:  # else it would be a silent no-op: a plain call never recomputes
        raise InvalidArgumentError(
            f"on_change={on_change!r} says what an incremental run does with rows of another version: give "
            "incremental=True too"
        )
    if retry_failed:
        raise InvalidArgumentError(
            "retry_failed=True on a keyed job: run it with incremental=True instead (it processes the examples that "
            "failed, with those that are new or changed); drop retry_failed=True"
        )
    if table is not None and (getattr(table, "kind", "") not in ("delta", "iceberg", "lance")
                              or "://" in str(getattr(table, "uri", ""))):
        raise InvalidArgumentError(
            f"key= with table={table.describe_short()} is not supported yet: a keyed job's MERGE by key is built for "
            "local Delta and Lance tables (tables.delta('/path'), tables.lance('/path')) and Iceberg tables so far; "
            "write shards (no table=), or drop key="
        )
    problem = table.name_problem(spec.column) if table is not None else None
    if problem is not None:  # the key's column: refused now, not by the table's format after the first batch ran
        raise InvalidArgumentError(
            f"key={spec.column!r}: {table.describe_short()} cannot hold a column of that name ({problem}); give a key "
            f"function instead (key=lambda example: example[{spec.column!r}]: its column is then named 'key')"
        )
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) and not _is_source(dataset):
        raise InvalidArgumentError(
            f"key= needs a map-style dataset (with __len__ and __getitem__) or a streamed source "
            f"(torch_batch_process.sources), got {type(dataset).__name__}"
        )
    try:  # allow_nan=False: NaN is no JSON, and NaN != NaN would make the stored job never match the call
        declared = json.dumps(version, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"version must be a JSON value (a str such as a model revision, a finite number, a list or dict of them), "
            f"got {version!r:.80}"
        ) from exc
    version = json.loads(declared)  # as stored in the job's spec (a tuple is a list): a resume compares equal
    generation = getattr(processor, "generation_fingerprint", None)  # generation.Generate: model, sampling...
    fingerprint = json.dumps(
        {"processor": qualified_name(processor), "version": declared, "hash": HASH_SCHEME, "autocast": autocast,
         "inference_mode": inference_mode, **({"generation": generation} if generation is not None else {})},
        sort_keys=True,
    )
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return KeyedOptions(spec, version, digest, incremental, on_change, prune_missing=prune_missing)


def _is_source(dataset: Any) -> bool:
    from torch_batch_process.sources.base import Source

    return isinstance(dataset, Source)


class RowStamp:
    """Adds a keyed job's columns to the rows of a batch (see the module docstring).

    Args:
        options: the job's keyed options (its run).
        dataset: the examples by index (``dataset[i]``; with ``__getitems__``, a batch's rows are read at once: a
            streamed source's :class:`~torch_batch_process.engine.feed.streams.StreamDataset`) whose key and hash
            are stored.
        on_failed: called with the key of every failed example (a table target removes the key's row: its
            :meth:`~torch_batch_process.outputs.tables.sink.TableSink.failed`).
    """

    def __init__(self, options: KeyedOptions, dataset: Any, on_failed: Callable[[Any], None] | None = None) -> None:
        self.options = options
        self.dataset = dataset
        self.on_failed = on_failed

    def __call__(self, table: Any, indices: Sequence[int]) -> Any:
        """``table`` (one row per index of ``indices``, ``index`` first) with the key and ``_tbp_*`` columns."""
        pa = require_pyarrow()
        options, spec = self.options, self.options.spec
        taken = [c for c in KEYED_COLUMNS if c in table.column_names]
        if taken:
            raise InvalidArgumentError(
                f"context.write(): column {taken[0]!r} is reserved in a keyed job (the library stores it); rename it"
            )
        keys, hashes = [], []
        rows = [int(i) for i in indices]
        # a streamed source's rows are read as runs of consecutive rows (StreamDataset), not one seek per row
        examples = self.dataset.__getitems__(rows) if hasattr(self.dataset, "__getitems__") else None
        for offset, index in enumerate(rows):
            example = examples[offset] if examples is not None else self.dataset[index]
            keys.append(spec.key_of(example, int(index)))
            hashes.append(spec.hash_of(example, int(index)))
        key_column = key_array(keys, int(indices[0]) if len(indices) else 0)
        name = options.column
        if name in table.column_names:
            written = table.column(name)
            if written.to_pylist() != keys:
                raise InvalidArgumentError(
                    f"context.write(): column {name!r} holds other values than the examples' keys (key={name!r}); "
                    "write the key unchanged, or leave the column out (the library adds it)"
                )
            table = table.drop_columns([name])
        n = table.num_rows
        return (
            table.append_column(name, key_column)
            .append_column(HASH_FIELD, pa.array(hashes, pa.int64()))
            .append_column(VERSION_FIELD, pa.array([options.digest] * n, pa.string()))
            .append_column(RUN_FIELD, pa.array([options.run] * n, pa.int32()))
        )

    def failure_fields(self, index: int) -> dict[str, Any]:
        """The fields of a failure record of example ``index``: its key and this run (none when the example's key
        cannot be had: its loading failed)."""
        try:
            key = self.options.spec.key_of(self.dataset[index], index)
        except Exception:  # noqa: BLE001 - the example itself fails to load: the record has no key
            return {}
        if self.on_failed is not None:
            self.on_failed(key)
        return {"key": key, RUN_FIELD: self.options.run}
