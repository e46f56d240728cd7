"""Checks of the arguments of :func:`torch_batch_process`, all done before any work or storage access."""

from __future__ import annotations

import inspect
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from torch_batch_process import settings
from torch_batch_process.arguments import DEFAULT_BUCKET_WINDOW, JobArguments, Script
from torch_batch_process.engine.plan.bucket_options import AUTO, resolve_lengths, validate_bucket_options
from torch_batch_process.environment import DEFAULT_ROOT, is_valid_job_name
from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.failure_options import FailureOptions
from torch_batch_process.integers import is_int, is_integer
from torch_batch_process.mesh_shape import MeshShape, generation_on_a_mesh, parse_mesh
from torch_batch_process.outputs.records import check_output_format
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.storage.registry import check_storage_options
from torch_batch_process.storage.urls import check_storage_url
from torch_batch_process.torch_features import require_store_queues

SCHEDULES = ("static", "dynamic")

_FORBIDDEN_LOADER_KEYS = {
    "sampler": "the library builds its own sampler to shard the dataset over ranks; remove 'sampler'",
    "batch_sampler": "the library builds its own batch sampler to shard the dataset; remove 'batch_sampler'",
    "dataset": "pass the dataset as the dataset argument of torch_batch_process, not in dataloader_kwargs",
}
_INT64_MAX = (1 << 63) - 1

_LOADER_PARAMETERS = set(inspect.signature(DataLoader.__init__).parameters) - {"self"}


def _positive_int(name: str, value: Any, allow_none: bool = False) -> Any:
    """Checks a count argument; returns it as a plain ``int`` (a numpy integer, computed with numpy, is one too, as
    Determined accepts it), or ``None`` when allowed."""
    if value is None and allow_none:
        return None
    if not is_integer(value):
        raise InvalidArgumentError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    if value > _INT64_MAX:  # the plan, the progress records and the torch collectives count in int64
        raise InvalidArgumentError(f"{name} must be at most 2**63 - 1, got {value}")
    return int(value)


def validate_table(table: Any, output_format: Any) -> None:
    """Checks a table target (``table=``): its package is installed, its options and catalog work."""
    if table is None:
        return
    from torch_batch_process.outputs.tables.base import TableTarget

    if not isinstance(table, TableTarget):
        raise InvalidArgumentError(
            f"table must be a table target such as torch_batch_process.tables.delta(uri), tables.iceberg(identifier, "
            f"catalog=...) or tables.lance(uri), got {type(table).__name__} {table!r:.100}"
        )
    if output_format != "parquet":
        raise InvalidArgumentError(
            f"output_format={output_format!r} is for record shards in the job's storage; with table=, rows go into "
            f"{table.describe_short()}: remove output_format"
        )
    table.check()


def validate_processor_cls(processor_cls: Any) -> type[TorchBatchProcessor]:
    """Checks that ``processor_cls`` is a concrete :class:`TorchBatchProcessor` subclass."""
    if isinstance(processor_cls, TorchBatchProcessor):
        raise InvalidArgumentError(
            f"batch_processor_cls must be the class, not an instance: pass {type(processor_cls).__name__}, "
            f"not {type(processor_cls).__name__}(...); the library builds one instance per rank"
        )
    if not inspect.isclass(processor_cls) or not issubclass(processor_cls, TorchBatchProcessor):
        raise InvalidArgumentError(
            f"batch_processor_cls must be a subclass of torch_batch_process.TorchBatchProcessor, got {processor_cls!r}"
        )
    abstract = getattr(processor_cls, "__abstractmethods__", frozenset())
    if "process_batch" in abstract:
        raise InvalidArgumentError(
            f"batch_processor_cls {processor_cls.__name__} does not implement process_batch(self, batch, batch_idx)"
        )
    if abstract:
        raise InvalidArgumentError(
            f"batch_processor_cls {processor_cls.__name__} leaves abstract methods unimplemented: {sorted(abstract)}"
        )
    _check_signature(processor_cls, (None,), f"{processor_cls.__name__}.__init__(self, context)", "the library builds "
                     f"one per rank as {processor_cls.__name__}(context)")
    _check_signature(processor_cls.process_batch, (None, None, None), f"{processor_cls.__name__}.process_batch(self, "
                     "batch, batch_idx)", "the library calls it as process_batch(batch, batch_idx)")
    for hook, arguments in (("on_checkpoint_start", ""), ("on_finish", ""), ("state_dict", ""),
                            ("load_state_dict", ", state")):
        function = getattr(processor_cls, hook, None)
        if function is not None and function is not getattr(TorchBatchProcessor, hook):
            _check_signature(function, (None,) * (2 if arguments else 1),
                             f"{processor_cls.__name__}.{hook}(self{arguments})",
                             f"the library calls it as {hook}({arguments.lstrip(', ')})")
    return processor_cls


