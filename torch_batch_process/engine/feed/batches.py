"""The batch feed: this rank's batches, loaded by a ``torch.utils.data.DataLoader`` with the user's options.

The loader gets the library's batch sampler, which takes batch ids from the scheduler (in the main process,
as the loader asks for more: a few ahead with workers) and gives the loader the dataset indices of each
(``plan.batch_indices``), so only this rank's batches are ever loaded, with the user's workers, pinned memory,
prefetching and ``collate_fn``. The loader yields batches in the sampler's order, so the feed pairs each batch
with its id from a FIFO. A batch that fails to load (its ``__getitem__`` or ``collate_fn`` raised) raises
:class:`LoadFailed` with its id; the feed can go on with the next one after it.

**Batches cut to fit** (``on_oom="split"``, DESIGN §15): when the rank's
:class:`~torch_batch_process.engine.feed.fitting.BatchFitter` knows that a batch would run out of the device's memory,
the sampler hands the loader its parts instead (each one a loader batch, loaded by the user's workers and
``collate_fn`` as any other), and the feed gives them together as one item: a :class:`Cut` (the batch's id and
its parts' dataset indices) and the list of the loaded parts (a part that failed to load is its
:class:`LoadFailed` in the list). The plan is unchanged: a cut batch keeps its ``batch_idx``.

The DataLoader's iterator marks each batch as a profiler range, which costs about 9 us per batch on the main
thread even when no profiler runs (a hand loop pays it too). The feed asks the iterator for its next batch
directly while no profiler is on, and through ``next()`` (with the range) while one is.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import _profiler_enabled
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from torch_batch_process.engine.feed.fitting import BatchFitter
from torch_batch_process.engine.feed.loader_workers import LoaderWorkers
from torch_batch_process.engine.plan.plans import Plan
from torch_batch_process.engine.schedule.scheduler import Scheduler
from torch_batch_process.errors import WorkerLostError

__all__ = ["BatchFeed", "Cut", "LoadFailed"]


class LoadFailed(Exception):
    """Loading batch ``batch_idx`` raised ``error`` (its ``__getitem__`` or the ``collate_fn``)."""

    def __init__(self, batch_idx: int, error: BaseException) -> None:
        super().__init__(f"loading batch {batch_idx} failed: {type(error).__name__}: {error}")
        self.batch_idx = batch_idx
        self.error = error


@dataclass(frozen=True)
class Cut:
    """A batch that runs in parts to fit in the device's memory: its id and its parts' dataset indices, in order."""

    batch_idx: int
    pieces: list[list[int]]


def batch_id(key: int | Cut) -> int:
    """The batch id of a feed item's key."""
    return key.batch_idx if type(key) is Cut else key  # type: ignore[union-attr,return-value]


class _PlanSampler(Sampler[Sequence[int]]):
    """Yields the dataset indices of the scheduler's batches (or of their parts) and remembers their ids
    (or :class:`Cut` s), in order."""

    def __init__(
        self, scheduler: Scheduler, plan: Plan, ids: collections.deque[int | Cut], fitter: BatchFitter
    ) -> None:
        self._scheduler = scheduler
        self._plan = plan
        self._ids = ids
        self._fitter = fitter

    def __iter__(self) -> Iterator[Sequence[int]]:
        fitter = self._fitter
        for batch in self._scheduler.batch_ids():
            indices = self._plan.batch_indices(batch)
            pieces = fitter.cut(indices) if fitter.active else None
            if pieces is None:
                self._ids.append(batch)
                yield list(indices)
            else:
                self._ids.append(Cut(batch, pieces))
                yield from pieces


