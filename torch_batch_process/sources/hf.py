"""A Hugging Face ``datasets.IterableDataset`` as a source, read by its own shards.

The shards are the dataset's (``num_shards``: its files, or the items of the lists in
``gen_kwargs`` of ``IterableDataset.from_generator``); shard ``i`` is
``dataset.shard(num_shards=n, index=i)``, which holds exactly the ``i``-th original shard. Row
counts are unknown (``num_rows=None``).

- **No seeking.** Hugging Face iterable datasets cannot seek: ``read(shard, start)`` iterates the
  shard from its beginning and drops the first ``start`` rows (counted in ``rows_read``). Reads of
  consecutive ranges continue one iterator, so a shard read range after range is iterated once.
- **Deterministic order.** Exactly-once outputs need the same rows in the same order on every
  run: a dataset shuffled without a seed, or with an epoch set, yields another order after a
  restart. Such datasets are not detected; shuffle with a fixed ``seed`` or not at all.
- **Workers.** Reads go through ``IterableDataset.iter(batch_size=...)``, which reads the shard it
  is given whole, also inside a DataLoader worker (plain iteration there would split the shard
  again between the workers). Datasets split with ``split_dataset_by_node`` are refused: the
  library itself deals the shards to the ranks.
- **Formats.** Unformatted datasets and the ``numpy``/``torch``/... formats (examples are dicts)
  are supported; table formats (``arrow``, ``pandas``, ``polars``) are refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.sources.base import Cursor, ShardInfo, Source

__all__ = ["HFSource", "from_hf"]

_TABLE_FORMATS = {"arrow", "pa", "pyarrow", "pandas", "pd", "polars", "pl"}
_JSON_SCALARS = (str, int, float, bool, type(None))


def from_hf(iterable_dataset: Any) -> HFSource:
    """A source over a Hugging Face ``datasets.IterableDataset``, one shard per dataset shard.

    Raises:
        InvalidArgumentError: not an ``IterableDataset`` (a map-style ``datasets.Dataset`` is
            passed directly as ``dataset=``), already split by node, or a table format.
    """
    return HFSource(iterable_dataset)


class HFSource(Source):
    """A Hugging Face iterable dataset read by shards; see :func:`from_hf`."""

    kind = "hf"
    #: Rows per ``IterableDataset.iter`` batch.
    HF_BATCH_ROWS: ClassVar[int] = 256

    def __init__(self, iterable_dataset: Any) -> None:
        super().__init__()
        try:
            import datasets
        except ImportError as exc:  # pragma: no cover - datasets is a dependency of this source only
            raise InvalidArgumentError("from_hf needs the Hugging Face datasets package; pip install datasets") from exc
        ds = iterable_dataset
        if isinstance(ds, datasets.Dataset):
            raise InvalidArgumentError(
                "from_hf(iterable_dataset) got a map-style datasets.Dataset; pass it directly as dataset=..., "
                "or convert it with .to_iterable_dataset(num_shards=...)"
            )
        if not isinstance(ds, datasets.IterableDataset):
            raise InvalidArgumentError(
                f"from_hf(iterable_dataset) got {type(ds).__name__}; pass a datasets.IterableDataset "
                "(e.g. load_dataset(..., streaming=True)), or use sources.Sharded for other streams"
            )
        if getattr(ds, "_distributed", None) is not None:
            raise InvalidArgumentError(
                "from_hf(iterable_dataset) got a dataset split with split_dataset_by_node; pass the whole dataset: "
                "torch_batch_process deals its shards to the ranks itself"
            )
        formatting = getattr(ds, "_formatting", None)
        self._format: str | None = getattr(formatting, "format_type", None)
        if self._format in _TABLE_FORMATS:
            raise InvalidArgumentError(
                f"from_hf(iterable_dataset) is formatted as {self._format!r}; use .with_format(None) (dict examples) "
                "or a tensor format such as 'torch' or 'numpy'"
            )
        self._dataset = ds
        count = int(getattr(ds, "num_shards", None) or ds.n_shards)
        label = _label(ds)
        self._data = [_shard_data(ds.shard(num_shards=count, index=i)) for i in range(count)]
        self._shards = [ShardInfo(f"hf:{label}#{i}", None) for i in range(count)]
        self._description = {
            "dataset": getattr(ds.info, "dataset_name", None),
            "config": getattr(ds.info, "config_name", None),
            "split": None if ds.split is None else str(ds.split),
            "features": None if ds.features is None else str(ds.features),
            "format": self._format,
            "pipeline": _pipeline(ds),
        }

    @property
    def dataset(self) -> Any:
        """The wrapped ``IterableDataset``."""
        return self._dataset

    def shards(self) -> list[ShardInfo]:
        return list(self._shards)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            **self._description,
            "shards": [{"name": info.name, "data": data} for info, data in zip(self._shards, self._data, strict=True)],
        }

    def _open_cursor(self, shard: int, start: int, stop: int | None) -> _HFCursor:
        return _HFCursor(self, shard)


class _HFCursor(Cursor):
    """An iterator over the batches of one shard, from its beginning."""

    source: HFSource

    def __init__(self, source: HFSource, shard: int) -> None:
        super().__init__(source, shard, 0)
        one = source._dataset.shard(num_shards=len(source._shards), index=shard)
        self._batches = iter(one.iter(batch_size=source.HF_BATCH_ROWS))
        self._buffer: list[Any] = []

    def _produce(self, n: int) -> list[Any]:
        if not self._buffer:
            batch = next(self._batches, None)
            if batch is None:
                return []
            self._buffer = _rows_of(batch)
            self.source._count_read(len(self._buffer))
        rows = self._buffer[:n]
        del self._buffer[:n]
        return rows

    def close(self) -> None:
        self._buffer = []
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


def _rows_of(batch: Any) -> list[dict[str, Any]]:
    """The examples of a column batch (a dict of equally long lists, arrays or tensors)."""
    if not batch:
        return []
    names = list(batch)
    columns = [batch[name] for name in names]
    size = len(columns[0])
    return [{name: column[i] for name, column in zip(names, columns, strict=True)} for i in range(size)]


def _label(ds: Any) -> str:
    info = ds.info
    name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None) or "dataset"
    split = "" if ds.split is None else f"/{ds.split}"
    return f"{name}{split}"


def _shard_data(one: Any) -> dict[str, Any]:
    """What one shard reads, as far as it can be said in JSON: the lists of its generator's
    keyword arguments (file names for ``load_dataset(..., streaming=True)``)."""
    ex = one._ex_iterable
    while getattr(ex, "kwargs", None) is None and getattr(ex, "ex_iterable", None) is not None:
        ex = ex.ex_iterable
    kwargs = getattr(ex, "kwargs", None) or {}
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if isinstance(value, (list, tuple)) and all(isinstance(v, _JSON_SCALARS) for v in value):
            out[key] = list(value)
        elif isinstance(value, _JSON_SCALARS):
            out[key] = value
    return out


def _pipeline(ds: Any) -> list[str]:
    """The classes of the dataset's chain of example iterables (map, filter, shuffle...)."""
    chain: list[str] = []
    ex = getattr(ds, "_ex_iterable", None)
    while ex is not None and len(chain) < 64:
        chain.append(type(ex).__name__)
        ex = getattr(ex, "ex_iterable", None)
    return chain
