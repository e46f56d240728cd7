"""The YAML job config and ``tbp``: what a config means, and one clear error per kind of mistake."""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap

import pytest

from torch_batch_process.launch.cli import build_parser, main
from torch_batch_process.launch.config import ConfigError, load_config, parse_config
from torch_batch_process.launch.job_launch import job_environment, launcher_argv


def _write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


FULL = """
name: digits-inference
description: a test
entrypoint: python3 batch.py --limit 10
resources:
  slots_per_trial: 4
  nodes: 2
checkpoint_storage:
  type: s3
  path: bucket/runs/digits
  storage_options: {endpoint_url: "http://127.0.0.1:5000"}
max_restarts: 3
hyperparameters:
  model: resnet18
  lr: {type: const, val: 0.1}
  nested: {layers: [1, 2], act: {type: const, val: relu}}
environment:
  variables:
    HF_HOME: /scratch/hf
    SEED: 7
"""


def test_a_full_config_maps_to_the_launcher_and_the_environment(tmp_path):
    config = load_config(_write(tmp_path, FULL))
    assert config.name == "digits-inference" and config.command == ["python3", "batch.py", "--limit", "10"]
    assert (config.slots_per_trial, config.nodes, config.nproc_per_node(), config.max_restarts) == (4, 2, 2, 3)
    assert config.storage_path == "s3://bucket/runs/digits"
    assert config.hyperparameters == {"model": "resnet18", "lr": 0.1, "nested": {"layers": [1, 2], "act": "relu"}}
    assert config.variables == {"HF_HOME": "/scratch/hf", "SEED": "7"}
    assert config.workdir == tmp_path.resolve()
    argv = launcher_argv(config, extra=["--rdzv-endpoint", "head:29400"])
    assert argv == [
        "--nproc-per-node", "2", "--nnodes", "2", "--max-restarts", "3", "--rdzv-endpoint", "head:29400",
        "--", "python3", "batch.py", "--limit", "10",
    ]  # fmt: skip
    env, notes = job_environment(config, environ={})
    assert json.loads(env["TBP_HPARAMS"]) == config.hyperparameters
    assert env["TBP_STORAGE_PATH"] == "s3://bucket/runs/digits" and env["TBP_JOB_NAME"] == "digits-inference"
    assert json.loads(env["TBP_STORAGE_OPTIONS"]) == {"endpoint_url": "http://127.0.0.1:5000"}
    assert env["HF_HOME"] == "/scratch/hf" and notes == []


def test_storage_precedence_and_relative_paths(tmp_path, monkeypatch):
    config = load_config(_write(tmp_path, "entrypoint: [python3, job.py]\ncheckpoint_storage: runs/a\n"))
    assert config.storage_path == str(tmp_path.resolve() / "runs" / "a")  # relative to the config's directory
    env, _ = job_environment(config, environ={"TBP_STORAGE_PATH": "/exported"})
    assert "TBP_STORAGE_PATH" not in env  # an exported $TBP_STORAGE_PATH is kept (it wins over the config)
    monkeypatch.chdir(tmp_path)
    env, notes = job_environment(config, storage="elsewhere", environ={})
    assert env["TBP_STORAGE_PATH"] == str(tmp_path.resolve() / "elsewhere") and "--storage" in notes[0]
    config = load_config(_write(tmp_path, "entrypoint: job.py\ncheckpoint_storage: {path: 'gs://b/p'}\n"))
    assert config.storage_path == "gs://b/p"


def test_an_entrypoint_that_starts_with_the_launcher_or_determined_launcher(tmp_path):
    for module in ("torch_batch_process.launch.torch_distributed", "determined.launch.torch_distributed"):
        config = load_config(_write(tmp_path, f"entrypoint: python3 -m {module} --max-restarts 1 python3 batch.py\n"))
        assert config.command == [] and config.launcher_args == ["--max-restarts", "1", "python3", "batch.py"]
        assert launcher_argv(config, nproc_per_node=2) == [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "python3",
            "batch.py",
        ]
    config = load_config(
        _write(
            tmp_path,
            "entrypoint: python3 -m torch_batch_process.launch.torch_distributed --nproc-per-node 2 job.py\n"
            "resources: {slots_per_trial: 2}\n",
        )
    )
    with pytest.raises(ConfigError, match="--nproc-per-node and the key resources.slots_per_trial"):
        launcher_argv(config)


