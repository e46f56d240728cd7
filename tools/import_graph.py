"""The import graph of the ``torch_batch_process`` package: its cycles and its imports that point up a layer.

Every ``import`` statement of every module counts, wherever it stands: at the top, under ``if TYPE_CHECKING:``
and inside functions (an import deferred to run time is still a dependency, and one under ``TYPE_CHECKING`` is
one for every reader and checker). An edge goes from a module to each module of the package it names; a
package's ``__init__`` counts only when it is named itself (importing ``a.b.c`` also runs ``a/__init__``, but
that is Python's mechanics, not a dependency of the module).

A *cycle* is a strongly connected component of more than one module. A module's *layer* is that of the longest
prefix of its name in :data:`LAYERS` (top first); an *upward import* goes from a module to one of a higher
layer. Modules of one layer may import each other (cycles aside).

Inside a layer, :data:`SUBLAYERS` may order its parts the same way: the engine's (DESIGN §7) are, top first, the loop
and its helpers; the capabilities (each one's commit participant); the feed and the commit *side by side*; the
schedule; the plan; the engine's core. An import inside such a layer must point down a sub-layer, or stay inside its
own part: one from the feed to the commit (or back) is a *sideways* import, as wrong as an upward one, so that the two
cannot come to depend on each other unnoticed.

Run it as ``python tools/import_graph.py`` (``--json`` for the machine-readable form; ``--edges`` lists every
edge). ``tests/test_import_graph.py`` runs it and fails on a cycle, an upward import or a sub-layer import that
:data:`ALLOWED_CYCLES`, :data:`ALLOWED_UPWARD` and :data:`ALLOWED_SUBLAYER` do not name.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ALLOWED_CYCLES", "ALLOWED_SUBLAYER", "ALLOWED_UPWARD", "LAYERS", "SUBLAYERS", "Graph", "build_graph", "main",
]

PACKAGE = "torch_batch_process"
ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the call and the commands: what users import and run
    ("entry", ("", "batch_process", "core", "functional", "experimental", "pytorch", "launch", "tables", "validation")),
    # the engine: the loop and its components
    ("engine", ("engine",)),
    # generation engines behind one interface (continuous batching; the runner will drive them), sampling, requests
    ("generation", ("generation",)),
    # what the engine and the commands tell and read: observer, status, failures
    ("observe", ("observe",)),
    # upload_path staging, record writer, read-back
    ("outputs", ("outputs",)),
    # streaming sources
    ("sources", ("sources",)),
    # the stored job: stored names, commit records, state, integrity, open and repair, retry numbering
    ("jobstore", ("jobstore",)),
    # one interface, a backend per kind, the job lock
    ("storage", ("storage",)),
    # public types (the processor, its context, the call's arguments, the ranks), errors, reducers, device and
    # small helpers: every layer may import them
    (
        "base",
        (
            "arguments",
            "context",
            "device",
            "distributed_info",
            "environment",
            "errors",
            "failure_options",
            "integers",
            "lengths",
            "log",
            "lost_workers",
            "mesh_shape",
            "metrics_lines",
            "processes",
            "provenance",
            "processor",
            "reducers",
            "result",
            "settings",
            "shell_commands",
            "torch_features",
            "version",
        ),
    ),
)
"""Layers, top first, each with the module name prefixes (relative to the package) that belong to it."""

SUBLAYERS: dict[str, tuple[tuple[tuple[str, ...], ...], ...]] = {
    "engine": (
        # the loop on top: the lifecycle and its helpers
        (
            ("engine", "engine.loop", "engine.announce", "engine.building", "engine.final_drain", "engine.results",
             "engine.same_call"),
        ),
        # each capability's commit participant, between the feed's side of it and the commit
        (("engine.capabilities",),),
        # the feed and the commit, side by side: neither imports the other
        (("engine.feed",), ("engine.commit",)),
        (("engine.schedule",),),
        (("engine.plan",),),
        # the engine's core: the ranks' collectives and join, the device mesh's groups, a rank's work and failure
        (("engine.distributed", "engine.join", "engine.work", "engine.rank_failure", "engine.mesh"),),
        (("engine.pending_collectives",),),
    ),
}
"""Sub-layers of a layer, top first; each a tuple of parts side by side (module name prefixes each), which may not
import each other."""

ALLOWED_CYCLES: dict[frozenset[str], str] = {}
"""Cycles that stay, each with the reason (module names relative to the package). None today."""

ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
"""Upward imports that stay, ``(importer, imported)``, each with the reason. None today."""

ALLOWED_SUBLAYER: dict[tuple[str, str], str] = {}
"""Imports inside a layer that go up a sub-layer or sideways, ``(importer, imported)``, each with the reason. None
today."""


@dataclass
class Graph:
    """The package's modules and the imports between them."""

    modules: dict[str, Path]
    """Module name (relative to the package, ``""`` for the package itself) -> its file."""
    edges: dict[str, set[str]] = field(default_factory=dict)
    """Module -> the modules it imports."""
    where: dict[tuple[str, str], int] = field(default_factory=dict)
    """``(importer, imported)`` -> the line of the first import."""

    def cycles(self) -> list[list[str]]:
        """The strongly connected components of more than one module, each sorted, largest first."""
        return sorted((sorted(c) for c in _components(self.modules, self.edges) if len(c) > 1), key=lambda c: -len(c))

    def upward(self) -> list[tuple[str, str]]:
        """Imports from a module to one of a higher layer, sorted."""
        return sorted((a, b) for a, targets in self.edges.items() for b in targets if layer_rank(a) > layer_rank(b))

    def sublayer_imports(self) -> list[tuple[str, str, str]]:
        """Imports inside a layer of :data:`SUBLAYERS` that go up a sub-layer or sideways, as ``(importer, imported,
        "up" or "sideways")``, sorted."""
        found = []
        for a, targets in self.edges.items():
            where_a = sublayer_of(a)
            for b in targets:
                where_b = sublayer_of(b)
                if where_a is None or where_b is None or where_a[0] != where_b[0]:
                    continue
                if where_a[1] > where_b[1]:
                    found.append((a, b, "up"))
                elif where_a[1] == where_b[1] and where_a[2] != where_b[2]:
                    found.append((a, b, "sideways"))
        return sorted(found)

    def check(self) -> list[str]:
        """What :data:`ALLOWED_CYCLES`, :data:`ALLOWED_UPWARD` and :data:`ALLOWED_SUBLAYER` do not allow, one line each
        (empty: fine)."""
        problems = [
            f"import cycle of {len(c)} modules: {', '.join(c)}"
            for c in self.cycles()
            if frozenset(c) not in ALLOWED_CYCLES
        ]
        problems += [
            f"upward import: {a} ({layer_of(a)}) imports {b} ({layer_of(b)}) at line {self.where[a, b]}"
            for a, b in self.upward()
            if (a, b) not in ALLOWED_UPWARD
        ]
        problems += [
            f"{kind} import between sub-layers: {a} ({sublayer_name(a)}) imports {b} ({sublayer_name(b)}) at line "
            f"{self.where[a, b]}"
            for a, b, kind in self.sublayer_imports()
            if (a, b) not in ALLOWED_SUBLAYER
        ]
        problems += [f"module {m} is in no layer: add it to LAYERS" for m in self.modules if layer_of(m) == "?"]
        problems += [
            f"module {m} is in no sub-layer of {layer_of(m)}: add it to SUBLAYERS"
            for m in self.modules
            if layer_of(m) in SUBLAYERS and sublayer_of(m) is None
        ]
        return problems