class BatchFeed:
    """An iterator of ``(batch_idx, batch)``, or ``(Cut, [part, ...])`` for a batch cut to fit (see the module
    docstring); :class:`LoadFailed` for a batch that failed to load (iterate on: the next batches follow).

    Args:
        dataset: the user's map-style dataset.
        plan: the job's plan.
        scheduler: this rank's scheduler.
        loader_kwargs: the user's ``dataloader_kwargs`` (checked before).
        device: this rank's device (on CUDA ``pin_memory`` defaults to True).
        fitter: the rank's fitter, which cuts batches that would not fit (it knows nothing with ``on_oom="raise"``).
        watch: ``batch_timeout``: times each wait for a batch (the watchdog's span), else ``None``.
    """

    def __init__(
        self,
        dataset: Any,
        plan: Plan,
        scheduler: Scheduler,
        loader_kwargs: dict[str, Any],
        device: torch.device,
        fitter: BatchFitter,
        watch: Callable[[Callable[[], int | None]], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self._ids: collections.deque[int | Cut] = collections.deque()
        kwargs = dict(loader_kwargs)
        self._workers = LoaderWorkers(kwargs.get("worker_init_fn"))
        kwargs["worker_init_fn"] = self._workers.init
        if device.type == "cuda":
            kwargs.setdefault("pin_memory", True)
        self.loader = DataLoader(dataset, batch_sampler=_PlanSampler(scheduler, plan, self._ids, fitter), **kwargs)
        self._iter: Iterator[Any] | None = None
        self._direct: Callable[[], Any] | None = None  # the iterator's next batch without its profiler range
        self.watch = watch
        """``batch_timeout``: times each wait for a batch (``BatchWatchdog.span``), else ``None``."""

    def start(self) -> None:
        """Starts the loader (its workers fork here) and its first claims."""
        if self._iter is None:
            self._iter = self._workers.start(self.loader)
            self._direct = _without_profiler_range(self._iter)

    def __iter__(self) -> BatchFeed:
        return self

    def __next__(self) -> tuple[Any, Any]:
        self.start()
        assert self._iter is not None
        if self._workers.died is not None:  # reported meanwhile (engine/feed/loader_workers.py): raised here, safely
            raise LoadFailed(batch_id(self._ids[0]) if self._ids else -1, self._workers.died)
        batch = self._pull()
        key = self._ids[0]  # the sampler gave its indices, so its id is queued (a cut batch's: until all parts are in)
        if type(key) is not Cut:
            self._ids.popleft()
            if isinstance(batch, LoadFailed):
                raise batch from batch.error
            return key, batch
        parts = [batch]  # the loader yields the parts one after the other: take them all
        for _ in key.pieces[1:]:
            parts.append(self._pull())
        self._ids.popleft()
        return key, parts

    def _pull(self) -> Any:
        """The loader's next batch, or a :class:`LoadFailed` (for the id at the head) when loading it raised."""
        assert self._iter is not None
        try:
            if self.watch is None:  # the common case, inline: this runs once per batch
                return self._direct() if self._direct is not None and not _profiler_enabled() else next(self._iter)
            with self.watch(self._waiting_for):
                return self._fetch()
        except StopIteration:
            raise
        except WorkerLostError:  # the scheduler lost the rendezvous store: not this batch's fault
            raise
        except Exception as exc:  # noqa: BLE001 - a failing dataset or collate_fn: attributed to its batch
            if not self._ids:
                raise
            return LoadFailed(batch_id(self._ids[0]), exc)

    @staticmethod
    def load_error(key: int | Cut, error: Exception) -> LoadFailed:
        """``error`` (raised while the batch of ``key`` was copied to the device) as that batch's load failure."""
        return LoadFailed(batch_id(key), error)

    def _fetch(self) -> Any:
        assert self._iter is not None
        return self._direct() if self._direct is not None and not _profiler_enabled() else next(self._iter)

    def _waiting_for(self) -> int | None:
        """The batch the feed waits for (the loader yields in the sampler's order), ``None`` before its claim."""
        ids = self._ids
        return batch_id(ids[0]) if ids else None

    def close(self) -> None:
        """Stops the loader's worker processes (explicitly: a loading error kept alive, e.g. in a failure record's
        exception chain, would otherwise keep the loader's iterator and its workers alive until exit), even one
        stuck in a load (see :mod:`~torch_batch_process.engine.feed.loader_workers`)."""
        it, self._iter, self._direct = self._iter, None, None
        self._workers.stop(it)


def _without_profiler_range(iterator: Iterator[Any]) -> Callable[[], Any] | None:
    """What a DataLoader iterator's ``__next__`` runs inside its profiler range (it also counts batches, for a
    warning about iterable datasets, which the feed never gives it), or ``None`` for any other iterator."""
    if not isinstance(iterator, _BaseDataLoaderIter) or getattr(iterator, "_sampler_iter", None) is None:
        return None
    return getattr(iterator, "_next_data", None)