def _check_signature(function: Any, arguments: tuple[Any, ...], expected: str, why: str) -> None:
    """Raises InvalidArgumentError when ``function`` cannot be called with ``arguments`` (positionally): a hook
    with the wrong parameters would otherwise fail only once the job has opened its storage."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin or an object without a signature: nothing to check
        return
    try:
        signature.bind(*arguments)
    except TypeError as exc:
        raise InvalidArgumentError(
            f"batch_processor_cls: {expected} is required ({why}), but its signature is {signature}: {exc}"
        ) from exc


def validate_dataset(dataset: Any, bucket_by: Any = None) -> int:
    """Checks that ``dataset`` is map-style with a ``__len__`` (returns its length) or a streaming source
    (returns its rows when its metadata tells them, else -1: the plan counts them)."""
    from torch_batch_process.engine.feed.streams import is_source, validate_source

    if is_source(dataset):
        return validate_source(dataset, bucket_by)
    if isinstance(dataset, IterableDataset):
        raise InvalidArgumentError(
            "dataset must be a map-style dataset (with __len__ and __getitem__); an IterableDataset cannot be "
            "sharded by index nor resumed exactly; for a Hugging Face datasets.IterableDataset pass "
            "torch_batch_process.sources.from_hf(dataset), for Parquet/JSONL files sources.parquet(...)/jsonl(...)"
        )
    if isinstance(dataset, (str, bytes, bytearray, os.PathLike)):
        raise InvalidArgumentError(
            f"dataset must be a map-style dataset, got the {type(dataset).__name__} {dataset!r:.100}; to read files "
            "pass torch_batch_process.sources.parquet(path) or sources.jsonl(path) (or load them into a "
            "datasets.Dataset)"
        )
    if isinstance(dataset, Mapping) and not _is_int_keyed(dataset):
        splits = " (a datasets.DatasetDict: pick a split, e.g. dataset['train'])" if _is_dataset_dict(dataset) else ""
        raise InvalidArgumentError(
            f"dataset is a {type(dataset).__name__}{splits} whose keys are not the indices 0..{len(dataset) - 1}: its "
            f"len() counts its keys and dataset[i] would look up the key i. For a dict of columns pass "
            f"datasets.Dataset.from_dict(...) or a list of per-example dicts"
        )
    if not hasattr(dataset, "__len__"):
        raise InvalidArgumentError(
            f"dataset must implement __len__() (a map-style dataset: a torch Dataset, a list, a Hugging Face "
            f"datasets.Dataset...); {type(dataset).__name__} has no __len__"
        )
    if not hasattr(dataset, "__getitem__"):
        raise InvalidArgumentError(f"dataset must implement __getitem__(index); {type(dataset).__name__} does not")
    try:
        length = len(dataset)
    except Exception as exc:  # noqa: BLE001 - report any failure of the user's __len__
        raise InvalidArgumentError(f"dataset: len(dataset) failed: {type(exc).__name__}: {exc}") from exc
    if not is_int(length) or length < 0:
        raise InvalidArgumentError(f"dataset: len(dataset) must be an int >= 0, got {length!r}")
    return int(length)


def _is_int_keyed(mapping: Mapping[Any, Any]) -> bool:
    """Whether the keys of ``mapping`` are exactly the ints ``0..len-1`` (then it indexes like a list)."""
    try:
        return all(is_int(key) and 0 <= key < len(mapping) for key in mapping)
    except Exception:  # noqa: BLE001 - a mapping that cannot be iterated is not a list of examples
        return False


def _is_dataset_dict(value: Any) -> bool:
    return type(value).__name__ in ("DatasetDict", "IterableDatasetDict")


def validate_dataloader_kwargs(dataloader_kwargs: Any, batch_size: Any, dataset: Any) -> tuple[dict[str, Any], int]:
    """Checks ``dataloader_kwargs`` and resolves the batch size; returns (kwargs without batch_size, batch_size)."""
    if dataloader_kwargs is None:
        kwargs: dict[str, Any] = {}
    elif isinstance(dataloader_kwargs, Mapping):
        kwargs = dict(dataloader_kwargs)
    else:
        raise InvalidArgumentError(f"dataloader_kwargs must be a dict or None, got {type(dataloader_kwargs).__name__}")
    for key in kwargs:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"dataloader_kwargs keys must be str, got {key!r}")
    _check_loader_flags(kwargs)
    for key, why in _FORBIDDEN_LOADER_KEYS.items():
        if key in kwargs and not (key != "dataset" and kwargs[key] is None):
            raise InvalidArgumentError(f"dataloader_kwargs[{key!r}] is not allowed: {why}")
        kwargs.pop(key, None)
    if kwargs.get("shuffle"):
        raise InvalidArgumentError(
            "dataloader_kwargs['shuffle']=True is not allowed: batches must be contiguous and in order for exact "
            "sharding and resume; shuffle the dataset itself if needed (shuffle=False is fine)"
        )
    kwargs.pop("shuffle", None)
    if kwargs.get("drop_last"):
        raise InvalidArgumentError(
            "dataloader_kwargs['drop_last']=True is not allowed: every example is processed exactly once (the last "
            "batch may be short); use max_batches to process fewer batches"
        )
    kwargs.pop("drop_last", None)
    if not kwargs.get("in_order", True):
        raise InvalidArgumentError(
            f"dataloader_kwargs['in_order']={kwargs['in_order']!r} is not allowed: the workers' batches must arrive "
            "in order, or a batch would be processed as another one (its batch_idx, context.batch_indices and record "
            "index would name other examples); remove it (in_order=True is fine)"
        )
    if kwargs.get("timeout") and not kwargs.get("num_workers"):
        raise InvalidArgumentError(
            f"dataloader_kwargs['timeout']={kwargs['timeout']!r} needs num_workers > 0 (torch's DataLoader only "
            "times its worker processes); remove it, or bound a stuck batch, loading included, with batch_timeout="
        )
    unknown = sorted(set(kwargs) - _LOADER_PARAMETERS - {"batch_size"})
    if unknown:
        raise InvalidArgumentError(
            f"dataloader_kwargs has unknown key(s) {unknown}: torch.utils.data.DataLoader accepts "
            f"{sorted(_LOADER_PARAMETERS - set(_FORBIDDEN_LOADER_KEYS) - {'shuffle', 'drop_last'})}"
        )
    if "batch_size" in kwargs:
        if batch_size is not None:
            raise InvalidArgumentError(
                "batch_size is given both as an argument and in dataloader_kwargs['batch_size']; give it once"
            )
        batch_size = _positive_int("dataloader_kwargs['batch_size']", kwargs.pop("batch_size"))
    elif batch_size is None:
        batch_size = 1
    else:
        batch_size = _positive_int("batch_size", batch_size)
    _check_loader_value_types(kwargs)
    try:  # Let the DataLoader check the remaining options now, before any work (it starts nothing).
        DataLoader(dataset, batch_sampler=[], **kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"dataloader_kwargs are not accepted by torch.utils.data.DataLoader: {exc}") from exc
    return kwargs, batch_size


_LOADER_FLAGS = ("shuffle", "drop_last", "pin_memory", "persistent_workers", "in_order")
"""DataLoader options that are True or False (``shuffle`` may also be None, the DataLoader's default)."""


def _check_loader_flags(kwargs: Mapping[str, Any]) -> None:
    """Raises InvalidArgumentError for a DataLoader flag that is not a bool: the DataLoader takes any truthy value
    (``pin_memory="no"`` would pin), so a string or a number there is a mistake, not a choice."""
    for key in _LOADER_FLAGS:
        if key not in kwargs:
            continue
        value = kwargs[key]
        if isinstance(value, bool) or (value is None and key == "shuffle"):
            continue
        raise InvalidArgumentError(
            f"dataloader_kwargs[{key!r}] must be True or False, got {type(value).__name__} {value!r:.80}"
        )


def _check_loader_value_types(kwargs: Mapping[str, Any]) -> None:
    """Raises InvalidArgumentError for DataLoader options of a wrong type or value that the DataLoader itself only
    trips over once it runs (in a batch, or when it starts its worker processes, after the job has opened its
    storage)."""
    import torch

    num_workers = kwargs.get("num_workers", 0)
    if not is_int(num_workers) or num_workers < 0:
        raise InvalidArgumentError(
            f"dataloader_kwargs['num_workers'] must be an int >= 0 (0: load in the main process), got "
            f"{type(num_workers).__name__} {num_workers!r:.80}"
        )
    prefetch = kwargs.get("prefetch_factor")
    if prefetch is not None and (not is_int(prefetch) or prefetch < 1):
        raise InvalidArgumentError(
            f"dataloader_kwargs['prefetch_factor'] must be an int >= 1 (batches loaded in advance by each worker) or "
            f"None, got {type(prefetch).__name__} {prefetch!r:.80}"
        )
    timeout = kwargs.get("timeout", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise InvalidArgumentError(
            f"dataloader_kwargs['timeout'] must be a number of seconds >= 0 (0: no limit), got "
            f"{type(timeout).__name__} {timeout!r:.80}"
        )

    for key in ("collate_fn", "worker_init_fn"):
        value = kwargs.get(key)
        if value is not None and not callable(value):
            raise InvalidArgumentError(
                f"dataloader_kwargs[{key!r}] must be a function (or None), got {type(value).__name__} {value!r:.80}; "
                f"pass the function itself, e.g. {key}=my_function"
            )
    generator = kwargs.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InvalidArgumentError(
            f"dataloader_kwargs['generator'] must be a torch.Generator (or None), got {type(generator).__name__}; "
            "e.g. torch.Generator().manual_seed(0)"
        )
    device = kwargs.get("pin_memory_device")
    if device is not None and not isinstance(device, str):
        raise InvalidArgumentError(
            f"dataloader_kwargs['pin_memory_device'] must be a device name str such as 'cuda', got "
            f"{type(device).__name__} {device!r:.80}"
        )


def script_stem() -> str | None:
    """The stem of the running script, or ``None`` in an interactive session.

    Interactive means no script names the job: ``python -c``, ``python -`` (stdin), the REPL, and Jupyter
    or IPython (whose ``sys.argv[0]`` is the kernel's launcher, shared by every notebook).
    """
    script = _script_argument()
    if script is None:
        return None
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(script).stem).lstrip("._-")
    return stem or None


def _script_argument() -> str | None:
    """``sys.argv[0]`` when a script runs (``None`` in an interactive session, see :func:`script_stem`)."""
    main = sys.modules.get("__main__")
    script = sys.argv[0] if sys.argv else ""
    if main is None or not getattr(main, "__file__", None) or script in ("", "-c", "-m", "-"):
        return None
    if "ipykernel" in Path(script).name or "IPython" in sys.modules and "ipykernel" in sys.modules:
        return None
    return script


def launching_script() -> Script | None:
    """The script that runs this call (the resolved ``__main__`` file and working directory), recorded in a new
    job and checked on a resume (:func:`~torch_batch_process.jobstore.formats.check_script`); ``None`` in an
    interactive session."""
    if _script_argument() is None:
        return None
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if not main_file:
        return None
    try:
        return Script(os.path.realpath(main_file), os.path.realpath(os.getcwd()))
    except OSError:  # the working directory was removed
        return None


def default_job_name(storage_path: Any = None) -> str:
    """The job name: ``$TBP_JOB_NAME``, else the stem of the running script, else the last part of the
    storage path; ``job`` when none of these exists (the storage path is then required, see
    :func:`resolve_storage_path`)."""
    name = settings.current().job_name.get()
    if name:
        return name
    stem = script_stem()
    if stem:
        return stem
    given = storage_path if storage_path is not None else settings.current().storage_path.get()
    if given is not None:
        tail = re.sub(r"[^A-Za-z0-9._-]", "_", os.fspath(given).rstrip("/").rsplit("/", 1)[-1]).lstrip("._-")
        if tail:
            return tail[:128]
    return "job"


def resolve_storage_path(storage_path: Any, job_name: str, *, job_name_given: bool = True) -> str:
    """``storage_path``, else ``$TBP_STORAGE_PATH``, else ``./tbp_runs/<job name>``.

    Without a script name (an interactive session) and without an explicit job name, there is no default:
    every notebook and ``python -c`` would share one folder and a job would resume (or return the result
    of) another one. The storage path (or a job name) is then required.
    """
    from_env = settings.current().storage_path.get() if storage_path is None else None
    if storage_path is None and not from_env and not job_name_given:
        raise InvalidArgumentError(
            "storage_path is required in an interactive session (python -c, the REPL, Jupyter): there is no script "
            "name to tell jobs apart, so the default ./tbp_runs/<script name> would be shared by every job. Pass "
            "storage_path='...' (or job_name='...', which uses ./tbp_runs/<job_name>), or set TBP_STORAGE_PATH."
        )
    name = "storage_path"
    if storage_path is None:
        storage_path = from_env or os.path.join(DEFAULT_ROOT, job_name)
        if from_env:
            name = f"environment variable {settings.STORAGE_ENV}"
    return check_storage_url(storage_path, name)


def resolve_storage_options(storage_options: Any) -> dict[str, Any] | None:
    """``storage_options``, else the JSON in ``$TBP_STORAGE_OPTIONS`` (set by ``tbp run``), else None."""
    if storage_options is None:
        storage_options = settings.current().storage_options.get()
        if storage_options is None:
            return None
    return check_storage_options(storage_options)


def validate_arguments(
    batch_processor_cls: Any,
    dataset: Any,
    batch_size: Any,
    max_batches: Any,
    checkpoint_interval: Any,
    dataloader_kwargs: Any,
    storage_path: Any,
    storage_options: Any,
    job_name: Any,
    resume: Any,
    inference_mode: Any,
    *,
    schedule: Any = "static",
    bucket_by: Any = None,
    bucket_window: Any = DEFAULT_BUCKET_WINDOW,
    max_tokens: Any = None,
    device_prefetch: Any = None,
    autocast: Any = None,
    output_format: Any = "parquet",
    failures: FailureOptions = FailureOptions(),
    table: Any = None,
    mesh: Any = None,
) -> JobArguments:
    """Checks every argument; raises :class:`InvalidArgumentError` naming the first bad one."""
    processor_cls = validate_processor_cls(batch_processor_cls)
    checkpoint_interval = _positive_int("checkpoint_interval", checkpoint_interval)
    max_batches = _positive_int("max_batches", max_batches, allow_none=True)
    if batch_size is not None:
        batch_size = _positive_int("batch_size", batch_size)
    dataset_length = validate_dataset(dataset, bucket_by)
    kwargs, resolved_batch_size = validate_dataloader_kwargs(dataloader_kwargs, batch_size, dataset)
    validate_bucket_options(bucket_by, bucket_window, max_tokens, resolved_batch_size)
    if max_tokens == AUTO and not failures.split_on_oom:
        raise InvalidArgumentError(
            "max_tokens='auto' learns the token budget from out-of-memory errors, which on_oom='raise' makes fail "
            "the job; pass on_oom='split' (the default) or an int max_tokens"
        )
    job_name_given = job_name is not None or bool(settings.current().job_name.get()) or script_stem() is not None
    if job_name is None:
        job_name = default_job_name(storage_path)
    if not isinstance(job_name, str) or not is_valid_job_name(job_name):
        raise InvalidArgumentError(
            f"job_name must be 1-128 characters of letters, digits, '.', '_' or '-' (starting with a letter or "
            f"digit), got {job_name!r}"
        )
    resolved_storage_path = resolve_storage_path(storage_path, job_name, job_name_given=job_name_given)
    resolved_storage_options = resolve_storage_options(storage_options)
    for name, value in (("resume", resume), ("inference_mode", inference_mode)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")
    if failures.retry_failed and not resume:
        raise InvalidArgumentError(
            "retry_failed=True retries the failures of the job stored at storage_path, and resume=False would erase "
            "it: pass retry_failed=True alone to retry them, or resume=False alone to start the job afresh"
        )
    if failures.retry_failed and max_batches is not None:  # a capped retry would drop the failures it left
        raise InvalidArgumentError(
            f"max_batches={max_batches!r} cannot cap a retry_failed=True run: the failures a retry records replace "
            "the ones it retried, so the failures a capped retry left unprocessed would be forgotten; pass "
            "retry_failed=True without max_batches"
        )
    if schedule not in SCHEDULES:
        raise InvalidArgumentError(
            f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}: 'static' deals batches round-robin in "
            "lockstep (Determined's behaviour), 'dynamic' lets each rank take the next batch when it is free"
        )
    if schedule == "dynamic":
        require_store_queues("schedule='dynamic'")
    mesh_shape = validate_mesh(mesh, failures, processor_cls)
    if failures.batch_timeout is not None:
        require_store_queues("batch_timeout")
    check_output_format(output_format)
    validate_table(table, output_format)
    lengths, started = None, time.perf_counter()
    if bucket_by is not None:
        lengths = resolve_lengths(bucket_by, dataset_length)
    return JobArguments(
        processor_cls=processor_cls,
        dataset=dataset,
        dataset_length=dataset_length,
        batch_size=resolved_batch_size,
        max_batches=max_batches,
        checkpoint_interval=checkpoint_interval,
        dataloader_kwargs=kwargs,
        storage_path=resolved_storage_path,
        storage_options=resolved_storage_options,
        job_name=job_name,
        resume=resume,
        inference_mode=inference_mode,
        schedule=schedule,
        lengths=lengths,
        bucket_window=bucket_window,
        max_tokens=max_tokens,
        lengths_s=time.perf_counter() - started,
        device_prefetch=device_prefetch,
        autocast=autocast,
        output_format=output_format,
        failures=failures,
        table=table,
        script=launching_script(),
        mesh=mesh_shape,
    )


def validate_mesh(mesh: Any, failures: FailureOptions, processor_cls: type[TorchBatchProcessor]) -> MeshShape | None:
    """Checks ``mesh=`` (:func:`~torch_batch_process.mesh_shape.parse_mesh`) and what a mesh job cannot do yet:
    ``on_error="skip"`` (one member bisecting a batch alone leaves its peers waiting in their collectives), and a
    :func:`~torch_batch_process.generation.Generate` processor on replicas of several ranks (each member would run an
    engine of its own, see :meth:`~torch_batch_process.context.TorchBatchProcessorContext.use_generation_engine`).
    The world size is checked once the ranks joined
    (:func:`~torch_batch_process.engine.mesh.groups.check_job_mesh`)."""
    shape = parse_mesh(mesh)
    if shape is None:
        return None
    if failures.skip:
        raise InvalidArgumentError(
            f"on_error='skip' cannot be used with mesh={mesh!r} yet: a member that retries a batch in parts alone "
            "leaves the other members of its replica waiting in their collectives; pass on_error='raise' (the "
            "default) with a mesh"
        )
    if shape.members > 1 and getattr(processor_cls, "generation_fingerprint", None) is not None:
        raise InvalidArgumentError(f"mesh={shape.describe()}: {generation_on_a_mesh(shape.members)}")
    return shape
