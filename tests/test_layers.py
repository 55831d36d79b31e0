"""The package's import structure, read from the source with ``ast`` (nothing is imported): no
import cycle between flowexec's modules, and one direction between its layers
(docs/architecture.md, "Layers"). Imports inside functions count: a cycle through a lazy import
is still a cycle for the reader, and only hides an order dependency at run time.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "flowexec"

# Top to bottom. A unit (a top-level module or folder of flowexec/) may import the units of the
# layers below its own; units of one layer do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("face",),  # flowexec/__init__.py, cli.py, demo.py, models.py: what a user calls
    ("backend", "pipeline"),  # torch.compile's backend; pipeline-parallel training
    ("profiler",),  # timers, records and their exporters; instruction profiles of an executable
    ("executable",),  # flowexec.compile
    ("capture", "runtime", "build", "graph_variants"),  # fn -> Program; lowering and running a plan; a program's rewrites and plan; graph mode's graphs per signature
    ("plan", "fusion"),  # the passes composed into an ExecutionPlan; the fuse= option's regions compiled
    ("compile_workers",),  # cold regions compiled first in worker processes
    ("inductor",),  # a region's FX graph compiled by Inductor into one op
    ("passes",),  # pure functions over a Program
    ("fetch", "kernels", "rng", "draw_ranges", "inductor_keys", "inductor_entries", "kept"),  # scalar readback; fused ops (torch.library); the generator's state as ops; Inductor's once-a-process keys kept; a region's cache entry loaded by its kept key; captured programs kept on disk
    ("op_log",),  # a capture's ops by role, which a kept program's replay must match
    ("program", "signature", "storage", "list_returns", "guards", "hyperparams", "parking", "_cuda_native", "verdict_cache", "snapshot", "fake_run",
     "optim_state"),  # the IR's records; leaf helpers
    ("frame_starts",),  # the frames a capture starts, for the guards' recorder
    ("errors",),
)
FACE = {"__init__", "cli", "demo", "models"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (functions included),
    as dotted names; ``from .x import y`` counts as importing ``x.y`` where that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        for t in targets:
            while t not in known and "." in t:
                t = t.rpartition(".")[0]
            if t in known and t != name:
                found.add(t)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit_of(module: str) -> str:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return "face" if top in FACE else top


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    bad = []
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            a, b = unit_of(m), unit_of(t)
            if a != b and rank[a] >= rank[b]:
                bad.append(f"{m} imports {t}: {a} may import only layers below it")
    return bad


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []


def test_every_module_has_a_layer():
    known = {u for layer in LAYERS for u in layer}
    assert sorted({unit_of(m) for m in modules()} - known) == []


def test_layers_import_downwards_only():
    assert layering_violations(import_graph()) == []


def test_the_checks_see_cycles_and_upward_imports_in_functions(tmp_path):
    """The checks themselves: a cycle closed by an import inside a function, relative imports of
    several levels, and an upward import are all found."""
    pkg = tmp_path / "flowexec"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "a.py").write_text("from . import b\n")
    (pkg / "runtime" / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "runtime" / "c.py").write_text("def g():\n    from ..capture import capture\n")
    (pkg / "capture.py").write_text("from flowexec.program import Program\n")
    (pkg / "program.py").write_text("")
    graph = import_graph(pkg)
    assert graph["flowexec.runtime.c"] == {"flowexec.capture"}
    assert cycles(graph) == [["flowexec.runtime.a", "flowexec.runtime.b"]]
    assert layering_violations(graph) == [
        "flowexec.runtime.c imports flowexec.capture: runtime may import only layers below it"]


def test_the_docs_state_these_layers():
    """docs/architecture.md's "Layers" table lists the same layers, top to bottom."""
    import re

    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    assert tuple(tuple(re.findall(r"`([\w.]+)`", r)) for r in rows) == LAYERS
