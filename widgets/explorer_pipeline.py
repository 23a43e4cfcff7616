"""The :class:`~labkit_widgets.explorer.Explorer`'s pipeline bubble.

With ``pp > 1`` the training job runs the pipeline executor; :func:`report` reads its
bubble with :func:`labkit.parallel.pipeline.report.pipeline_report` from the steps that
ran untouched: the memory-tracked step (events tagged ``instrumented``) runs several times
slower and is left out, and the first step (one-off allocation) is skipped by the report.
With data parallelism several pipelines run at once; the report reads the first.

:func:`draw_bubble` paints idle / total per pipeline rank and over all of them, measured
from the trace beside the simulator fed with the measured per-stage costs and message time
(hatched), and, where the report measured it, the executor's own time between actions
(its hop and dispatch overheads) as a band of its own on top of the simulated bar. At
``pp = 1`` the figure says "no pipeline at pp=1" instead of drawing empty axes.
"""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go

from . import _style as S
from .explorer_figures import WIDTHS, _base, empty_note, steady_trace

__all__ = ["report", "bubble_figure", "draw_bubble", "mfu_note"]

_BUBBLE = "#9D755D"
_EXECUTOR = "#D4A373"


def report(result) -> Optional[dict]:
    """:func:`~labkit.parallel.pipeline.report.pipeline_report` of a pipeline run on its
    steady steps; ``None`` without a pipeline.

    Raises:
        ValueError: the trace holds no pipeline spans (the report's own message).
    """
    cfg = result.config
    if cfg.parallel.pp == 1:
        return None
    from labkit.parallel.pipeline.report import pipeline_report

    steady = steady_trace(result.trace)
    trace = steady if any(e.name in ("F", "B", "BW", "W") for e in steady.events) \
        else result.trace  # a single memory-tracked step: nothing else to read
    return pipeline_report(cfg, result.metrics, trace)


def mfu_note(pipe: Optional[dict]) -> str:
    """The MFU gauge's last line: the ceiling 1 − bubble ("" without a pipeline)."""
    if pipe is None:
        return ""
    s = pipe["summary"]
    return (f"ceiling 1 − bubble: {100 * s['mfu_ceiling']:.0f} % "
            f"(simulated {100 * s['mfu_ceiling_simulated']:.0f} %)")


_NONE = ["all ranks"]  # the placeholder bar without a pipeline


def bubble_figure() -> go.Figure:
    """Bars over all ranks and each pipeline rank: ``data[0]`` measured, ``data[1]``
    simulated (hatched), ``data[2]`` the executor's overhead stacked on the simulated
    bar; idle / total in percent."""
    return go.Figure([
        go.Bar(name="measured (trace)", x=_NONE, y=[0.0], marker_color=_BUBBLE, offsetgroup="m",
               hovertemplate="%{x}: %{y:.1f} % idle, measured<extra></extra>"),
        go.Bar(name="simulated (measured costs + messages)", x=_NONE, y=[0.0], offsetgroup="s",
               marker_color=_BUBBLE, marker_pattern_shape="/", opacity=0.55,
               hovertemplate="%{x}: %{y:.1f} % idle, simulated<extra></extra>"),
        go.Bar(name="executor overhead", x=_NONE, y=[0.0], base=[0.0], offsetgroup="s",
               marker_color=_EXECUTOR, opacity=0.8,
               hovertemplate="%{x}: +%{y:.1f} % from the executor's hop and dispatch "
                             "time<extra></extra>")],
        # 420 px: the legend below wraps to three lines in this width, and the plot keeps
        # half the figure (tests/browser/layout.py's "squashed plot")
        _base(WIDTHS["bubble"], 420, "pipeline bubble", barmode="group",
              yaxis=dict(title="idle / total, %", rangemode="tozero"),
              legend=dict(orientation="h", y=-0.25, x=0, font_size=11)))


def _executor(pipe: dict) -> Optional[tuple]:
    """``(all ranks, [per rank])`` bubble with the executor's measured overheads (the
    report's fourth rung), or ``None`` when the report has none."""
    rep, s = pipe.get("bubble"), pipe["summary"]
    explained = getattr(rep, "explained", None)
    if explained is None or s.get("bubble_explained") is None:
        return None
    per = [i / explained.makespan if explained.makespan else 0.0 for i in explained.idle]
    return s["bubble_explained"], per


def draw_bubble(fig, pipe: Optional[dict]) -> None:
    """The bubble of ``pipe`` (a :func:`report`), or "no pipeline at pp=1"."""
    if pipe is None:
        # one zero bar behind the note, never empty traces: JupyterLab's plotly front end was
        # seen not to apply a later restyle to bar traces that started with no points
        for tr in fig.data:
            tr.update(x=_NONE, y=[0.0])
        fig.data[2].base = [0.0]
        empty_note(fig, "no pipeline at pp=1")
        fig.layout.showlegend = False  # no key for bars that are not there
        fig.layout.title.text = "pipeline bubble"
        return
    empty_note(fig, None)
    fig.layout.showlegend = True
    s, rows = pipe["summary"], pipe["rows"]
    x = ["all ranks"] + [f"rank {r['global_rank']}" for r in rows]
    meas = [100 * s["bubble"]] + [100 * (r["idle_frac"] or 0.0) for r in rows]
    sim = [100 * s["bubble_simulated"]] + [100 * (r["predicted_idle_frac"] or 0.0)
                                           for r in rows]
    fig.data[0].update(x=x, y=meas)
    fig.data[1].update(x=x, y=sim)
    ex = _executor(pipe)
    note = ""
    if ex is not None:
        total = [100 * ex[0]] + [100 * v for v in ex[1]]
        fig.data[2].update(x=x, y=[max(0.0, t - b) for t, b in zip(total, sim)], base=sim)
        note = (f"<br>executor band: hop {1e3 * s['hop_s']:.2f} ms, dispatch "
                f"{1e3 * s['dispatch_s']:.2f} ms per action")
    else:
        fig.data[2].update(x=x, y=[0.0] * len(x), base=sim)
    fig.layout.title.text = (
        f"pipeline bubble — {s['schedule']} P={s['pp']} M={s['microbatches']} "
        f"V={s['virtual_stages']}<br><sup>measured {100 * s['bubble']:.1f} % vs simulated "
        f"{100 * s['bubble_simulated']:.1f} %{note}</sup>")
