"""The layout checks of tests/browser/layout.py see what they are for: a static page shaped
like JupyterLab's outputs (cell > output area > output) holds plotly figures and HTML with
one planted problem each, and their corrected twins; every planted problem is reported, in
its cell, and no twin is. One page, no Jupyter, no kernel: a second or two."""
from __future__ import annotations

import json
from pathlib import Path

import plotly
import plotly.graph_objects as go
import pytest

from .layout import layout_problems

pytestmark = [pytest.mark.browser]

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def _log_vline(fixed: bool) -> go.Figure:
    # notebook 06 §9's bug: add_vline on a log axis puts its label at 10^x
    fig = go.Figure(go.Scatter(x=[1, 2, 4, 8, 16, 32], y=[1, 0.9, 0.8, 0.7, 0.4, 0.3]))
    fig.update_layout(xaxis_type="log", width=500, height=300, margin=dict(t=40, b=40))
    if fixed:
        fig.add_vline(x=8, line_dash="dot")
        fig.add_annotation(x=0.903, xref="x", y=1, yref="paper", text="8", showarrow=False,
                           yanchor="bottom")
    else:
        fig.add_vline(x=8, line_dash="dot", annotation_text="one 8-GPU server")
    return fig


def _legend_over_labels(fixed: bool) -> go.Figure:
    x = [["rank 0"] * 4 + ["rank 1"] * 4, ["tp AG", "tp RS", "dp AR", "ep A2A"] * 2]
    fig = go.Figure([go.Bar(x=x, y=[1, 2, 3, 4] * 2, name="measured"),
                     go.Bar(x=x, y=[1, 2, 3, 4] * 2, name="formula")])
    fig.update_layout(width=420, height=350, margin=dict(t=30, b=40))
    if fixed:
        fig.update_layout(showlegend=False)
    else:
        fig.update_layout(legend=dict(orientation="h", y=-0.12, x=0))
    return fig


def _data_annotation(fixed: bool) -> go.Figure:
    fig = go.Figure(go.Scatter(x=[0, 1, 2], y=[0, 1, 2]))
    fig.update_layout(width=400, height=300, xaxis_range=[-0.1, 2.1],  # a range set by hand
                      margin=dict(t=30, b=40))
    fig.add_annotation(x=2 if not fixed else 1, y=1, text="a note",
                       showarrow=False, xanchor="left" if not fixed else "center")
    return fig


def _vline_labels(fixed: bool) -> go.Figure:
    # notebook 11's goodput figure: two optima a minute apart, each vline labelled, in a
    # short figure under a title's default top margin
    fig = go.Figure(go.Scatter(x=list(range(1, 181)), y=[1 - abs(t - 19) / 400 for t in
                                                        range(1, 181)]))
    fig.update_layout(title="goodput", width=600, height=320)
    if fixed:
        for name, x, dash in (("Young", 19.3, "dot"), ("Daly", 18.4, "dash")):
            fig.add_scatter(x=[x, x], y=[0.6, 1], mode="lines", name=name,
                            line=dict(dash=dash))
        fig.update_layout(margin=dict(t=40, b=40))
    else:
        for name, x in (("Young", 19.3), ("Daly", 18.4)):
            fig.add_vline(x=x, line_dash="dot", annotation_text=name)
    return fig


def _coinciding_markers(fixed: bool) -> go.Figure:
    # notebook 11's resume plot: two resumed runs that agree to 1e-7, at the same steps
    fig = go.Figure()
    for i, name in enumerate(("resumed on dp2×tp2", "resumed on pp2")):
        off = (i - 0.5) * 0.15 if fixed else 0
        fig.add_scatter(x=[3 + off, 4 + off, 5 + off], y=[2.5, 2.4, 2.3], mode="markers",
                        name=name, marker=dict(size=10))
    fig.update_layout(width=600, height=320, margin=dict(t=30, b=40))
    return fig


