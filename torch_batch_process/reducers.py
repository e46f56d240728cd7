"""Metric reducers: metrics computed exactly over the whole dataset, across ranks and resumes.

The API is Determined's: a :class:`MetricReducer` accumulates values on each rank ("slot"),
``per_slot_reduce()`` turns them into a small picklable summary, and ``cross_slot_reduce()`` combines
the summaries of all slots into the metric. A plain function can be wrapped too: it then receives the
flat list of every value passed to ``update()``.

Exact across resumes: every commit stores each rank's ``per_slot_reduce()`` result. When a job is
resumed, the stored summaries of earlier attempts are kept as extra slots and the final
``cross_slot_reduce()`` receives them together with the live ones, so the metric equals that of an
uninterrupted run whatever the world sizes were. ``cross_slot_reduce`` may therefore receive more
summaries than there are ranks.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch_batch_process.errors import InvalidArgumentError


class MetricReducer(metaclass=abc.ABCMeta):
    """Accumulates values on one rank and reduces them across ranks (Determined's interface).

    Example::

        class AccuracyReducer(MetricReducer):
            def __init__(self):
                self.reset()

            def reset(self):
                self.correct, self.total = 0, 0

            def update(self, correct, total):
                self.correct += correct
                self.total += total

            def per_slot_reduce(self):
                return self.correct, self.total

            def cross_slot_reduce(self, per_slot_metrics):
                correct, total = map(sum, zip(*per_slot_metrics))
                return correct / max(total, 1)
    """

    @abc.abstractmethod
    def reset(self) -> None:
        """Clears the accumulated values."""

    @abc.abstractmethod
    def per_slot_reduce(self) -> Any:
        """Returns this rank's picklable summary of the values seen so far. Must not change state."""

    @abc.abstractmethod
    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        """Combines the summaries of all slots into the metric (a value, or a dict of metrics)."""


class _NotAValue:
    pass


_NOT_A_VALUE = _NotAValue()


class SimpleReducer(MetricReducer):
    """Wraps a function ``fn(values) -> metric`` as a :class:`MetricReducer`.

    Values passed to ``update()`` are kept in memory; ``fn`` receives them all as one flat list,
    interleaved across slots (which restores the dataset order when ``update()`` is called once per
    batch on a fresh run).
    """

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn
        self.values: list[Any] = []

    def reset(self) -> None:
        self.values = []

    def update(self, value: Any) -> None:
        """Records one value."""
        self.values.append(value)

    def per_slot_reduce(self) -> list[Any]:
        return list(self.values)

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        interleaved = itertools.zip_longest(*per_slot_metrics, fillvalue=_NOT_A_VALUE)
        flat = [value for group in interleaved for value in group if value is not _NOT_A_VALUE]
        return self.fn(flat)


@dataclass
class WrappedReducer:
    """A registered reducer and the name its metric is reported under (``None``: a dict of metrics)."""

    reducer: MetricReducer
    name: str | None

    @property
    def label(self) -> str:
        return f"{type(self.reducer).__name__}(name={self.name!r})"

    def per_slot_reduce(self) -> Any:
        try:
            return self.reducer.per_slot_reduce()
        except Exception as exc:
            raise RuntimeError(f"reducer {self.label} failed in per_slot_reduce()") from exc

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> dict[str, Any]:
        try:
            reduced = self.reducer.cross_slot_reduce(per_slot_metrics)
        except Exception as exc:
            raise RuntimeError(f"reducer {self.label} failed in cross_slot_reduce()") from exc
        if self.name is None:
            if not isinstance(reduced, dict):
                raise TypeError(
                    f"reducer {self.label} was wrapped with name=None, so it must return a dict of "
                    f"metrics, but it returned a {type(reduced).__name__}; pass name='...' to "
                    "wrap_reducer() to report a single metric"
                )
            return dict(reduced)
        if isinstance(reduced, dict):
            raise TypeError(
                f"reducer {self.label} was wrapped with a name, so it must return a single metric, "
                "but it returned a dict; use name=None to report a dict of metrics"
            )
        return {self.name: reduced}


R = TypeVar("R", bound=MetricReducer)


class ReducerRegistry:
    """The reducers one rank has registered with ``context.wrap_reducer()``."""

    def __init__(self) -> None:
        self.wrapped: list[WrappedReducer] = []

    def wrap(self, reducer: MetricReducer | Callable[[list[Any]], Any], name: str | None = None) -> MetricReducer:
        """Registers a reducer; returns it (a :class:`SimpleReducer` when given a function)."""
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError(f"wrap_reducer(name=...) must be a str or None, got {type(name).__name__}")
        if name == "":
            raise InvalidArgumentError("wrap_reducer(name=''): the metric needs a name (or None for a reducer returning a dict)")
        if isinstance(reducer, type) and issubclass(reducer, MetricReducer):
            raise InvalidArgumentError(
                f"wrap_reducer(reducer=...) takes a MetricReducer instance, got the class {reducer.__name__}: pass "
                f"{reducer.__name__}() (a class is callable, so it would be taken for a function fn(values) and fail "
                "only when the job ends)"
            )
        if any(w.reducer is reducer for w in self.wrapped):
            raise InvalidArgumentError(
                f"wrap_reducer(reducer=...): this {type(reducer).__name__} is already wrapped; "
                "wrap each reducer object once"
            )
        if name is not None and any(w.name == name for w in self.wrapped):
            raise InvalidArgumentError(f"wrap_reducer(name={name!r}): a reducer with this name is already wrapped")
        if not isinstance(reducer, MetricReducer):
            if not callable(reducer):
                raise InvalidArgumentError(
                    "wrap_reducer(reducer=...) takes a MetricReducer instance or a function "
                    f"fn(values) -> metric, got {type(reducer).__name__}"
                )
            reducer = SimpleReducer(reducer)
        self.wrapped.append(WrappedReducer(reducer, name))
        return reducer

    def signature(self) -> list[dict[str, str | None]]:
        """Names and types of the registered reducers, to check a resume registers the same ones."""
        return [{"name": w.name, "type": type(w.reducer).__name__} for w in self.wrapped]

    def per_slot_states(self) -> list[Any]:
        """This rank's ``per_slot_reduce()`` result of every reducer, in registration order."""
        return [w.per_slot_reduce() for w in self.wrapped]

    def cross_slot_reduce(self, slots: Sequence[Sequence[Any]]) -> dict[str, Any]:
        """Reduces the per-slot states of all slots (live ranks and earlier attempts) into metrics."""
        metrics: dict[str, Any] = {}
        for i, wrapped in enumerate(self.wrapped):
            metrics.update(wrapped.cross_slot_reduce([slot[i] for slot in slots]))
        return metrics
