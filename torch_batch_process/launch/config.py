"""The YAML job config run by ``tbp run``, in the shape of Determined's experiment config.

Example::

    name: digits-inference
    entrypoint: python3 batch_processing.py --limit 1000
    resources:
      slots_per_trial: 4        # workers in total
      nodes: 2                  # optional: 2 nodes of 2 workers
    checkpoint_storage: s3://bucket/runs/digits
    max_restarts: 3
    hyperparameters:
      model: resnet18
      threshold: 0.5
    environment:
      variables:
        HF_HOME: /scratch/hf

Every key is checked when the file is loaded; an error names the file, the line and the key, and
unknown keys are errors (a typo never passes silently). Relative local paths and the entrypoint are
taken relative to the directory of the config file, where the job runs (like Determined's model
definition directory).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from torch_batch_process.environment import is_valid_job_name
from torch_batch_process.integers import is_int
from torch_batch_process.launch.config_lines import ConfigError, KeyLines, type_name
from torch_batch_process.launch.determined_storage import determined_storage
from torch_batch_process.launch.paths import absolute_path

__all__ = ["ConfigError", "JobConfig", "load_config", "parse_config"]

TOP_LEVEL_KEYS = (
    "name",
    "description",
    "entrypoint",
    "resources",
    "checkpoint_storage",
    "max_restarts",
    "hyperparameters",
    "environment",
)
RESOURCES_KEYS = ("slots_per_trial", "nodes")
STORAGE_KEYS = ("type", "path", "storage_options")
ENVIRONMENT_KEYS = ("variables",)
LOCAL_STORAGE_TYPES = ("local", "shared_fs", "directory")
LAUNCHER_MODULES = ("torch_batch_process.launch.torch_distributed", "determined.launch.torch_distributed")

_DETERMINED_ONLY = {
    "searcher", "workspace", "project", "labels", "bind_mounts", "min_validation_period", "min_checkpoint_period",
    "records_per_epoch", "scheduling_unit", "data", "perform_initial_validation", "optimizations", "profiling",
    "reproducibility", "checkpoint_policy", "debug", "pbs", "slurm", "tensorboard_storage", "max_slots",
    "priority", "resource_pool", "shm_size", "devices", "weight", "image", "pod_spec", "registry_auth",
    "force_pull_image", "add_capabilities", "drop_capabilities", "environment_variables", "proxy_ports",
}  # fmt: skip
_SEARCH_TYPES = {"int", "double", "log", "categorical"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # matched whole: "$" also takes a trailing newline
_PYTHON = re.compile(r"^(.*/)?python(\d+(\.\d+)?)?$")


@dataclass(frozen=True)
class JobConfig:
    """A validated job config.

    Attributes:
        path: the config file.
        name: the job name (``None``: the engine's default, the script's stem).
        command: what every worker runs.
        launcher_args: options for the launcher given in the entrypoint (when it starts with it).
        slots_per_trial: workers in total (``None``: the launcher's default, one per GPU, else 1).
        nodes: number of nodes (``None``: one).
        storage_path: storage URL or absolute local path (``None``: the engine's default).
        storage_options: fsspec options of the storage.
        max_restarts: how many times a failed worker group is restarted.
        hyperparameters: what ``context.get_hparams()`` returns in the workers.
        variables: environment variables set for the job.
    """

    path: Path
    command: list[str]
    name: str | None = None
    description: str | None = None
    launcher_args: list[str] = field(default_factory=list)
    slots_per_trial: int | None = None
    nodes: int | None = None
    storage_path: str | None = None
    storage_options: dict[str, Any] | None = None
    max_restarts: int = 0
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    variables: dict[str, str] = field(default_factory=dict)

    @property
    def workdir(self) -> Path:
        """The directory the job runs in: the config file's."""
        return self.path.parent

    def nproc_per_node(self) -> int | None:
        """Workers per node from ``slots_per_trial`` and ``nodes``; ``None`` when slots are not set."""
        if self.slots_per_trial is None:
            return None
        return self.slots_per_trial // (self.nodes or 1)


def load_config(path: str | os.PathLike[str]) -> JobConfig:
    """Reads and checks the job config at ``path``.

    Raises:
        ConfigError: the file is missing, not UTF-8 text, not YAML, or a key is missing, unknown or has a bad value.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the job config {str(file)!r}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"cannot read the job config {str(file)!r}: it is not UTF-8 text (byte {exc.start}: {exc.reason}); "
            "save it as UTF-8 YAML"
        ) from exc
    return parse_config(text, file)


def parse_config(text: str, file: str | os.PathLike[str] = "<config>") -> JobConfig:
    """Checks the YAML ``text`` of a job config; ``file`` names it in errors and anchors relative paths."""
    path = Path(file).resolve() if str(file) != "<config>" else Path.cwd() / "<config>"
    lines = KeyLines(str(file))
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else str(file)
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from exc
    if node is None or data is None:
        raise ConfigError(f"{file}: the job config is empty; it needs at least 'entrypoint'")
    lines.index(node)
    if not isinstance(data, dict):
        raise lines.error(
            (), f"the job config must be a mapping of keys (name, entrypoint, ...), got {type_name(data)}"
        )
    _check_keys(data, TOP_LEVEL_KEYS, (), lines)
    if "entrypoint" not in data:
        raise lines.error(
            (), "'entrypoint' is missing: give the command every worker runs, e.g. 'entrypoint: python3 job.py'"
        )

    name = data.get("name")
    if name is not None and not is_valid_job_name(name):
        raise lines.error(
            ("name",),
            f"must be 1-128 letters, digits, '.', '_' or '-' (starting with a letter or digit), got {name!r}",
        )
    description = data.get("description")
    if description is not None and not isinstance(description, str):
        raise lines.error(("description",), f"must be a string, got {type_name(description)}")
    command, launcher_args = _entrypoint(data["entrypoint"], lines)
    slots, nodes = _resources(data.get("resources"), lines)
    storage_path, storage_options = _storage(data.get("checkpoint_storage"), path.parent, lines)
    max_restarts = data.get("max_restarts", 0)
    if not is_int(max_restarts) or max_restarts < 0:
        raise lines.error(("max_restarts",), f"must be an integer >= 0, got {max_restarts!r}")
    hparams = _hyperparameters(data.get("hyperparameters"), lines)
    variables = _environment(data.get("environment"), lines)
    return JobConfig(
        path=path,
        command=command,
        name=name,
        description=description,
        launcher_args=launcher_args,
        slots_per_trial=slots,
        nodes=nodes,
        storage_path=storage_path,
        storage_options=storage_options,
        max_restarts=max_restarts,
        hyperparameters=hparams,
        variables=variables,
    )


def _check_keys(data: dict[Any, Any], allowed: tuple[str, ...], path: tuple[Any, ...], lines: KeyLines) -> None:
    for key in data:
        if key in allowed:
            continue
        if key in _DETERMINED_ONLY:
            why = "is a Determined cluster setting with no meaning here; remove it"
        else:
            why = f"unknown key; the keys allowed here are {', '.join(allowed)}"
        raise lines.error(path + (key,), why)


def _entrypoint(value: Any, lines: KeyLines) -> tuple[list[str], list[str]]:
    """The worker command, and the launcher options when the entrypoint starts with the launcher."""
    if isinstance(value, str):
        try:
            tokens = shlex.split(value)
        except ValueError as exc:
            raise lines.error(("entrypoint",), f"cannot split the command into words: {exc}") from exc
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise lines.error(
                    ("entrypoint", i), f"every word of the entrypoint must be a string, got {type_name(item)}"
                )
        tokens = list(value)
    else:
        raise lines.error(("entrypoint",), f"must be a command string or a list of strings, got {type_name(value)}")
    if not tokens or not tokens[0].strip():
        raise lines.error(("entrypoint",), "is empty: give the command every worker runs, e.g. 'python3 job.py'")
    if os.path.basename(tokens[0]) == "torchrun" or tokens[1:3] == ["-m", "torch.distributed.run"]:
        raise lines.error(
            ("entrypoint",),
            "starts with torchrun: 'tbp run' starts the workers itself; give the command each worker runs "
            "(e.g. 'python3 job.py'), or start it with 'python3 -m torch_batch_process.launch.torch_distributed'",
        )
    if len(tokens) >= 3 and _PYTHON.match(tokens[0]) and tokens[1] == "-m" and tokens[2] in LAUNCHER_MODULES:
        rest = tokens[3:]
        if not rest:
            raise lines.error(("entrypoint",), f"'{tokens[2]}' is given no command to run")
        return [], rest
    return tokens, []


def _resources(value: Any, lines: KeyLines) -> tuple[int | None, int | None]:
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise lines.error(("resources",), f"must be a mapping (slots_per_trial, nodes), got {type_name(value)}")
    _check_keys(value, RESOURCES_KEYS, ("resources",), lines)
    slots = value.get("slots_per_trial")
    nodes = value.get("nodes")
    for key, number in (("slots_per_trial", slots), ("nodes", nodes)):
        if number is not None and (not is_int(number) or number < 1):
            raise lines.error(("resources", key), f"must be an integer >= 1, got {number!r}")
    if nodes is not None and slots is None:
        raise lines.error(("resources", "nodes"), "needs resources.slots_per_trial (the number of workers in total)")
    if slots is not None and nodes is not None and slots % nodes:
        raise lines.error(
            ("resources", "slots_per_trial"),
            f"{slots} workers cannot be split evenly over {nodes} nodes; make slots_per_trial a multiple of nodes",
        )
    return slots, nodes


def _storage(value: Any, base: Path, lines: KeyLines) -> tuple[str | None, dict[str, Any] | None]:
    if value is None:
        return None, None
    key = ("checkpoint_storage",)
    if isinstance(value, str):
        if not value.strip():
            raise lines.error(key, "is empty: give a local path or a URL such as s3://bucket/prefix")
        return absolute_path(_checked_url(value, key, lines), base), None
    if not isinstance(value, dict):
        raise lines.error(
            key, f"must be a path/URL string or a mapping (type, path, storage_options), got {type_name(value)}"
        )
    determined = determined_storage(value, base, lines)  # Determined's own keys (host_path, bucket, ...)
    if determined is not None:
        return determined
    _check_keys(value, STORAGE_KEYS, key, lines)
    path = value.get("path")
    if not isinstance(path, str) or not path.strip():
        raise lines.error(key + ("path",), f"must be a non-empty string (a local path or a URL), got {path!r}")
    _checked_url(path, key + ("path",), lines)
    scheme = path.split("://", 1)[0] if "://" in path else None
    kind = value.get("type", scheme or "local")
    if not isinstance(kind, str):
        raise lines.error(key + ("type",), f"must be a string, got {type_name(kind)}")
    options = value.get("storage_options")
    if options is not None:
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise lines.error(key + ("storage_options",), "must be a mapping of fsspec filesystem options")
        _check_json(options, key + ("storage_options",), lines)
    if kind in LOCAL_STORAGE_TYPES:
        if scheme is not None and scheme not in ("file", "local"):
            raise lines.error(key + ("path",), f"type {kind!r} needs a local path, got the URL {path!r}")
        return absolute_path(path, base), options
    import fsspec

    if kind not in fsspec.available_protocols():
        raise lines.error(
            key + ("type",),
            f"unknown storage type {kind!r}: use 'local' or an fsspec protocol (s3, gs, az, memory, ...)",
        )
    if scheme is not None and scheme != kind:
        raise lines.error(key + ("path",), f"the URL {path!r} does not match type {kind!r}")
    return (path if scheme else f"{kind}://{path.lstrip('/')}"), options


def _checked_url(text: str, key: tuple[Any, ...], lines: KeyLines) -> str:
    """``text`` when it is a local path or a URL of a known protocol, not a URL with a typo (``s3:/bucket``)."""
    from torch_batch_process.storage.urls import StorageUrlError, check_storage_url

    try:
        return check_storage_url(text, "the path")
    except StorageUrlError as exc:
        raise lines.error(key, str(exc)) from exc


def _check_json(value: Any, path: tuple[Any, ...], lines: KeyLines) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise lines.error(path, f"must hold plain values (strings, numbers, booleans, lists, mappings): {exc}") from exc


def _hyperparameters(value: Any, lines: KeyLines) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise lines.error(("hyperparameters",), f"must be a mapping of names to values, got {type_name(value)}")
    result = _unwrap_hparams(value, ("hyperparameters",), lines)
    _check_json(result, ("hyperparameters",), lines)
    return result


def _unwrap_hparams(value: dict[Any, Any], path: tuple[Any, ...], lines: KeyLines) -> dict[str, Any]:
    """Determined's ``{type: const, val: X}`` becomes ``X``; search spaces are refused."""
    result: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise lines.error(path + (key,), f"hyperparameter names must be strings, got {key!r}")
        if isinstance(item, dict) and item.get("type") == "const" and set(item) == {"type", "val"}:
            item = item["val"]
        elif isinstance(item, dict) and item.get("type") in _SEARCH_TYPES and set(item) <= {
            "type", "minval", "maxval", "count", "base", "vals",
        }:  # fmt: skip
            raise lines.error(
                path + (key,),
                f"a hyperparameter search space (type: {item['type']}) needs Determined's searcher; give one value",
            )
        if isinstance(item, dict):
            item = _unwrap_hparams(item, path + (key,), lines)
        result[key] = item
    return result


def _environment(value: Any, lines: KeyLines) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise lines.error(("environment",), f"must be a mapping (variables), got {type_name(value)}")
    _check_keys(value, ENVIRONMENT_KEYS, ("environment",), lines)
    raw = value.get("variables")
    path = ("environment", "variables")
    pairs: list[tuple[tuple[Any, ...], Any, Any]] = []
    if raw is None:
        return {}
    if isinstance(raw, dict):
        pairs = [(path + (k,), k, v) for k, v in raw.items()]
    elif isinstance(raw, list):
        for i, item in enumerate(raw):
            if not isinstance(item, str) or "=" not in item:
                raise lines.error(path + (i,), f"a list of variables holds 'NAME=value' strings, got {item!r}")
            name, _, val = item.partition("=")
            pairs.append((path + (i,), name, val))
    else:
        raise lines.error(path, f"must be a mapping NAME: value (or a list of 'NAME=value'), got {type_name(raw)}")
    variables: dict[str, str] = {}
    for where, name, val in pairs:
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise lines.error(where, f"{name!r} is not a valid environment variable name")
        if isinstance(val, bool):
            val = "true" if val else "false"
        if not isinstance(val, (str, int, float)):
            raise lines.error(where, f"the value of {name} must be a string or a number, got {type_name(val)}")
        variables[name] = str(val)
    return variables