def _resume_figure() -> go.Figure:
    """Notebook 11's resume plot as labkit_widgets draws it, from stand-in results: two
    resumed runs whose losses agree (the gallery does not run that notebook's resumes)."""
    from types import SimpleNamespace as NS

    from labkit.config import RunConfig
    from labkit_widgets.snapshot_view import resume_losses_figure

    losses = [5.5, 5.2, 4.9, 4.7, 4.5, 4.4]

    def run(first, n, **par):
        cfg = RunConfig(model="tiny", steps=6).replace(**par)
        return NS(losses=losses[first:first + n], config=cfg,
                  metrics=[{"first_step": first}] * cfg.parallel.world_size)

    fig = resume_losses_figure(run(0, 6, dp=4), run(0, 3, dp=4),
                               run(3, 3, dp=2, tp=2, zero_stage=1),
                               extra={"resumed on pp2, 2 ranks": run(3, 3, pp=2)})
    fig.update_layout(width=830)
    return fig


def _stacked(fixed: bool) -> go.Figure:
    # the explorer's memory bars: four segments of about 1 stacked to 4, each under 30 % of
    # the axis; squeezed only when the range reaches far past the stacks' tops
    fig = go.Figure([go.Bar(x=["rank 0", "rank 1"], y=[1.0, 1.1], name=n)
                     for n in ("parameters", "gradients", "optimizer", "activations")])
    fig.update_layout(barmode="stack", width=400, height=300, margin=dict(t=30, b=40),
                      yaxis_range=[0, 4.6] if fixed else [0, 20])
    return fig


def _page(items) -> str:
    cells = []
    for i, (kind, payload) in enumerate(items):
        inner = (f"<div class='js-plotly-plot' id='p{i}'></div>" if kind == "fig" else payload)
        cells.append(f"<div class='jp-Cell'><div class='jp-OutputArea'>"
                     f"<div class='jp-OutputArea-child'><div class='jp-OutputArea-output' "
                     f"style='width:1000px'>{inner}</div></div></div></div>")
    figs = {f"p{i}": json.loads(p.to_json()) for i, (k, p) in enumerate(items) if k == "fig"}
    return ("<html><body><div class='jp-Notebook'>" + "".join(cells) + "</div><script>"
            f"window.__figs = {json.dumps(figs)};</script></body></html>")


SCROLL = ("<details open class='labkit-unavailable' style='max-height:{h};overflow-y:auto'>"
          "<summary>unavailable</summary><ul>" + "<li>a reason</li>" * 20 + "</ul></details>")


def test_each_planted_problem_is_reported_and_no_twin_is(browser_page):
    items = [("fig", _log_vline(False)), ("fig", _log_vline(True)),
             ("fig", _legend_over_labels(False)), ("fig", _legend_over_labels(True)),
             ("fig", _data_annotation(False)), ("fig", _data_annotation(True)),
             ("html", SCROLL.format(h="8em")), ("html", SCROLL.format(h="none")),
             ("fig", _vline_labels(False)), ("fig", _vline_labels(True)),
             ("fig", _coinciding_markers(False)), ("fig", _coinciding_markers(True)),
             ("fig", _resume_figure()),
             ("fig", _stacked(False)), ("fig", _stacked(True))]
    page = browser_page
    page.set_viewport_size({"width": 1280, "height": 900})
    page.set_content(_page(items))
    page.add_script_tag(path=str(PLOTLY_JS))
    page.evaluate("""async () => { for (const [id, f] of Object.entries(window.__figs))
        await Plotly.newPlot(id, f.data, f.layout); }""")
    problems = layout_problems(page)
    found = {(p["cell"], p["kind"]) for p in problems}
    assert found == {(0, "squeezed data"), (2, "label under legend"),
                     (4, "annotation outside plot"), (6, "hidden scroll"),
                     (8, "overprinted labels"), (8, "squashed plot"),
                     (10, "hidden markers"), (13, "squeezed data")}, problems
