"""MeshView's interactive grid in JupyterLab: the ``<style>`` inside the ipywidgets HTML
applies (the widget sets innerHTML, unsanitised), and hovering a rank with the mouse
outlines exactly the members of its group along the selected axis and fades every other
rank, CSS alone; after the toggle selects pp, the same hover outlines the pp group.

The mesh is PP 2 x DP 2 x TP 2 on servers of 4 GPUs: rank 5's tp group is (4, 5), its pp
group (1, 5), its dp group (7, 5)... as ``labkit.mesh.Mesh`` computes them here.
"""
from __future__ import annotations

import time

import nbformat
import pytest

from labkit.mesh import Mesh

from .helpers import open_notebook, run_all
from .layout import describe, layout_problems

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

MESH = dict(pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=2)
GPUS_PER_SERVER = 4
CELL = f'''\
from labkit.mesh import Mesh
from labkit_widgets.mesh_view import MeshView

MeshView(Mesh(**{MESH!r}), "tp", gpus_per_server={GPUS_PER_SERVER}).widget()
'''

# per rank: the axis the grid shows, its square's computed stroke width, its computed
# opacity, its on-screen box and its tooltip
_JS_RANKS = """() => {
  const root = document.querySelector('.lk-mesh');
  if (!root) return null;
  return {axis: root.dataset.axis,
          ranks: Array.from(root.querySelectorAll('g.rank')).map(g => {
            const rect = g.querySelector('rect'), box = rect.getBoundingClientRect();
            return {rank: Number(g.dataset.rank),
                    stroke: getComputedStyle(rect).strokeWidth,
                    opacity: getComputedStyle(g).opacity,
                    x: box.x, y: box.y,
                    title: g.querySelector('title').textContent};
          })};
}"""


@pytest.fixture(scope="module")
def mesh_server(start_jupyter, tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh-hover")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nbformat.write(nb, root / "mesh.ipynb")
    return start_jupyter(root)


def _state(page) -> dict:
    got = page.evaluate(_JS_RANKS)
    return {r["rank"]: r for r in got["ranks"]} | {"axis": got["axis"]}


def _hover_and_check(page, mesh, axis: str, rank: int, artifacts_dir) -> None:
    """Hover ``rank``: exactly its ``axis`` group outlined, exactly the others faded; then
    move the mouse off the grid: every rank back as before."""
    rest = _state(page)
    assert rest["axis"] == axis
    base = {r: (rest[r]["stroke"], rest[r]["opacity"]) for r in range(mesh.size)}
    assert len(set(base.values())) == 1, base            # nobody highlighted at rest
    page.locator(f'.lk-mesh g.rank[data-rank="{rank}"] > rect').hover()
    page.wait_for_timeout(100)
    page.locator(".lk-mesh").screenshot(path=str(artifacts_dir / f"mesh-hover-{axis}.png"))
    now = _state(page)
    outlined = {r for r in range(mesh.size) if now[r]["stroke"] != rest[r]["stroke"]}
    faded = {r for r in range(mesh.size) if float(now[r]["opacity"]) < 1}
    group = set(mesh.group(rank, axis))
    assert outlined == group, (axis, outlined, group)
    assert faded == set(range(mesh.size)) - group, (axis, faded)
    assert all(now[r]["stroke"] == "3px" for r in group), now
    page.mouse.move(1, 1)
    page.wait_for_timeout(100)
    after = _state(page)
    assert {r: (after[r]["stroke"], after[r]["opacity"]) for r in range(mesh.size)} == base


def test_hover_outlines_the_group_along_the_selected_axis(mesh_server, browser_page,
                                                          artifacts_dir):
    page, mesh = browser_page, Mesh(**MESH)
    t0 = time.monotonic()
    open_notebook(page, mesh_server, "mesh.ipynb")
    run_all(page)
    page.wait_for_function("() => document.querySelectorAll('.lk-mesh g.rank').length === 8",
                           timeout=60_000, polling=200)
    problems = layout_problems(page)      # no cut toggle label, nothing wider than the cell
    assert not problems, describe(problems)
    rest = _state(page)
    for r in range(mesh.size):   # column = rank % 4, row = rank // 4, as in the figure
        # (mesh_svg's PITCH = 50 px between slots, ROW = 60 px between servers)
        col, row = r % GPUS_PER_SERVER, r // GPUS_PER_SERVER
        assert rest[r]["x"] == pytest.approx(rest[row * GPUS_PER_SERVER]["x"] + col * 50)
        assert rest[r]["y"] == pytest.approx(rest[col]["y"] + row * 60)
        assert rest[r]["title"].startswith(
            f"rank {r}, [TP, CP, PP, DP] = {[mesh.index(r, a) for a in ('tp', 'cp', 'pp', 'dp')]}")
    _hover_and_check(page, mesh, "tp", 5, artifacts_dir)

    page.locator(".widget-toggle-buttons button", has_text="pp").click()
    page.wait_for_function("() => (document.querySelector('.lk-mesh') || {dataset: {}})"
                           ".dataset.axis === 'pp'", timeout=60_000, polling=100)
    _hover_and_check(page, mesh, "pp", 5, artifacts_dir)
    print(f"mesh hover: {time.monotonic() - t0:.1f} s in the page")
