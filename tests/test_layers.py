"""The import layers: native/ stands below everything and imports only torch and the standard library;
graph/, solvers/, plugins/ and compile/ stand below the runtime, and there is no import cycle. Read
from the source (ast), every import counted: top-level, inside functions, and the type-only ones under
``TYPE_CHECKING`` (a type-only back-edge is a cycle waiting for its first real import)."""
from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package -> its folder in the checkout (pyproject's package-dir)
PACKAGES = {"hybridmem": ROOT / "hybridmem", "hybridmem.solvers": ROOT / "solvers",
            "hybridmem.plugins": ROOT / "plugins", "hybridmem.bench": ROOT / "bench"}
RUNTIME = "hybridmem.runtime"
NATIVE = "hybridmem.native"
BELOW_RUNTIME = ("hybridmem.graph", "hybridmem.solvers", "hybridmem.plugins", "hybridmem.compile")
# What native/ may import beyond itself: torch (its C++ headers and libraries are what it builds against)
# and the standard library; no other third-party package, no other part of hybridmem.
NATIVE_MAY_IMPORT = {"torch", *sys.stdlib_module_names}


def modules() -> dict[str, Path]:
    """Every module of the installed packages (bench's pytest suites are not shipped), by dotted name."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if package == "hybridmem" and parts[0] in ("solvers", "plugins", "bench"):
                continue
            if package == "hybridmem.bench" and (parts[-1].startswith("test_") or parts[-1] == "conftest"):
                continue
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def all_imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module that module ``name`` imports, anywhere in it, by absolute dotted name (third-party and
    standard-library ones included)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).rstrip(".") if node.level \
                else node.module or ""
            if base == "bench" or base.startswith("bench."):   # bench/ as the checkout names it
                base = f"hybridmem.{base}"
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return found - {name}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, anywhere in it."""
    return {m for m in all_imports(name, path, known) if m in known}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycle_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The edges inside import cycles: a -> b where b also reaches a (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    component: dict[str, int] = {}
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component[w] = index[v]
                if w == v:
                    break

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return {(a, b) for a, targets in graph.items() for b in targets if component[a] == component[b]}


def in_runtime(name: str) -> bool:
    return name == RUNTIME or name.startswith(RUNTIME + ".")


def test_native_imports_only_torch_and_the_standard_library() -> None:
    known = modules()
    native = {name: path for name, path in known.items() if name == NATIVE or name.startswith(NATIVE + ".")}
    assert {f"{NATIVE}.{m}" for m in ("cpumeter", "build", "counters", "allocconf", "capture", "external")} <= set(native)
    found = {(name, m) for name, path in native.items() for m in all_imports(name, path, known)
             if not (m == NATIVE or m.startswith(NATIVE + ".") or m.split(".")[0] in NATIVE_MAY_IMPORT)}
    assert found == set(), sorted(found)


def test_lower_layers_import_nothing_from_the_runtime() -> None:
    graph = import_graph()
    assert "hybridmem.graph.signature" in graph and "hybridmem.solvers.baselines" in graph  # the walk sees them
    found = {(a, b) for a, targets in graph.items() if a.startswith(BELOW_RUNTIME) for b in targets if in_runtime(b)}
    assert found == set(), sorted(found)   # graph/, solvers/, plugins/ and compile/ stand below runtime/


def test_no_import_cycle() -> None:
    """No module imports one that imports it back, through any chain, type-only imports included: a module
    that needs another's names without importing it takes them as arguments or through a protocol
    (``runtime/parts.py``)."""
    edges = cycle_edges(import_graph())
    assert edges == set(), sorted(edges)


def test_a_type_only_back_edge_is_a_cycle(tmp_path: Path) -> None:
    """The check above can fail: an ``if TYPE_CHECKING:`` import back to core closes a cycle it finds."""
    known = modules()
    mode = tmp_path / "dispatch_mode.py"
    mode.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .compose import Runtime\n")
    graph = import_graph()
    graph["hybridmem.runtime.dispatch_mode"] = imported("hybridmem.runtime.dispatch_mode", mode, known)
    assert graph["hybridmem.runtime.dispatch_mode"] == {"hybridmem.runtime.compose"}
    assert ("hybridmem.runtime.dispatch_mode", "hybridmem.runtime.compose") in cycle_edges(graph)
