"""The tour notebook in a real browser at 1280 px: run all, then drag the explorer's dp and
pp sliders (keyboard on the slider handle: one released step per key) and check that the
figures re-rendered with the new run's values; no output is wider than its cell and no
control label is cut."""
from __future__ import annotations

import pytest

from .helpers import move_slider, open_notebook, run_all, slider_value, wait_titled_plot

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

WIDTH = 1280

# the explorer's figures, by their titles
COMM, BUBBLE, MEMORY = "bytes per rank per step", "pipeline bubble", "memory per rank"

# Every output no wider than its cell: nothing reaches past the cell output area's right
# edge (a figure's own output area, inside its widget, is part of that output), and no
# scroll box inside it hides content sideways. Every visible control label, slider
# readout and toggle button shows its whole text (ipywidgets cuts them with an ellipsis).
_JS_LAYOUT = """() => {
  const bad = [];
  const clipping = v => ['auto', 'scroll', 'hidden'].includes(v);
  for (const out of document.querySelectorAll('.jp-OutputArea-output')) {
    if (out.parentElement.closest('.jp-OutputArea-output')) continue;  // a figure's own
    const right = out.getBoundingClientRect().right;
    for (const el of [out, ...out.querySelectorAll('*')]) {
      const r = el.getBoundingClientRect();
      if (!r.width || !r.height) continue;
      if (r.right > right + 1) {
        bad.push(`wider than its cell: <${el.tagName.toLowerCase()} class="${el.className}">`
                 + ` ends at ${Math.round(r.right)} px, the output at ${Math.round(right)} px`);
        break;
      }
      const cs = getComputedStyle(el);
      if (el !== out && clipping(cs.overflowX) && el.scrollWidth > el.clientWidth + 1
          && !el.closest('.js-plotly-plot')) {
        bad.push(`scrolls sideways: <${el.tagName.toLowerCase()} class="${el.className}">`
                 + ` ${el.scrollWidth} px in ${el.clientWidth} px`);
      }
    }
  }
  for (const el of document.querySelectorAll(
      '.jp-OutputArea-output .widget-label, .jp-OutputArea-output .widget-readout,'
      + ' .jp-OutputArea-output .widget-toggle-button')) {
    if (!el.getBoundingClientRect().width) continue;
    if (el.scrollWidth > el.clientWidth + 1)
      bad.push(`cut label: "${el.textContent.trim()}" needs ${el.scrollWidth} px,`
               + ` has ${el.clientWidth} px`);
  }
  return bad;
}"""


def _explorer_shot(page, path) -> None:
    """A screenshot of the explorer's output (controls, figures, history) at the page width."""
    out = page.locator(".jp-OutputArea-output", has=page.locator(".labkit-unavailable")).first
    out.scroll_into_view_if_needed()
    box = out.bounding_box()
    page.set_viewport_size({"width": WIDTH, "height": int(box["height"]) + 400})
    out.screenshot(path=str(path))
    page.set_viewport_size({"width": WIDTH, "height": 900})


_JS_RUNS = """() => document.querySelectorAll('table.labkit-history tbody tr[title]').length"""
_JS_LATEST = """() => { const r = document.querySelector('table.labkit-history tbody tr[title]');
  return r ? r.getAttribute('title') : ''; }"""


def _wait_runs(page, n: int, timeout_s: float = 240) -> str:
    """Wait until the history table has ``n`` runs; the latest run's configuration."""
    page.wait_for_function(f"(n) => ({_JS_RUNS})() >= n", arg=n, timeout=timeout_s * 1000,
                           polling=250)
    return page.evaluate(_JS_LATEST)


def _ranks(plot) -> list:
    """The rank of each bar of a per-rank figure's first trace (its outer x category)."""
    return plot["data"][0]["x"][0]


def test_tour_explorer_dp_and_pp_in_the_browser(jupyter_server, browser_page, artifacts_dir):
    page = browser_page
    page.set_viewport_size({"width": WIDTH, "height": 900})
    open_notebook(page, jupyter_server, "00_tour.ipynb", timeout=180)
    run_all(page, timeout=500)
    assert slider_value(page, "dp") == "4" and slider_value(page, "pp") == "1"
    note = page.locator(".labkit-unavailable").first.text_content()  # folded or open
    assert "pp=2" in note and "8 ranks" in note and "world_size=4" in note  # validate's words
    # the first run drawn: one all-reduce bar per rank, memory bars for the four ranks
    comm = wait_titled_plot(page, COMM, lambda p: len(_ranks(p)) == 4, timeout=240)
    assert {name.split()[-1] for name in comm["data"][0]["x"][1]} == {"AR"}
    wait_titled_plot(page, MEMORY, lambda p: sorted(set(_ranks(p))) == [f"rank {r}" for r in
                                                                          range(4)])
    wait_titled_plot(page, BUBBLE, lambda p: p["annotations"] == ["no pipeline at pp=1"])
    assert page.evaluate(_JS_LAYOUT) == []
    _explorer_shot(page, artifacts_dir / "tour_explorer_dp4_1280.png")
    runs = page.evaluate(_JS_RUNS)

    # each released slider step re-runs on the warm cluster (a new history row with that
    # configuration) and every figure redraws from that run
    assert move_slider(page, "dp", -1) == "2"
    assert "dp=2" in _wait_runs(page, runs + 1).replace(" ", "")
    wait_titled_plot(page, COMM, lambda p: _ranks(p) == ["rank 0", "rank 1"])
    wait_titled_plot(page, MEMORY, lambda p: sorted(set(_ranks(p))) == ["rank 0", "rank 1"])
    assert move_slider(page, "dp", -1) == "1"
    assert "dp=1" in _wait_runs(page, runs + 2).replace(" ", "")
    wait_titled_plot(page, COMM, lambda p: p["annotations"] == ["no communication at dp=1"])
    wait_titled_plot(page, MEMORY, lambda p: sorted(set(_ranks(p))) == ["rank 0"])
    assert move_slider(page, "pp", +1) == "2"
    latest = _wait_runs(page, runs + 3).replace(" ", "")
    assert "pp=2" in latest and "dp=1" in latest
    # the bubble per pipeline rank, measured beside simulated; the stages' sends
    bubble = wait_titled_plot(page, BUBBLE,
                              lambda p: _ranks_x(p) == ["all ranks", "rank 0", "rank 1"])
    assert bubble["annotations"] == [] and "P=2" in bubble["title"]
    assert all(0 <= y < 100 for y in bubble["data"][0]["y"])
    assert all(0 < y < 100 for y in bubble["data"][1]["y"])
    wait_titled_plot(page, COMM, lambda p: p["annotations"] == [] and
                     sorted(set(_ranks(p))) == ["rank 0", "rank 1"])
    assert page.evaluate(_JS_LAYOUT) == []
    _explorer_shot(page, artifacts_dir / "tour_explorer_pp2_1280.png")


def _ranks_x(plot) -> list:
    """The categories of a plot's first trace (a one-level x axis)."""
    return plot["data"][0]["x"]