def test_environment_variables_as_a_list_and_no_resources(tmp_path):
    config = load_config(_write(tmp_path, "entrypoint: job.py\nenvironment: {variables: ['A=1', 'B=x=y']}\n"))
    assert config.variables == {"A": "1", "B": "x=y"}
    assert config.nproc_per_node() is None and launcher_argv(config) == ["--", "job.py"]


# One test per kind of mistake: the message names the file, the line and the key.


def test_missing_entrypoint(tmp_path):
    path = _write(tmp_path, "name: job\nresources:\n  slots_per_trial: 2\n")
    with pytest.raises(ConfigError, match=rf"^{path}:1: 'entrypoint' is missing"):
        load_config(path)


def test_unknown_key(tmp_path):
    path = _write(tmp_path, "entrypoint: job.py\nresources:\n  slots_per_trail: 2\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: resources.slots_per_trail: unknown key; .*slots_per_trial"):
        load_config(path)
    path = _write(tmp_path, "entrypoint: job.py\nsearcher: {name: single}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: searcher: is a Determined cluster setting"):
        load_config(path)


def test_wrong_type(tmp_path):
    path = _write(tmp_path, "entrypoint: job.py\nmax_restarts: 2\nhyperparameters: [1, 2]\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: hyperparameters: must be a mapping .*got a list"):
        load_config(path)
    path = _write(tmp_path, "entrypoint: [python3, 3]\n")
    with pytest.raises(ConfigError, match=rf"^{path}:1: entrypoint\[1\]: .*must be a string, got a int"):
        load_config(path)


