"""What ``tbp run`` starts for a job config: the launcher's command line and the job's environment."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch_batch_process.launch.config import ConfigError, JobConfig
from torch_batch_process.launch.paths import absolute_path

__all__ = ["hparams_json", "job_environment", "launcher_argv"]


def hparams_json(hparams: Mapping[str, Any]) -> str:
    """The JSON the workers read back through ``context.get_hparams()``."""
    return json.dumps(dict(hparams), sort_keys=True)


def launcher_argv(config: JobConfig, nproc_per_node: int | None = None, extra: list[str] | None = None) -> list[str]:
    """The command line of ``python -m torch_batch_process.launch.torch_distributed`` that runs ``config``.

    ``nproc_per_node`` (from ``tbp run --nproc-per-node``) overrides the config's resources; ``extra``
    are more launcher options (rendezvous...).

    Raises:
        ConfigError: the entrypoint's own launcher options set what the config's keys also set.
    """
    from torch_batch_process.launch.torch_distributed import LaunchError, given_options

    nproc = nproc_per_node if nproc_per_node is not None else config.nproc_per_node()
    if config.launcher_args:
        try:
            given = given_options(config.launcher_args, ["nproc_per_node", "nnodes", "max_restarts"])
        except LaunchError as exc:
            raise ConfigError(f"{config.path}: entrypoint: bad launcher options: {exc}") from exc
        clashes = {
            "nproc_per_node": ("resources.slots_per_trial", config.slots_per_trial is not None),
            "nnodes": ("resources.nodes", config.nodes is not None),
            "max_restarts": ("max_restarts", config.max_restarts != 0),
        }
        for dest, (key, set_in_config) in clashes.items():
            option = "--" + dest.replace("_", "-")
            if dest in given and set_in_config:
                raise ConfigError(
                    f"{config.path}: entrypoint: the launcher option {option} and the key {key} set the same thing; "
                    "keep one"
                )
        if "nproc_per_node" in given and nproc_per_node is not None:
            raise ConfigError(
                f"{config.path}: entrypoint: the launcher option --nproc-per-node is also given to tbp run; keep one"
            )
    options: list[str] = []
    if nproc is not None:
        options += ["--nproc-per-node", str(nproc)]
    if config.nodes is not None:
        options += ["--nnodes", str(config.nodes)]
    if config.max_restarts:
        options += ["--max-restarts", str(config.max_restarts)]
    options += list(extra or [])
    if config.launcher_args:
        return options + list(config.launcher_args)
    return options + ["--", *config.command]


def job_environment(
    config: JobConfig, storage: str | None = None, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], list[str]]:
    """The environment variables ``tbp run`` sets for the job, and notes on where the storage comes from.

    The storage path is ``storage`` (``tbp run --storage``), else an exported ``$TBP_STORAGE_PATH``,
    else the config's ``checkpoint_storage``, else the engine's default (``./tbp_runs/<job name>``).

    Raises:
        ConfigError: ``storage`` is given but empty.
    """
    from torch_batch_process.settings import HPARAMS_ENV, JOB_NAME_ENV, STORAGE_ENV, STORAGE_OPTIONS_ENV, read_settings

    exported = read_settings(environ, check=False).storage_path.value  # the exported $TBP_STORAGE_PATH
    env = dict(config.variables)
    notes: list[str] = []
    env[HPARAMS_ENV] = hparams_json(config.hyperparameters)
    if config.name is not None:
        env[JOB_NAME_ENV] = config.name
    if storage is not None:
        if not storage.strip():
            raise ConfigError(
                "--storage is empty: give a local path or a URL such as s3://bucket/prefix, or leave --storage out "
                "to use the config's checkpoint_storage"
            )
        _check_url(storage, "--storage")
        env[STORAGE_ENV] = absolute_path(storage, Path.cwd())
        if config.storage_path is not None:
            notes.append(f"storage {env[STORAGE_ENV]} (from --storage, instead of checkpoint_storage)")
    elif exported and STORAGE_ENV not in config.variables:
        _check_url(exported, f"the exported ${STORAGE_ENV}")
        instead = ", instead of checkpoint_storage" if config.storage_path is not None else ""
        notes.append(f"storage {exported} (from the exported ${STORAGE_ENV}{instead})")
    elif config.storage_path is not None:
        env[STORAGE_ENV] = config.storage_path
    if config.storage_options is not None:
        env[STORAGE_OPTIONS_ENV] = json.dumps(config.storage_options, sort_keys=True)
    return env, notes


def _check_url(url: str, name: str) -> None:
    """Raises ConfigError for a storage path with a typo or an unknown protocol, before any worker starts (each would
    fail with it, and be restarted ``max_restarts`` times)."""
    from torch_batch_process.storage.urls import StorageUrlError, check_storage_url

    try:
        check_storage_url(url, name)
    except StorageUrlError as exc:
        raise ConfigError(str(exc)) from exc
