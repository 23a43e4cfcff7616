"""One notebook that builds every view of every notebook: the notebooks' own view cells
(a labkit view, or a plotly figure the notebook draws itself), with the cells they need,
cut from each notebook, in one kernel on one warm cluster.

Running each notebook whole in the browser takes minutes apiece (their parity checks and
sweeps); the layout of a view depends on the view's code and on the arguments and data the
notebook gives it, which these cells reproduce: each view cell verbatim, and every earlier
cell that binds or mutates a name it reads, transitively (:func:`view_slice`). The
notebooks' ``lk.Cluster(4)`` calls all name one pool, started once (:data:`POOL`).

    nb, origin = gallery_notebook(sorted(NOTEBOOKS_DIR.glob("*.ipynb")))
    origin[i]   # the notebook that gallery cell i comes from
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat

#: a cell that displays a view: a labkit ``…View(`` or ``Explorer(`` call, or a plotly
#: figure the notebook builds (``go.Figure(``, ``make_subplots(``)
VIEW_CALL = re.compile(r"\b(?:[A-Z]\w*View|Explorer)\(|\bgo\.Figure\(|\bmake_subplots\(")
#: the warm pool every notebook's four-rank cluster becomes
POOL = "_gallery_pool"
_CLUSTER4 = re.compile(r"\blk\.Cluster\(\s*(?:world_size\s*=\s*)?4\s*\)")


def _names(src: str) -> tuple:
    """``(bound, mutated, free)`` top-level names of a cell's code: bound by assignment,
    import, ``def`` or ``class``; mutated by an item or attribute assignment; free: read
    and not bound in the cell (a mutated name is free: it must exist before)."""
    code = "\n".join(line for line in src.splitlines()
                     if not line.lstrip().startswith(("%", "!")))
    bound, mutated, used = set(), set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else used).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx,
                                                                             ast.Store):
            base = node.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                mutated.add(base.id)
    return bound, mutated, used - bound


def view_slice(path) -> list:
    """The code cells of the notebook at ``path`` that its views need, in order: each cell
    that calls a view and every earlier cell that binds or mutates a name a chosen cell
    reads (back to the cell that binds it). ``[]`` for a notebook without views."""
    nb = nbformat.read(str(path), as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    info = [_names(c.source) for c in cells]
    chosen = {i for i, c in enumerate(cells) if VIEW_CALL.search(c.source)}
    need: set = set()
    for i in range(max(chosen, default=-1), -1, -1):
        bound, mutated, free = info[i]
        if i in chosen or (bound | mutated) & need:
            chosen.add(i)
            need = (need - bound) | free
    return [cells[i] for i in sorted(chosen)]


def gallery_notebook(paths) -> tuple:
    """``(notebook, origin)``: a notebook with a first cell that starts :data:`POOL`, then,
    per notebook of ``paths`` with views, a heading and its :func:`view_slice` (four-rank
    clusters replaced by the pool); ``origin[i]`` names the notebook of cell ``i``."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(
        f"import labkit as lk\n{POOL} = lk.Cluster(world_size=4)  # every notebook's pool")]
    origin = ["(gallery)"]
    for path in paths:
        cells = view_slice(path)
        if not cells:
            continue
        name = Path(path).name
        nb.cells.append(nbformat.v4.new_markdown_cell(f"## {name}"))
        nb.cells += [nbformat.v4.new_code_cell(_CLUSTER4.sub(POOL, c.source)) for c in cells]
        origin += [name] * (len(cells) + 1)
    return nb, origin
