"""The functional form: ``predict(fn, dataset, batch_size)`` returns ``fn``'s per-example outputs in dataset order.

Like redco's ``Predictor.predict`` or Lightning's ``return_predictions``, on top of
:func:`~torch_batch_process.torch_batch_process` and record outputs: a processor calls ``fn(batch)`` on each
batch and ``context.write()``\\ s the result; when the job is done every rank reads the outputs back
(:func:`~torch_batch_process.read_outputs`) and returns them. With ``storage_path`` the job is resumable like
any other (a re-run after a crash or a preemption redoes only uncommitted batches; a finished one only reads);
without it the outputs go to a temporary folder that is removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torch_batch_process.errors import InvalidArgumentError, PreemptedError
from torch_batch_process.outputs.columns import INDEX_COLUMN, column_to_numpy
from torch_batch_process.processor import TorchBatchProcessor

__all__ = ["predict"]

_OUTPUT = "output"
"""The column of a tensor returned by ``fn`` (a dict gives one column per key)."""

def predict(
    fn: Callable[[Any], Any],
    dataset: Any,
    batch_size: int,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    storage_path: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Any:
    """Runs ``fn`` over ``dataset`` on every rank of the job and returns its per-example outputs in dataset order.

    Args:
        fn: called with each batch (on the rank's device, as :meth:`TorchBatchProcessorContext.to_device` puts
            it) under ``torch.inference_mode()``; returns a tensor whose first dimension is the batch's size, or
            a dict of such tensors (or of per-example lists).
        dataset: a map-style dataset (see :func:`~torch_batch_process.torch_batch_process`).
        batch_size: examples per batch.
        collate_fn: the DataLoader's ``collate_fn`` (default: torch's).
        storage_path: where the job and its outputs are stored (resumable); default: a temporary folder that rank 0
            makes and shares with the other ranks, removed when ``predict`` returns (one machine only: give a
            shared ``storage_path`` for several machines).
        **options: other keyword options of :func:`~torch_batch_process.torch_batch_process`
            (``checkpoint_interval``, ``dataloader_kwargs``, ``schedule``, ``bucket_by``, ``output_format``...);
            not ``on_error="skip"`` nor ``retry_failed`` (a skipped example has no output to return in its place),
            nor ``table=`` or ``key=`` (their outputs are not this call's, one per example).

    Returns:
        On every rank: for a tensor-valued ``fn`` a tensor of shape ``(len(dataset), *per_example_shape)``; for a
        dict a dict of such tensors (columns that are not numeric with a fixed shape come back as lists). An empty
        dataset gives an empty dict (``fn`` never ran, so the type of its outputs is unknown).

    Raises:
        InvalidArgumentError: ``fn`` returned something that is not one value per example (a scalar, ``None``, a
            tensor whose first dimension is not the batch's size...), naming what it returned.
    """
    from torch_batch_process.batch_process import torch_batch_process
    from torch_batch_process.outputs.readback import read_outputs

    if not callable(fn):
        raise InvalidArgumentError(f"predict(fn=...): a callable is required, got {type(fn).__name__}")
    if "batch_processor_cls" in options:
        raise InvalidArgumentError(
            "predict() builds its own processor; call torch_batch_process() for a processor class"
        )
    if options.get("on_error") == "skip" or options.get("retry_failed"):
        what = "on_error='skip'" if options.get("on_error") == "skip" else "retry_failed=True"
        raise InvalidArgumentError(
            f"predict() does not take {what}: it returns one output per example in dataset order, so a skipped "
            "example would shift every later output. Call torch_batch_process() with a processor that calls "
            "context.write(), then read_outputs(): its 'index' column says which examples have outputs"
        )
    if options.get("table") is not None:
        raise InvalidArgumentError(
            "predict() does not take table=: it returns the outputs, read back from the job's own record shards. "
            "Call torch_batch_process(..., table=...) with a processor that calls context.write(), then "
            "read_outputs(table)"
        )
    if options.get("key") is not None:  # the other keyed options are refused without key= by the call
        raise InvalidArgumentError(
            "predict() does not take key=: it returns fn's outputs, one per example of this dataset in its order, "
            "while a keyed job's outputs are its rows of every run (each key once, with its key columns). Call "
            "torch_batch_process(..., key=...) with a processor that calls context.write(), then read_outputs()"
        )
    given = options.pop("dataloader_kwargs", None)
    if given is not None and not isinstance(given, Mapping):
        raise InvalidArgumentError(f"dataloader_kwargs must be a dict or None, got {type(given).__name__}")
    loader = dict(given or {})
    if collate_fn is not None:
        if loader.get("collate_fn") is not None:
            raise InvalidArgumentError(
                "collate_fn is given both as predict(collate_fn=...) and in dataloader_kwargs['collate_fn']; give it once"
            )
        loader["collate_fn"] = collate_fn
    temporary = storage_path is None
    if temporary:
        storage_path = _temporary_path()
        options.setdefault("resume", False)
        options.setdefault("progress", False)
    try:
        result = torch_batch_process(
            _processor_for(fn),
            dataset,
            batch_size,
            dataloader_kwargs=loader or None,
            storage_path=storage_path,
            **options,
        )
        if result.preempted:  # the same on every rank: every rank raises, none waits at the barrier
            resume = (
                "its temporary storage is removed: give storage_path= to make it resumable" if temporary
                else "run the same command again to resume"
            )
            raise PreemptedError(
                f"predict() was preempted with {result.batches_committed} of {result.num_batches} batches committed, "
                f"so it has no output for every example to return; {resume}"
            )
        table = read_outputs(result.storage_path, storage_options=options.get("storage_options"))
        _barrier()  # every rank has read: the temporary folder may go
    finally:
        if temporary and _rank() == 0:
            shutil.rmtree(str(storage_path), ignore_errors=True)
    return _outputs(table)


def _processor_for(fn: Callable[[Any], Any]) -> type[TorchBatchProcessor]:
    """A processor class calling ``fn``; named after it, so that the job's fingerprint tells functions apart."""

    class _Predictor(TorchBatchProcessor):
        def __init__(self, context: Any) -> None:
            self.context = context

        def process_batch(self, batch: Any, batch_idx: int) -> None:
            out = fn(self.context.to_device(batch))
            try:
                self.context.write(dict(out) if isinstance(out, Mapping) else {_OUTPUT: out})
            except InvalidArgumentError as exc:  # say it of fn, which the user wrote, not of context.write()
                raise InvalidArgumentError(_fn_output_error(out, exc)) from exc

    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    _Predictor.__qualname__ = f"predict[{getattr(fn, '__module__', None) or '?'}.{name}]"
    return _Predictor


def _fn_output_error(out: Any, exc: InvalidArgumentError) -> str:
    """The message of an output of ``fn`` that cannot be stored, naming ``fn`` and what it must return."""
    what = str(exc).removeprefix("context.write(): ")
    if not isinstance(out, Mapping):
        what = what.replace(f"column {_OUTPUT!r}", "its output", 1)
    return (
        f"predict(fn=...): fn(batch) must return a tensor whose first dimension is the batch's size, or a dict of "
        f"such tensors (or of per-example lists); {what}"
    )


def _outputs(table: Any) -> Any:
    columns = {}
    for name in table.column_names:
        if name == INDEX_COLUMN:
            continue
        try:
            array = column_to_numpy(table.column(name))
            columns[name] = torch.from_numpy(array if array.flags.writeable else array.copy())
        except ValueError:
            columns[name] = table.column(name).to_pylist()
    if list(columns) == [_OUTPUT]:
        return columns[_OUTPUT]
    return columns


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _barrier() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _temporary_path() -> str:
    """The temporary folder of a job without ``storage_path``: rank 0 makes it and tells the other ranks over the
    library's process group (joined here; the job's call reuses it), so every rank of one machine uses the same one,
    however it was started (plain processes, torchrun, the launcher and ``tbp run``, whose workers have parents of
    their own). Several machines need a folder they all reach."""
    from torch_batch_process.engine.distributed import DistributedEnv

    with DistributedEnv() as env:
        if env.info.cross_size > 1:
            raise InvalidArgumentError(
                f"predict() without storage_path keeps its outputs in a temporary folder of one machine, but this job "
                f"runs on {env.info.cross_size} machines: give storage_path= a folder that every machine mounts (NFS, "
                "Lustre...) or an object store URL (s3://..., gs://...)"
            )
        path = tempfile.mkdtemp(prefix="tbp-predict-") if env.info.rank == 0 else None
        return str(env.collectives.broadcast(path))
