"""The package's import graph (``tools/import_graph.py``): no cycle and no upward import between its layers beyond
the ones the tool names with a reason (DESIGN §7: arrows point down only; the read side never imports the engine).

Imports under ``TYPE_CHECKING`` and inside functions count: a deferred import is still a dependency.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from harness import REPO, base_env

sys.path.insert(0, str(REPO / "tools"))

import import_graph  # noqa: E402


def test_the_package_has_no_cycle_and_no_upward_import_that_the_tool_does_not_name():
    graph = import_graph.build_graph()
    assert graph.check() == []
    assert len(graph.modules) > 50  # it read the package


def test_the_engine_is_imported_by_no_layer_below_it():
    graph = import_graph.build_graph()
    below = ("outputs", "observe", "storage", "jobstore", "sources")
    climbing = sorted(
        (a, b)
        for a, targets in graph.edges.items()
        for b in targets
        if b.startswith("engine") and a.split(".")[0] in below and (a, b) not in import_graph.ALLOWED_UPWARD
    )
    assert climbing == []


def test_the_tool_finds_a_cycle_an_upward_import_and_imports_inside_functions_and_under_type_checking(tmp_path):
    package = tmp_path / import_graph.PACKAGE
    (package / "engine").mkdir(parents=True)
    (package / "storage").mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "storage" / "__init__.py").write_text("")
    (package / "engine" / "loop.py").write_text("from torch_batch_process.storage import base\n")
    (package / "storage" / "base.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from torch_batch_process.storage.local import Local
            def open_storage():
                from . import local
            """
        )
    )
    (package / "storage" / "local.py").write_text(
        "from torch_batch_process.storage.base import x\n"
        "def f():\n    from torch_batch_process.engine.loop import run\n"
    )
    (package / "stray.py").write_text("")
    graph = import_graph.build_graph(package)
    assert graph.cycles() == [["engine.loop", "storage.base", "storage.local"]]
    assert graph.upward() == [("storage.local", "engine.loop")]
    assert graph.edges["storage.base"] == {"storage.local"}
    assert graph.check() == [
        "import cycle of 3 modules: engine.loop, storage.base, storage.local",
        "upward import: storage.local (storage) imports engine.loop (engine) at line 3",
        "module stray is in no layer: add it to LAYERS",
    ]


def test_the_feed_and_the_commit_cannot_import_each_other_and_the_engines_core_imports_no_sub_layer_above(tmp_path):
    package = tmp_path / import_graph.PACKAGE
    for folder in ("engine/feed", "engine/commit", "engine/schedule", "engine/capabilities"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "feed" / "runner.py").write_text("from torch_batch_process.engine.commit import votes\n")
    (package / "engine" / "commit" / "votes.py").write_text("from torch_batch_process.engine import work\n")
    (package / "engine" / "work.py").write_text("")
    (package / "engine" / "join.py").write_text(
        "def f():\n    from torch_batch_process.engine.schedule import liveness\n"
    )
    (package / "engine" / "schedule" / "liveness.py").write_text("")
    (package / "engine" / "capabilities" / "memory.py").write_text(
        "from torch_batch_process.engine.commit import votes\nfrom torch_batch_process.engine.feed import runner\n"
    )
    graph = import_graph.build_graph(package)
    assert graph.sublayer_imports() == [
        ("engine.feed.runner", "engine.commit.votes", "sideways"),
        ("engine.join", "engine.schedule.liveness", "up"),
    ]
    assert [p for p in graph.check() if "sub-layer" in p] == [
        "sideways import between sub-layers: engine.feed.runner (engine.feed) imports engine.commit.votes "
        "(engine.commit) at line 1",
        "up import between sub-layers: engine.join (engine.distributed) imports engine.schedule.liveness "
        "(engine.schedule) at line 2",
    ]


def test_the_command_prints_the_graph_and_exits_0():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "import_graph.py")],
        env=base_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cycle(s)" in proc.stdout and "upward import(s)" in proc.stdout
    assert "0 import(s) up or sideways between sub-layers" in proc.stdout
