"""The context handed to each processor: device, reducers, outputs, metrics, ranks, hparams."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_batch_process import settings
from torch_batch_process.device import to_device
from torch_batch_process.distributed_info import DistributedInfo
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.mesh_shape import MeshPosition, generation_on_a_mesh
from torch_batch_process.provenance import describe_checkpoint, describe_model_version
from torch_batch_process.reducers import MetricReducer, ReducerRegistry
from torch_batch_process.result import to_jsonable


class CurrentBatch:
    """The batch a rank is processing now (set by the engine around ``process_batch``)."""

    def __init__(self) -> None:
        self.batch_idx: int | None = None
        self.indices: Sequence[int] | None = None
        self.listeners: list[Callable[[bool], None]] = []
        """Told at the end of each batch whether ``process_batch`` returned (record outputs keep its rows)."""

    def enter(self, batch_idx: int, indices: Sequence[int]) -> None:
        self.batch_idx, self.indices = batch_idx, indices

    def finish(self, ok: bool) -> None:
        """``process_batch`` returned (``ok``) or raised: tells the listeners."""
        for listener in self.listeners:
            listener(ok)

    def leave(self) -> None:
        self.batch_idx, self.indices = None, None


class TorchBatchProcessorContext:
    """What a :class:`~torch_batch_process.TorchBatchProcessor` gets in ``__init__``.

    Attributes:
        device: this rank's device (``cuda:<local_rank>``, ``mps`` or ``cpu``).
        distributed: ranks of this process (``get_rank()``, ``get_size()``, ``get_local_rank()``...)
            and object collectives (``allgather``, ``gather``, ``broadcast`` and their ``_local`` forms), as in
            Determined.
        storage_path: URL (or local path) of the job's storage.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        distributed: DistributedInfo,
        upload_path: Callable[[], contextlib.AbstractContextManager[Path]],
        storage_path: str,
        tensorboard_path: Path,
        metrics_sink: Callable[[dict[str, Any]], None],
        current: CurrentBatch | None = None,
        write_rows: Callable[[Any], None] | None = None,
        mesh: Any = None,
        mesh_position: MeshPosition | None = None,
        use_engine: Callable[..., None] | None = None,
        generate: Callable[[Sequence[Any], Callable[[list[Any]], None]], None] | None = None,
    ) -> None:
        self.device = device
        self.mesh = mesh
        """``mesh=``: the job's torch ``DeviceMesh`` (the user's dimension names, the replicas first), for
        ``parallelize_module`` or ``torch.distributed.pipelining``; ``None`` without ``mesh=``."""
        self._position = mesh_position
        self.distributed = distributed
        self.storage_path = storage_path
        self._current = current or CurrentBatch()
        self._upload_path = upload_path  # the rank's output stager's (outputs/stager.py)
        self._write_rows = write_rows  # the rank's record writer's (outputs/records.py)
        self._use_engine = use_engine  # the rank's batches in flight (engine/feed/in_flight.py)
        self._generate = generate
        self._tensorboard_path = tensorboard_path
        self._metrics_sink = metrics_sink
        self._reducers = ReducerRegistry()
        self._warned_types: set[type] = set()
        self._hparams: dict[str, Any] | None = None

    @property
    def replica_rank(self) -> int:
        """This rank's replica (``mesh=``: batches are dealt over replicas); without a mesh, the rank."""
        return self._position.replica_rank if self._position is not None else self.distributed.rank

    @property
    def num_replicas(self) -> int:
        """Replicas of the model in the job; without a mesh, the number of ranks."""
        return self._position.num_replicas if self._position is not None else self.distributed.size

    @property
    def is_writer(self) -> bool:
        """Whether this rank's outputs count: its replica's last rank with ``mesh=`` (the other ranks' ``write()``
        rows, reducer values and ``upload_path()`` files are not outputs, see docs/mesh.md); without a mesh, always."""
        return self._position.is_writer if self._position is not None else True

    @property
    def batch_indices(self) -> Sequence[int]:
        """The dataset indices of the examples of the batch being processed, in the batch's order.

        For contiguous batches ``range(g * batch_size, min((g + 1) * batch_size, N))``; with ``bucket_by`` the
        examples the plan put together. Only inside ``process_batch``.
        """
        if self._current.indices is None:
            raise RuntimeError("context.batch_indices is only available inside process_batch()")
        return self._current.indices

    def to_device(self, data: Any, warned_types: set[type] | None = None) -> Any:
        """Moves tensors (and numpy arrays, as tensors) nested in ``data`` to this rank's device.

        Copies from pinned memory are non-blocking. See :func:`torch_batch_process.to_device`.
        """
        return to_device(data, self.device, self._warned_types if warned_types is None else warned_types)

    def prepare_model_for_inference(self, model: nn.Module) -> nn.Module:
        """Puts ``model`` in eval mode on this rank's device and returns it."""
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(
                f"prepare_model_for_inference(model=...) takes a torch.nn.Module, got {type(model).__name__}"
            )
        model.eval()
        model.to(self.device)
        return model

    def wrap_reducer(
        self,
        reducer: MetricReducer | Callable[[list[Any]], Any],
        name: str | None = None,
        for_training: bool = True,
        for_validation: bool = True,
    ) -> MetricReducer:
        """Registers a metric reducer whose result appears in the job's ``metrics``.

        Args:
            reducer: a :class:`MetricReducer`, or a function that receives the flat list of every
                value passed to the returned object's ``update(value)``, over all ranks.
            name: the metric's name; ``None`` when the reducer returns a dict of metrics.
            for_training: accepted for compatibility with Determined; ignored.
            for_validation: accepted for compatibility with Determined; ignored.

        Returns:
            ``reducer`` itself, or for a function a reducer with an ``update(value)`` method.
        """
        del for_training, for_validation
        return self._reducers.wrap(reducer, name)

    def upload_path(self) -> contextlib.AbstractContextManager[Path]:
        """A context manager yielding a fresh local folder for output files.

        Everything written in the folder inside the ``with`` block becomes part of the next commit and
        appears under ``<storage_path>/outputs/commit_<n>/rank_<r>/`` once that commit is durable,
        exactly once even if the job is killed and resumed. If the block raises, its files are
        discarded. File names must be unique among this rank's uploads between two commits.
        """
        return self._upload_path()

    def write(self, rows: Any) -> None:
        """Stores one row per example of the current batch as record outputs (inside ``process_batch``).

        The library adds an ``index`` column (the example's dataset index, from :attr:`batch_indices`) and
        streams the rows into Parquet (default) or JSONL shards (``output_format``), committed exactly once with
        the batch under ``<storage_path>/outputs/commit_*/rank_*/records/``; read them back in dataset order
        with :func:`torch_batch_process.read_outputs` or :func:`~torch_batch_process.iter_outputs`. If
        ``process_batch`` raises, the batch's rows are dropped. Call it once per batch.

        Args:
            rows: a dict of columns, each a tensor, numpy array or list whose first dimension is the batch's
                number of examples (tensors of any per-example shape; strings, ints, floats, nested lists), or a
                list of per-example dicts with the same keys. CUDA tensors are copied back asynchronously into
                pinned memory (``write`` does not wait for the GPU; the rows are encoded once the copies land);
                tensors on other devices are copied with ``.cpu()``. The rows hold the values of the call: CPU
                tensors and arrays are copied, so the processor may reuse or change them once ``write`` returns.
        """
        if self._write_rows is None:
            raise RuntimeError("context.write() is not available in this context")
        self._write_rows(rows)

    def use_generation_engine(
        self, engine: Any, *, max_in_flight: int | None = None, drain_s: float | None = None
    ) -> None:
        """Makes ``engine`` (a :class:`~torch_batch_process.generation.GenerationEngine`) this rank's generation
        engine: batches handed to it with :meth:`generate` stay in flight together (call it once, in ``__init__``).

        Args:
            engine: the engine (e.g. ``generation.TransformersEngine(model)``); the library stops it when the call
                ends.
            max_in_flight: prompts in flight at most (``None``: 4 x the engine's ``budget.max_sequences``; with
                ``schedule="dynamic"`` on several ranks, ``budget.max_sequences``: a rank claims only what its engine
                runs, so the ranks end together); what a kill -9 regenerates at most, and what a stop drains.
            drain_s: at a stop (preemption), seconds to wait for the batches in flight to finish before the
                closing commit (``None``: 30); the batches still in flight then are generated again on resume.
        """
        if self._use_engine is None:
            raise RuntimeError("context.use_generation_engine() is not available in this context")
        position = self._position
        if position is not None and position.members > 1:  # mesh=: an engine per member would step out of step
            raise InvalidArgumentError(generation_on_a_mesh(position.members))
        self._use_engine(engine, max_in_flight, drain_s)

    def generate(self, prompts: Sequence[Any], on_done: Callable[[list[Any]], None]) -> None:
        """Hands the current batch's prompts to the generation engine and returns at once (inside
        ``process_batch``): one :class:`~torch_batch_process.generation.Prompt` per example of
        :attr:`batch_indices`. When the batch's last prompt is answered, ``on_done(completions)`` runs on the main
        thread, in the batch's order, failed prompts left out, with :attr:`batch_indices` set to the answered
        indices, so it calls :meth:`write` as ``process_batch`` would; the batch is committed with those rows, once.
        """
        if self._generate is None:
            raise RuntimeError("context.generate() is not available in this context")
        self._generate(prompts, on_done)

    def report_metrics(self, group: str, steps_completed: int, metrics: dict[str, Any]) -> None:
        """Records metrics; they are written to ``<storage_path>/metrics.jsonl`` at the next commit.

        Args:
            group: name of the series (no ``.``), e.g. ``"inference"``.
            steps_completed: the step the metrics belong to (e.g. batches processed so far).
            metrics: JSON-serializable values (numbers, strings, lists, dicts).
        """
        if not isinstance(group, str) or not group or "." in group:
            raise InvalidArgumentError(f"report_metrics(group={group!r}): a non-empty str without '.' is required")
        if not isinstance(steps_completed, int) or isinstance(steps_completed, bool) or steps_completed < 0:
            raise InvalidArgumentError(f"report_metrics(steps_completed={steps_completed!r}): a non-negative int is required")
        if not isinstance(metrics, dict):
            raise InvalidArgumentError(f"report_metrics(metrics=...): a dict is required, got {type(metrics).__name__}")
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise InvalidArgumentError(f"report_metrics(metrics=...): keys must be str, got {key!r}")
            _check_metric_value(value, f"metrics[{key!r}]")
        clean = {k: to_jsonable(v) for k, v in metrics.items()}
        self._metrics_sink(
            {"group": group, "steps_completed": steps_completed, "rank": self.distributed.rank, "metrics": clean}
        )

    def report_task_using_model_version(self, model_version: Any) -> None:
        """Records that this job uses ``model_version`` (Determined's ``ModelVersion``, a name, or any object).

        The entry is kept with the job's commits (``tbp status`` shows it) and in ``metrics.jsonl``
        (group ``"provenance"``); see :mod:`torch_batch_process.provenance`.
        """
        self._report_provenance(describe_model_version(model_version))

    def report_task_using_checkpoint(self, checkpoint: Any) -> None:
        """Records that this job uses ``checkpoint`` (Determined's ``Checkpoint``, a path or URL, or any object).

        Kept like :meth:`report_task_using_model_version`.
        """
        self._report_provenance(describe_checkpoint(checkpoint))

    def _report_provenance(self, entry: dict[str, Any]) -> None:
        self._metrics_sink({"group": "provenance", "steps_completed": 0, "rank": self.distributed.rank, "metrics": entry})

    def get_tensorboard_path(self) -> Path:
        """A local folder for TensorBoard event files and profiler traces of this rank.

        ``<storage_path>/tensorboard/rank_<r>`` for local storage; for remote storage a local
        temporary folder whose files are uploaded to ``<storage_path>/tensorboard/rank_<r>/`` at
        commits and when the job returns.
        """
        self._tensorboard_path.mkdir(parents=True, exist_ok=True)
        return self._tensorboard_path

    def get_distributed_rank(self) -> int:
        """Global rank of this process."""
        return self.distributed.rank

    def get_distributed_size(self) -> int:
        """Number of processes of the job."""
        return self.distributed.size

    def get_hparams(self) -> dict[str, Any]:
        """The job config's ``hyperparameters`` (from ``tbp run``); ``{}`` when there are none."""
        if self._hparams is None:
            self._hparams = settings.current().hparams.get() or {}  # a bad value: an error naming the variable
        return dict(self._hparams)

    # -- used by the loop ---------------------------------------------------------------------

    @property
    def reducers(self) -> ReducerRegistry:
        return self._reducers


def _check_metric_value(value: Any, where: str) -> None:
    """Raises InvalidArgumentError for a metric value that JSON cannot hold (numbers, str, bool, None, tensors, numpy
    values, and lists and str-keyed dicts of them are fine): it would be stored as its ``repr``."""
    if value is None or isinstance(value, (str, int, float, bool, torch.Tensor)) or type(value).__module__ == "numpy":
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_metric_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgumentError(f"report_metrics(metrics=...): {where} has a key that is not a str: {key!r}")
            _check_metric_value(item, f"{where}[{key!r}]")
        return
    raise InvalidArgumentError(
        f"report_metrics(metrics=...): {where} is a {type(value).__name__}, which JSON cannot hold; report numbers, "
        f"strings, booleans, tensors or numpy values (or lists and dicts of them), e.g. float(x) or str(x)"
    )
