"""Every notebook's views in JupyterLab at 1280 px with the file browser open: no output
wider than its cell, no control label, readout, button or selected option cut, no "null"
tooltip, no plotly text outside its figure, no legend with a scrollbar, no figure without
traces (printed lines that wrap are reported, not failed).

The views come from one gallery notebook (tests/browser/gallery.py): each notebook's own
view cells with the cells they need, run in one kernel on one warm cluster (a notebook
run whole takes minutes). After Run All, two views move to a second state (checkpointing
at N = 64, the ring all-reduce at N = 3) and are checked again.

Screenshots of every widget output land in tests/artifacts/gallery-<notebook>-<cell>.png
and every problem found, with its notebook, in tests/artifacts/gallery-layout.json.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nbformat
import pytest

from .gallery import gallery_notebook
from .helpers import open_notebook, run_all
from .layout import describe, layout_problems, open_sidebar, settle_plots

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(1200)]

WIDTH = 1280
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"

_JS_CELL_TEXT = """(i) => {
  const c = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
  return c ? c.querySelector('.jp-OutputArea').innerText : null;
}"""
_JS_VIEW_CELLS = """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell'))
  .map((c, i) => c.querySelector('.jp-OutputArea-output .widget-box, '
                                 + '.jp-OutputArea-output.js-plotly-plot') ? i : -1)
  .filter(i => i >= 0)"""
# A printed line wrapping is reported, not failed, here: the gallery runs only the print
# cells a view needs, so it cannot judge the notebooks' printing.
REPORTED_ONLY = {"wrapped line"}


@pytest.fixture(scope="module")
def gallery(start_jupyter, tmp_path_factory):
    """``(server, origin)``: JupyterLab rooted at a directory holding gallery.ipynb."""
    root = tmp_path_factory.mktemp("gallery")
    nb, origin = gallery_notebook(sorted(NOTEBOOKS.glob("*.ipynb")))
    nbformat.write(nb, root / "gallery.ipynb")
    return start_jupyter(root), origin


def _cell(page, index: int):
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


def _find_cell(page, needle: str) -> int:
    sources = page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.widgets
        .map(c => c.model.sharedModel.getSource())""")
    return next(i for i, src in enumerate(sources) if needle in src)


def _press(page, cell_index: int, label: str, key: str, times: int = 1) -> None:
    """Press ``key`` on the handle of the slider labelled ``label`` in a cell's output."""
    slider = _cell(page, cell_index).locator(".widget-slider").filter(
        has=page.locator(".widget-label", has_text=re.compile(rf"^\s*{re.escape(label)}\s*$")))
    handle = slider.locator(".noUi-handle").first
    handle.scroll_into_view_if_needed()
    handle.focus()
    for _ in range(times):
        handle.press(key)


def _wait_text(page, cell_index: int, text: str, timeout_s: float = 300) -> None:
    page.wait_for_function(f"() => ({_JS_CELL_TEXT})({cell_index}).includes({text!r})",
                           timeout=timeout_s * 1000, polling=200)


def _screenshots(page, origin, artifacts_dir, cells, suffix: str = "") -> list:
    saved = []
    for i in cells:
        out = _cell(page, i).locator(".jp-OutputArea").first
        out.scroll_into_view_if_needed()
        path = artifacts_dir / f"gallery-{origin[i].removesuffix('.ipynb')}-{i}{suffix}.png"
        out.screenshot(path=str(path))
        saved.append(path.name)
    return saved


def test_every_view_fits_its_cell_at_1280(gallery, browser_page, artifacts_dir):
    server, origin = gallery
    page = browser_page
    page.set_viewport_size({"width": WIDTH, "height": 900})
    open_notebook(page, server, "gallery.ipynb", timeout=300)
    open_sidebar(page)
    t0 = time.monotonic()
    run_all(page, timeout=900)
    run_all_s = time.monotonic() - t0
    settle_plots(page)
    problems = layout_problems(page)
    shots = _screenshots(page, origin, artifacts_dir, page.evaluate(_JS_VIEW_CELLS))

    # second states: a long checkpointing schedule, and a collective on three ranks
    full = _find_cell(page, 'CheckpointView(n_layers=8, strategy="full")')
    _press(page, full, "N", "ArrowRight", times=6)
    _wait_text(page, full, "N=64")
    ring = _find_cell(page, 'CollectiveView(cluster, op="all_reduce", algorithm="ring")')
    _press(page, ring, "N", "ArrowLeft")
    _wait_text(page, ring, "N=3")
    settle_plots(page)
    problems += [p for p in layout_problems(page) if p not in problems]
    shots += _screenshots(page, origin, artifacts_dir, [full, ring], suffix="-after")

    for p in problems:
        p["notebook"] = origin[p["cell"]]
    report = {"width": WIDTH, "run_all_s": round(run_all_s, 1), "cells": len(origin),
              "problems": problems, "screenshots": shots}
    (artifacts_dir / "gallery-layout.json").write_text(json.dumps(report, indent=1))
    print(f"gallery: {len(origin)} cells, Run All {run_all_s:.1f} s, "
          f"{len(shots)} screenshots, {len(problems)} problems")
    failing = [p for p in problems if p["kind"] not in REPORTED_ONLY]
    assert not failing, "\n".join(f"{p['notebook']}: {line}" for p, line in
                                  zip(failing, describe(failing).splitlines()))