@pytest.mark.parametrize("slots", ["0", "-2", "true", "2.5"])
def test_slots_per_trial_must_be_positive(tmp_path, slots):
    path = _write(tmp_path, f"entrypoint: job.py\nresources:\n  slots_per_trial: {slots}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: resources.slots_per_trial: must be an integer >= 1"):
        load_config(path)


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "the job config is empty"),
        ("entrypoint: [unclosed\n", "not valid YAML"),
        ("entrypoint: a.py\nentrypoint: b.py\n", "2: entrypoint: the key is given twice"),
        ("entrypoint: torchrun --nproc-per-node 2 a.py\n", "starts with torchrun"),
        ("entrypoint: a.py\nresources: {slots_per_trial: 3, nodes: 2}\n", "cannot be split evenly over 2 nodes"),
        ("entrypoint: a.py\ncheckpoint_storage: {type: nosuchfs, path: x}\n", "unknown storage type 'nosuchfs'"),
        ("entrypoint: a.py\nname: 'bad name'\n", "2: name: must be 1-128 letters"),
        ("entrypoint: a.py\nhyperparameters: {lr: {type: double, minval: 0, maxval: 1}}\n", "search space"),
        ("entrypoint: a.py\nenvironment: {variables: {1BAD: x}}\n", "not a valid environment variable name"),
        ("entrypoint: a.py\nmax_restarts: -1\n", "2: max_restarts: must be an integer >= 0"),
        # A storage URL with a typo or an unknown protocol fails at the config, not in every worker (restarted
        # max_restarts times) nor as a local folder named 's3:'.
        ("entrypoint: a.py\ncheckpoint_storage: s3:/bucket/x\n", "2: checkpoint_storage: the path 's3:/bucket/x' looks"),
        ("entrypoint: a.py\ncheckpoint_storage: bogus://x\n", "2: checkpoint_storage: the path 'bogus://x': unknown"),
        ("entrypoint: a.py\ncheckpoint_storage: {path: 's3:bucket'}\n", "2: checkpoint_storage.path: the path 's3:bucket'"),
    ],
)
def test_other_mistakes(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(text, "job.yaml")


def test_tbp_help_documents_every_subcommand(capsys):
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    help_text = parser.format_help()
    for name in subcommands:
        assert name in help_text
        assert subcommands[name].format_help().strip()
    assert "run" in subcommands
    assert main([]) == 2 and "COMMAND" in capsys.readouterr().out


def test_tbp_run_dry_run_and_bad_config_exit_codes(tmp_path, capsys):
    path = _write(tmp_path, FULL)
    assert main(["run", str(path), "--dry-run", "--rdzv-endpoint", "head:29400"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"cd {shlex.quote(str(tmp_path.resolve()))}"
    assert "export TBP_STORAGE_PATH=s3://bucket/runs/digits" in out
    assert out[-1].startswith(shlex.join([sys.executable, "-m", "torch_batch_process.launch.torch_distributed"]))
    assert out[-1].endswith("--rdzv-endpoint head:29400 -- python3 batch.py --limit 10")
    bad = _write(tmp_path, "entrypoint: job.py\nresources: {slots_per_trial: 0}\n")
    assert main(["run", str(bad)]) == 2
    assert "resources.slots_per_trial: must be an integer >= 1" in capsys.readouterr().err


def test_tbp_run_with_an_empty_storage_option_is_refused(tmp_path, capsys):
    path = _write(tmp_path, "entrypoint: python3 job.py\n")
    for storage in ("", "  "):
        assert main(["run", str(path), "--storage", storage, "--dry-run"]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # nothing planned: no job in the config's folder
        assert captured.err.startswith("[tbp] error: --storage is empty") and captured.err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def test_tbp_run_with_a_storage_url_typo_is_refused(tmp_path, capsys):
    path = _write(tmp_path, "entrypoint: python3 job.py\n")
    for storage, message in (("s3:/bucket/x", "Did you mean 's3://bucket/x'"), ("s33://b", "unknown protocol 's33'")):
        assert main(["run", str(path), "--storage", storage, "--dry-run"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"[tbp] error: --storage {storage!r}")
        assert message in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
    with pytest.raises(ConfigError, match=r"the exported \$TBP_STORAGE_PATH 's3:/b' looks like a URL with a typo"):
        job_environment(load_config(path), environ={"TBP_STORAGE_PATH": "s3:/b"})


def test_tbp_run_on_a_config_that_is_not_utf8_is_one_clear_error(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_bytes(b"entrypoint: python3 job.py\nname: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(path)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"[tbp] error: cannot read the job config {str(path)!r}: it is not UTF-8")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("storage", "path", "options"),
    [
        ("{type: shared_fs, host_path: /mnt/data, storage_path: ckpts, propagation: rprivate}", "/mnt/data/ckpts", None),
        ("{type: shared_fs, host_path: /mnt/data, storage_path: /mnt/data/x, save_trial_best: 1}", "/mnt/data/x", None),
        ("{type: shared_fs, host_path: shared}", "<base>/shared", None),
        ("{type: directory, container_path: /ckpt}", "/ckpt", None),
        ("{type: s3, bucket: b, prefix: runs/a/}", "s3://b/runs/a", None),
        (
            "{type: s3, bucket: b, access_key: K, secret_key: S, endpoint_url: 'http://127.0.0.1:9000'}",
            "s3://b",
            {"key": "K", "secret": "S", "endpoint_url": "http://127.0.0.1:9000"},
        ),
        ("{type: gcs, bucket: b, prefix: p}", "gs://b/p", None),
        (
            "{type: azure, container: c, account_url: 'https://acct.blob.core.windows.net', credential: T}",
            "az://c",
            {"account_name": "acct", "credential": "T"},
        ),
    ],
)
def test_determined_checkpoint_storage_mappings_run_unchanged(tmp_path, storage, path, options):
    config = load_config(_write(tmp_path, f"entrypoint: job.py\ncheckpoint_storage: {storage}\n"))
    assert config.storage_path == path.replace("<base>", str(tmp_path.resolve()))
    assert config.storage_options == options


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ("{type: shared_fs, storage_path: x}", "type 'shared_fs' needs host_path"),
        ("{type: shared_fs, host_path: /mnt/data, storage_path: /elsewhere}", "must be inside host_path"),
        ("{type: s3, bucket: b, region: x}", "checkpoint_storage.region: unknown key for type 's3'"),
        ("{type: s3, bucket: 5}", "checkpoint_storage.bucket: must be a non-empty string"),
        ("{type: gcs, prefix: p}", "type 'gcs' needs bucket"),
        ("{type: s3, bucket: 's3://b'}", "checkpoint_storage.bucket: must be the bucket's name alone, got 's3://b'"),
        ("{type: gcs, bucket: b/runs}", "checkpoint_storage.bucket: must be the bucket's name alone"),
    ],
)
def test_determined_checkpoint_storage_mistakes_name_the_key(tmp_path, storage, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(_write(tmp_path, f"entrypoint: job.py\ncheckpoint_storage: {storage}\n"))
