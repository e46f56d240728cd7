"""The settings (:mod:`torch_batch_process.settings`): every ``TBP_*`` variable is read there and nowhere else, read
and checked once when a call starts, and docs/environment.md lists exactly the variables it reads."""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from harness import REPO

from torch_batch_process import TorchBatchProcessor, settings, torch_batch_process
from torch_batch_process.errors import InvalidArgumentError

PACKAGE = REPO / "torch_batch_process"


def _tbp_constants(files: list[Path]) -> set[str]:
    """Names bound to a ``"TBP_..."`` string anywhere in ``files`` (module constants and their imports)."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                if isinstance(node.value.value, str) and node.value.value.startswith("TBP_"):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, ``environ`` (imported or a parameter of that name)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def environment_reads_of_tbp_variables(files: list[Path], names_from: list[Path] | None = None) -> list[str]:
    """``path:line`` of every read of a ``TBP_*`` variable from the environment in ``files``: ``os.environ.get(...)``,
    ``os.environ[...]``, ``os.getenv(...)``, ``... in os.environ``, with the name literal or in a constant (bound in
    ``files`` or in ``names_from``, such as one imported from the settings)."""
    constants = _tbp_constants([*files, *(names_from or [])])

    def names_tbp(key: ast.AST | None) -> bool:
        if isinstance(key, ast.Constant):
            return isinstance(key.value, str) and key.value.startswith("TBP_")
        if isinstance(key, ast.JoinedStr):  # f"TBP_{...}"
            return any(isinstance(v, ast.Constant) and str(v.value).startswith("TBP_") for v in key.values[:1])
        name = key.id if isinstance(key, ast.Name) else key.attr if isinstance(key, ast.Attribute) else None
        return name in constants

    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("get", "pop", "setdefault") and _is_environ(node.func.value) and node.args:
                    key = node.args[0]
                elif node.func.attr == "getenv" and node.args:
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
                key = node.slice
            elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
                key = node.left
            if key is not None and names_tbp(key):
                found.append(f"{path.relative_to(path.parents[1])}:{node.lineno}")
    return found


def test_no_module_but_the_settings_reads_a_tbp_variable_from_the_environment():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100  # it read the package
    # the launcher's per-worker wrapper runs by path and imports nothing but the standard library (it starts before
    # the worker's interpreter, and must not import torch): it reads the launcher's own TBP_LAUNCH_STATE itself
    standalone = {PACKAGE / "settings.py", PACKAGE / "launch" / "rank_prefix.py"}
    assert environment_reads_of_tbp_variables([p for p in files if p not in standalone], names_from=files) == []


def test_the_scan_finds_every_way_of_reading_a_tbp_variable(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "names.py").write_text('SHARD_ENV = "TBP_SHARD_BYTES"\n')
    (package / "reads.py").write_text(
        "import os\nfrom os import environ\nfrom pkg.names import SHARD_ENV\n"
        "a = os.environ.get('TBP_X')\nb = os.getenv(SHARD_ENV)\nc = environ['TBP_Y']\nd = 'TBP_Z' in os.environ\n"
        "e = os.environ.get('HOME')\nos.environ['TBP_W'] = '1'\n"
    )
    reads = environment_reads_of_tbp_variables(sorted(package.glob("*.py")))
    assert reads == ["pkg/reads.py:4", "pkg/reads.py:5", "pkg/reads.py:6", "pkg/reads.py:7"]


def test_docs_environment_lists_the_variables_the_settings_read():
    doc = (REPO / "docs" / "environment.md").read_text()
    table = settings.markdown_table()
    assert table in doc, f"docs/environment.md's table of the library's own variables must read:\n{table}"
    names = [v.name for v in settings.VARIABLES]
    assert len(names) == len(set(names)) and all(name.startswith("TBP_") for name in names)
    assert [v.field for v in settings.VARIABLES] == [f.name for f in dataclasses.fields(settings.Settings)]


def test_one_policy_for_every_variable_blank_is_not_set_and_a_set_value_is_a_value_or_an_error():
    """Unset, empty or blank: a tuning variable's default, a stand-in's ``None`` (the argument's default applies).
    Set: a value (never ``None``, which would pass for "not set") or an error naming the variable."""
    defaults = settings.read_settings({})
    for blank in ("", "  "):
        read = settings.read_settings({v.name: blank for v in settings.VARIABLES})
        assert read == defaults
    for v in settings.VARIABLES:
        value = getattr(defaults, v.field)
        if v.stands_in:
            assert value == settings.EnvValue(v.name) and value.get() is None, v.name
        for raw in ("null", "[]", "0", "1", "x"):
            try:
                parsed = v.parse(raw)
            except InvalidArgumentError as exc:
                assert v.name in str(exc), (v.name, raw, str(exc))
            else:
                assert parsed is not None, (v.name, raw)
    read = settings.read_settings({"TBP_PROFILE": "null", "TBP_TENSORBOARD": "maybe", "TBP_ALLOW_SCRIPT_CHANGE": "yes"})
    with pytest.raises(InvalidArgumentError, match="TBP_PROFILE must be 1, 0 or a JSON object, got 'null'"):
        read.profile.get()  # was taken as unset
    with pytest.raises(InvalidArgumentError, match="TBP_TENSORBOARD must be 1, 0 or auto, got 'maybe'"):
        read.tensorboard.get()
    assert read.allow_script_change is True
    with pytest.raises(InvalidArgumentError, match="TBP_ALLOW_SCRIPT_CHANGE must be 1, 0, got 'sure'"):
        settings.read_settings({"TBP_ALLOW_SCRIPT_CHANGE": "sure"})  # was taken as 0, silently


def test_a_tuning_variable_is_refused_at_once_a_stand_in_only_where_it_is_used():
    with pytest.raises(InvalidArgumentError, match="TBP_UPLOAD_THREADS must be an int >= 1"):
        settings.read_settings({"TBP_UPLOAD_THREADS": "0"})
    read = settings.read_settings({"TBP_UPLOAD_THREADS": "0"}, check=False)
    assert read.upload_threads == 8  # tbp run passes the variables on: the job's call refuses them
    read = settings.read_settings({"TBP_HPARAMS": "[1]", "TBP_STORAGE_OPTIONS": "{nope", "TBP_SHARD_BYTES": "2M"})
    assert read.shard_bytes == 2 << 20 and read.hparams.value is None
    with pytest.raises(InvalidArgumentError, match="TBP_HPARAMS must hold a JSON object"):
        read.hparams.get()
    with pytest.raises(InvalidArgumentError, match="TBP_STORAGE_OPTIONS is not valid JSON"):
        read.storage_options.get()
    assert read.storage_path.get() is None


def test_the_settings_of_a_call_are_in_force_for_its_parts_on_every_thread(monkeypatch):
    import threading

    monkeypatch.setenv("TBP_STORAGE_RETRIES", "3")
    with settings.in_force(settings.read_settings()) as mine:
        monkeypatch.setenv("TBP_STORAGE_RETRIES", "9")  # read once: a change during the call is not seen
        seen = []
        thread = threading.Thread(target=lambda: seen.append(settings.current().storage_retries))
        thread.start()
        thread.join()
        assert seen == [3] and settings.current() is mine
    assert settings.current().storage_retries == 9  # outside a call: the environment's now


def environment_writes(files: list[Path]) -> list[str]:
    """``path:line`` of every write to the process's environment in ``files``: ``os.environ[...] = ...``,
    ``os.environ.update/setdefault/pop/clear(...)``, ``del os.environ[...]``, ``os.putenv/unsetenv(...)``."""
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript):
                write = _is_environ(node.value) and isinstance(node.ctx, (ast.Store, ast.Del))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr = node.func.attr
                write = attr in ("putenv", "unsetenv") or (
                    attr in ("update", "setdefault", "pop", "clear") and _is_environ(node.func.value)
                )
            else:
                write = False
            if write:
                found.append(f"{path.relative_to(path.parents[1])}:{node.lineno}")
    return found


def test_only_the_launcher_writes_the_environment_for_the_processes_it_starts(tmp_path):
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if "launch" not in p.parent.name]
    assert len(files) > 100
    assert environment_writes(files) == []  # the engine never did but once: LOCAL_RANK, in engine/distributed.py
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "writes.py").write_text(
        "import os\nos.environ['A'] = '1'\nos.environ.setdefault('B', '1')\ndel os.environ['A']\nos.putenv('C', '1')\n"
        "x = os.environ.get('A')\n"
    )
    assert environment_writes([package / "writes.py"]) == [f"pkg/writes.py:{n}" for n in (2, 3, 4, 5)]


class _Where(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        SEEN.append((self.context.device, self.context.distributed.get_local_rank(), os.environ.get("LOCAL_RANK")))


SEEN: list = []


def test_a_call_without_local_rank_takes_local_rank_0_and_leaves_the_environment_as_it_was(tmp_path):
    """A call used to leave LOCAL_RANK=0 in the caller's environment (a notebook's, for instance)."""
    before = dict(os.environ)
    assert "LOCAL_RANK" not in before  # conftest's clean environment
    SEEN.clear()
    torch_batch_process(_Where, list(range(4)), batch_size=2, storage_path=str(tmp_path / "job"))
    assert SEEN == [(torch.device("cpu"), 0, None)] * 2
    assert dict(os.environ) == before
