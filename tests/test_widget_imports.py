"""labkit_widgets' modules import one way: every module imports on its own in a fresh
interpreter, and the graph of imports between widgets/ modules (top-level and inside
functions alike: a lazy import that closes a loop is still a loop) has no cycle."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

WIDGETS = Path(__file__).resolve().parents[1] / "widgets"
PACKAGE = "labkit_widgets"
MESH = ("mesh_roles", "mesh_svg", "mesh_summary", "mesh_planned", "mesh_view")


def import_graph(folder: Path = WIDGETS) -> dict:
    """``{module: {modules of folder it imports}}`` from each file's syntax tree: relative
    imports (``from . import x``, ``from .x import y``) and absolute ones of
    ``labkit_widgets.x``, at any depth of the file."""
    mods = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for path in folder.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 or node.module and node.module.split(".")[0] == PACKAGE:
                    parts = (node.module or "").split(".")
                    base = parts[0] if node.level == 1 else (parts[1] if len(parts) > 1 else "")
                    if base:
                        deps.add(base)
                    else:  # from . import a, b
                        deps.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == PACKAGE and len(parts) > 1:
                        deps.add(parts[1])
        graph[path.stem] = {d for d in deps if d in mods and d != path.stem}
    return graph


def find_cycle(graph: dict):
    """One import cycle as a list ``[a, b, …, a]``, or ``None``."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_widgets_import_graph_has_no_cycle():
    graph = import_graph()
    assert set(MESH) <= set(graph)
    assert graph["mesh_roles"] == set(), "mesh_roles is the bottom: it imports no sibling"
    cycle = find_cycle(graph)
    assert cycle is None, "widgets/ import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_lazy_import_loop(tmp_path):
    # the loop this repository had: mesh_view imported mesh_svg inside a method, and
    # mesh_svg imported mesh_view at its top
    (tmp_path / "mesh_view.py").write_text("def f():\n    from .mesh_svg import x\n")
    (tmp_path / "mesh_svg.py").write_text("from .mesh_view import y\n")
    (tmp_path / "other.py").write_text("from labkit_widgets import mesh_view\n")
    graph = import_graph(tmp_path)
    assert graph == {"mesh_view": {"mesh_svg"}, "mesh_svg": {"mesh_view"},
                     "other": {"mesh_view"}}
    assert find_cycle(graph) in (["mesh_svg", "mesh_view", "mesh_svg"],
                                 ["mesh_view", "mesh_svg", "mesh_view"])


#: run in one fresh interpreter: the package (and torch, which it imports) loads once, then
#: each mesh module is imported with no other mesh module loaded before it, so one that
#: only imports after a sibling fails here (one interpreter per module would cost ~4 s of
#: CPU each, for the same check)
_ALONE = """
import importlib, sys, traceback
import {pkg}
mesh = {mesh!r}
failed = []
for name in mesh:
    for m in mesh:
        sys.modules.pop("{pkg}." + m, None)
        getattr({pkg}, m, None) is not None and delattr({pkg}, m)
    try:
        importlib.import_module("{pkg}." + name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=-3))
print("FAILED", failed) if failed else print("OK", len(mesh))
sys.exit(1 if failed else 0)
"""


def test_each_mesh_module_imports_alone_in_a_fresh_interpreter():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run([sys.executable, "-c", _ALONE.format(pkg=PACKAGE, mesh=MESH)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == f"OK {len(MESH)}", \
        run.stdout[-2000:] + run.stderr[-2000:]