def layer_of(module: str) -> str:
    """The name of ``module``'s layer (the longest prefix that :data:`LAYERS` lists); ``"?"`` when none."""
    best, best_len = "?", -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            matches = module == prefix or (prefix != "" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    return best


def sublayer_of(module: str) -> tuple[str, int, int] | None:
    """``(layer, sub-layer from the top, part)`` of ``module`` by the longest prefix :data:`SUBLAYERS` lists for its
    layer; ``None`` when its layer has no sub-layers, or none lists it."""
    layer = layer_of(module)
    best: tuple[str, int, int] | None = None
    best_len = -1
    for level, parts in enumerate(SUBLAYERS.get(layer, ())):
        for part, prefixes in enumerate(parts):
            for prefix in prefixes:
                if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                    best, best_len = (layer, level, part), len(prefix)
    return best


def sublayer_name(module: str) -> str:
    """The first prefix of ``module``'s part (e.g. ``engine.feed``), or ``"?"``."""
    where = sublayer_of(module)
    if where is None:
        return "?"
    return SUBLAYERS[where[0]][where[1]][where[2]][0] or "(package)"


def layer_rank(module: str) -> int:
    """0 for the top layer, growing downwards; one below the bottom for a module no layer lists."""
    names = [name for name, _ in LAYERS]
    layer = layer_of(module)
    return names.index(layer) if layer in names else len(names)


def build_graph(package_dir: Path | None = None) -> Graph:
    """Reads every module of the package and the imports in it."""
    package_dir = package_dir or ROOT / PACKAGE
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph = Graph(modules, {name: set() for name in modules})
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for target, line in _imports(ast.parse(path.read_text(), str(path)), name, is_package, modules):
            if target != name:
                graph.edges[name].add(target)
                graph.where.setdefault((name, target), line)
    return graph


def _imports(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The package's modules that ``tree`` imports, with the line of each import statement."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _relative(alias.name)
                if target is not None:
                    yield _existing(target, modules), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_from(node, module, is_package)
            target = _relative(base) if base is not None else None
            if target is None:
                continue
            for alias in node.names:  # `from a import b`: the module a.b when it is one, else a
                sub = f"{target}.{alias.name}" if target else alias.name
                yield (sub if sub in modules else _existing(target, modules)), node.lineno


def _absolute_from(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    parts = [PACKAGE, *module.split(".")] if module else [PACKAGE]
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _relative(name: str) -> str | None:
    """``name`` relative to the package, ``None`` for a name outside it."""
    if name == PACKAGE:
        return ""
    if name.startswith(PACKAGE + "."):
        return name[len(PACKAGE) + 1 :]
    return None


def _existing(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a module of the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _components(nodes: Iterable[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found


def _label(module: str) -> str:
    return module or "(package)"


def main(argv: list[str] | None = None) -> int:
    """Prints the cycles and upward imports; exits 1 when one is not allowed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--edges", action="store_true", help="also list every edge")
    args = parser.parse_args(argv)
    graph = build_graph()
    cycles, upward, problems = graph.cycles(), graph.upward(), graph.check()
    sublayer = graph.sublayer_imports()
    if args.json:
        print(json.dumps({"cycles": cycles, "upward": upward, "sublayer": sublayer, "problems": problems}, indent=1))
        return 1 if problems else 0
    edges = sum(len(targets) for targets in graph.edges.values())
    print(f"{len(graph.modules)} modules, {edges} imports between them")
    print(f"{len(cycles)} cycle(s)")
    for cycle in cycles:
        reason = ALLOWED_CYCLES.get(frozenset(cycle))
        print(f"  {len(cycle)} modules: {', '.join(map(_label, cycle))}" + (f"  [allowed: {reason}]" if reason else ""))
    print(f"{len(upward)} upward import(s)")
    for a, b in upward:
        reason = ALLOWED_UPWARD.get((a, b))
        note = f"  [allowed: {reason}]" if reason else ""
        print(f"  {_label(a)} ({layer_of(a)}) -> {_label(b)} ({layer_of(b)}){note}")
    print(f"{len(sublayer)} import(s) up or sideways between sub-layers")
    for a, b, kind in sublayer:
        reason = ALLOWED_SUBLAYER.get((a, b))
        note = f"  [allowed: {reason}]" if reason else ""
        print(f"  {kind}: {_label(a)} ({sublayer_name(a)}) -> {_label(b)} ({sublayer_name(b)}){note}")
    unlayered = sorted(m for m in graph.modules if layer_of(m) == "?")
    if unlayered:
        print(f"modules in no layer: {', '.join(unlayered)}")
    if args.edges:
        for a in sorted(graph.edges):
            for b in sorted(graph.edges[a]):
                print(f"  edge {_label(a)} -> {_label(b)}")
    for line in problems:
        print(f"NOT ALLOWED: {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
