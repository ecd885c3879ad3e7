"""The engine's import graph is a DAG: no module of `mleagle.engine` reaches itself through imports,
counting imports inside functions and under `TYPE_CHECKING` (a lazy import is still a dependency, and
a type-only one still ties two modules' designs together). A package importing its own submodules (an
`__init__` re-export) is not an edge back. Read from the source with `ast`, so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def engine_graph() -> dict[str, set[str]]:
    mods: dict[str, Path] = {}
    for p in (ROOT / "engine").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("mleagle", *parts))
        mods[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {}
    for name, p in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mleagle.engine"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("mleagle.engine")}
        # An edge to a package that contains this module is the import system loading the parent, not a
        # dependency of the module's code on its parent's.
        graph[name] = {d for d in deps if d in mods and d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_engine_import_graph_has_no_cycle() -> None:
    g = engine_graph()
    assert len(g) > 50 and g["mleagle.engine.core.engine"]  # the walk found the engine and its imports
    assert cycles(g) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_core_knows_neither_tensor_parallel_control_nor_telemetry() -> None:
    """The one-way engine: nothing in core/ imports the service layer (ranks, driver, telemetry,
    process), and the executor and spec packages do not import core's engine or scheduler."""
    g = engine_graph()
    for m, deps in g.items():
        if m.startswith("mleagle.engine.core."):
            assert not {d for d in deps if d.startswith("mleagle.engine.service")}, m
        if m.startswith(("mleagle.engine.executor.", "mleagle.engine.spec.")):
            assert not deps & {"mleagle.engine.core.engine", "mleagle.engine.core.scheduler"}, m
