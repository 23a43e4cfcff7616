"""The tour notebook in a real browser: run all, move the explorer's dp slider, and check
that the communication plot re-rendered with the new run's values."""
from __future__ import annotations

import pytest

from .helpers import move_slider, open_notebook, plot_data, run_all, slider_value, wait_plot_change

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

_JS_PLOT_INDEX = """(needle) => {
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
  return plots.findIndex(gd => gd.layout && gd.layout.title &&
                         String(gd.layout.title.text || '').includes(needle));
}"""


def _plot_index(page, needle: str) -> int:
    page.wait_for_function(f"(n) => ({_JS_PLOT_INDEX})(n) >= 0", arg=needle, timeout=120_000,
                           polling=250)
    return page.evaluate(_JS_PLOT_INDEX, needle)


def test_tour_dp_slider_reruns_and_redraws(jupyter_server, browser_page, artifacts_dir):
    page = browser_page
    open_notebook(page, jupyter_server, "00_tour.ipynb", timeout=120)
    run_all(page, timeout=300)
    assert slider_value(page, "dp") == "4"
    comm = _plot_index(page, "all-reduce per rank per step")
    before = plot_data(page, comm)
    assert [round(v, 6) for v in before[0]["y"]] and len(before[0]["x"][0]) == 4  # 4 ranks
    assert move_slider(page, "dp", -1) == "2"
    after = wait_plot_change(page, before, comm, timeout=120,
                             until=lambda d: d and len(d[0]["x"][0]) == 2)
    measured, formula = after[0]["y"], after[1]["y"]
    assert after[0]["x"] == [["rank 0", "rank 1"], ["all_reduce", "all_reduce"]]
    assert measured != before[0]["y"][:2]           # new values, not a relabel
    assert measured == pytest.approx(formula)        # 2(N-1)/N·|θ|·4 for N=2
    title = page.evaluate("(i) => document.querySelectorAll('.js-plotly-plot')[i]"
                          ".layout.title.text", comm)
    assert "dp=2" in title
    page.screenshot(path=str(artifacts_dir / "tour_explorer.png"), full_page=True)
