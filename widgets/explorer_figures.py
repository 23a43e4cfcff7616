"""Figures of the :class:`~labkit_widgets.explorer.Explorer` (its history rows and the words
for a run are :mod:`labkit_widgets.explorer_history`'s, importable from here as before).

Pure builders and painters: ``*_figure()`` returns an empty ``go.Figure`` with the traces
its painter fills; ``draw_*(fig, ...)`` swaps their data in place (call it inside the
widget's ``batch_update()``). They read the per-rank ``metrics`` of
:func:`labkit.train.run` (bytes, seconds) and draw MiB and milliseconds.

* memory per rank by category, three bars a rank: **at the peak** (every category at the
  moment of the highest total: after the forward pass, before any gradient exists), the
  **model state** measured (parameters, gradients, optimizer state each at its largest in
  the step) and the model state **predicted** by :func:`labkit.plan.model_state_bytes`
  (hatched);
* MFU on a gauge with the lecture's bars (30 % good, 40 % excellent), HFU and the step time;
* bytes per rank per step by mesh axis and collective, measured (labkit.comm's trace)
  beside the formula (hatched); "no communication at dp=1" rather than empty axes.

The pipeline bubble is :mod:`labkit_widgets.explorer_pipeline`'s.
"""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go

from . import _style as S
from .explorer_history import (  # noqa: F401  (moved; importable from here as before)
    layout_string, knobs_string, describe, _f, HISTORY_COLUMNS, summarize, _peak, peak_line,
    _timed_loss, history_html)

__all__ = ["layout_string", "knobs_string", "describe", "HISTORY_COLUMNS", "summarize",
           "history_html", "memory_figure", "draw_memory", "mfu_figure", "draw_mfu", "peak_line",
           "comm_figure", "draw_comm", "empty_note", "steady_trace"]

#: the memory figure's three bars per rank: at the peak, model state measured, predicted
MEMORY_KINDS = ("peak", "state", "pred.")
#: figure widths (px): two figures a row fit the 848 px output of a 1280 px JupyterLab
#: window with the file browser open
WIDTHS = {"memory": 500, "mfu": 320, "comm": 420, "bubble": 400}
#: collective names on the communication figure's axis (the hover gives the full name)
SHORT_OPS = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG",
             "all_to_all": "A2A", "broadcast": "bcast", "send": "send"}
_STATE = ("parameters", "gradients", "optimizer")


def steady_trace(trace, skip_first: bool = False):
    """``trace`` without its instrumented steps (events tagged ``args["instrumented"]``,
    e.g. the memory-tracked step, several times slower) and, with ``skip_first``, without
    the first step (one-off allocation) and the set-up before it when a later step remains:
    the steps the step time and the bubble are read from."""
    from labkit.trace import Trace

    events = [e for e in trace.events if not (e.args or {}).get("instrumented")]
    steps = sorted({e.step for e in events if e.step >= 0})
    if skip_first and len(steps) > 1:
        events = [e for e in events if e.step in steps[1:]]
    return Trace(events)


def empty_note(fig, text: Optional[str]) -> None:
    """Hide ``fig``'s axes behind one centred sentence (``text``), or show them again."""
    fig.layout.annotations = [] if text is None else [dict(
        text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
        font=dict(size=15, color=S.MUTED))]
    fig.layout.xaxis.visible = fig.layout.yaxis.visible = text is None


def _base(width: int, height: int, title: str, **extra) -> dict:
    return dict(template="plotly_white", width=width, height=height,
                title=dict(text=title, font_size=13, x=0.01, xanchor="left"),
                margin=dict(l=52, r=10, t=78, b=40), **extra)


# --------------------------------------------------------------------------- memory
def memory_figure() -> go.Figure:
    """Stacked bars, one trace per category of :data:`_style.MEMORY_CATEGORIES`."""
    bars = [go.Bar(name=c, x=[[], []], y=[], marker_color=S.MEMORY_COLORS[c],
                   hovertemplate=f"{c}: %{{y:.3f}} MiB<br>%{{x}}<extra></extra>")
            for c in S.MEMORY_CATEGORIES]
    return go.Figure(bars, _base(
        WIDTHS["memory"], 380, "memory per rank, MiB", barmode="stack",
        legend=dict(orientation="h", y=-0.22, x=0, font_size=11),
        xaxis=dict(tickfont_size=10)))


def draw_memory(fig, metrics: list, reused_from: Optional[int] = None) -> None:
    """Per rank: the categories at the peak, the model state measured and predicted (MiB).
    ``reused_from``: the run whose memory is shown (same configuration), if not this one."""
    x0 = [f"rank {m.get('rank', r)}" for r, m in enumerate(metrics) for _ in MEMORY_KINDS]
    x1 = list(MEMORY_KINDS) * len(metrics)
    measured = all(m.get("memory") for m in metrics)
    for tr, cat in zip(fig.data, S.MEMORY_CATEGORIES):
        ys = []
        for m in metrics:
            mem, pred = m.get("memory") or {}, m.get("memory_predicted") or {}
            state = cat in _STATE
            ys += [S.mib(mem["peak"].get(cat)) if mem else None,
                   S.mib(mem["model_state"].get(cat)) if mem and state else None,
                   S.mib(pred.get(cat)) if state else None]
        tr.update(x=[x0, x1], y=ys, marker_pattern_shape=["", "", "/"] * len(metrics))
    where = ["peak: every category at the highest total (gradients may not exist yet)",
             "state: parameters, gradients, optimizer each at its largest · pred.: predicted"]
    if not measured:
        where = ["memory not measured in this run (measure_memory=False)",
                 "pred.: the model state predicted"]
    elif reused_from is not None:
        where[1] = (f"measured in run #{reused_from}, the same configuration (this run "
                    "skipped the memory step)")
    fig.layout.title.text = "memory per rank, MiB<br><sup>" + "<br>".join(where) + "</sup>"


# --------------------------------------------------------------------------- MFU
def mfu_figure() -> go.Figure:
    """A 0–100 % gauge banded at the lecture's 30 % / 40 %."""
    g, e = 100 * S.MFU_GOOD, 100 * S.MFU_EXCELLENT
    return go.Figure(go.Indicator(
        mode="gauge+number", value=None, number=dict(suffix=" %", valueformat=".1f"),
        delta=dict(valueformat=".1f", suffix=" pts"),
        gauge=dict(axis=dict(range=[0, 100], tickfont_size=10), bar=dict(color="#333"),
                   steps=[dict(range=[0, g], color="#F6D5D1"),
                          dict(range=[g, e], color="#FCEFC7"),
                          dict(range=[e, 100], color="#D5EFD8")],
                   threshold=dict(line=dict(color=S.OK_GREEN, width=3), value=e)),
        domain=dict(x=[0, 1], y=[0.08, 0.82])),
        dict(width=WIDTHS["mfu"], height=380, margin=dict(l=30, r=30, t=100, b=24),
             title=dict(text="MFU", font_size=13, x=0.02, xanchor="left")))


def draw_mfu(fig, row: dict, prev_pct: Optional[float], note: str = "") -> None:
    """``row["mfu_pct"]`` on the gauge (with the change from ``prev_pct`` when there is
    one), HFU and the step time in the title, the peak's age and load (:func:`peak_line`),
    ``note`` (e.g. a pipeline's ceiling) last. A row with ``mfu_error`` (a step faster than
    the peak) shows no number: the title says the inputs are wrong."""
    v, h = row.get("mfu_pct"), row.get("hfu_pct")
    err = row.get("mfu_error")
    rating = ("input error, HFU > 100 %" if err
              else "not measured" if v is None else "excellent" if v > 100 * S.MFU_EXCELLENT
              else "good" if v > 100 * S.MFU_GOOD else "low")
    if err:
        v = None
    ind = fig.data[0]
    ind.update(value=v, mode="gauge+number" + ("+delta" if prev_pct is not None
                                                 and v is not None else ""))
    if prev_pct is not None:
        ind.delta.reference = prev_pct
    hfu = "–" if h is None else f"{h:.1f} %"
    bars = " (the peak is not a ceiling)" if err else " (>30 % good, >40 % excellent)"
    lines = [f"MFU: {rating}{bars}", f"HFU {hfu} · step {row.get('step_ms', 0.0):.1f} ms"] + \
        [x for x in (peak_line(row), note) if x]
    fig.layout.title.text = lines[0] + "<br><sup>" + "<br>".join(lines[1:]) + "</sup>"


# --------------------------------------------------------------------------- comm
def comm_figure() -> go.Figure:
    """Grouped bars over (rank, axis and op): ``data[0]`` measured, ``data[1]`` the
    formula (hatched). No legend: the title says which bar is which, and a legend below
    the plot sat on the two-row "rank r" / "tp AG" axis labels as soon as a rank had three
    or more bars (sequence or expert parallelism) and they turned sideways."""
    return go.Figure([
        go.Bar(name="measured (labkit.comm trace)", x=[[], []], y=[],
               marker_color=S.COMM_COLORS["all_reduce"],
               hovertemplate="%{x}: %{y:.4f} MiB/step measured<extra></extra>"),
        go.Bar(name="formula", x=[[], []], y=[], marker_pattern=dict(shape="/", fgcolor="#444"),
               marker_color=S.COMM_COLORS["all_reduce"], opacity=0.6,
               hovertemplate="%{x}: %{y:.4f} MiB/step formula<extra></extra>")],
        _base(WIDTHS["comm"], 350, "bytes per rank per step", barmode="group",
              yaxis_title="MiB",
              xaxis=dict(tickfont_size=10), showlegend=False))


def _rows(m: dict) -> list:
    """``[(axis, op, measured bytes, formula bytes or None)]`` of one rank, axes and ops in
    a fixed order, ops that moved nothing (a receive counts its bytes on the sender) left out."""
    meas, pred = m.get("comm_bytes_by_axis") or {}, m.get("comm_predicted_by_axis") or {}
    out = []
    for axis in sorted(set(meas) | set(pred)):
        ops = set(meas.get(axis, {})) | set(pred.get(axis, {}))
        for op in sorted(ops):
            got, want = meas.get(axis, {}).get(op, 0.0), pred.get(axis, {}).get(op)
            if got or want:
                out.append((axis, op, got, want))
    return out


def draw_comm(fig, metrics: list, cfg) -> None:
    """Bytes each rank sent in one steady step, per axis and collective, measured beside
    the formula (MiB); a sentence instead of empty axes when nothing was sent."""
    x0, x1, ym, yp, colors = [], [], [], [], []
    for r, m in enumerate(metrics):
        for axis, op, got, want in _rows(m):
            x0.append(f"rank {m.get('rank', r)}")
            x1.append(f"{axis} {SHORT_OPS.get(op, op)}")
            ym.append(S.mib(got))
            yp.append(None if want is None else S.mib(want))
            colors.append(S.COMM_COLORS[S.comm_family(op)])
    colors = colors or S.COMM_COLORS["all_reduce"]
    fig.data[0].update(x=[x0, x1], y=ym, marker_color=colors)
    fig.data[1].update(x=[x0, x1], y=yp, marker_color=colors)
    p = cfg.parallel
    if not x0:
        degrees = [f"{a}={getattr(p, a)}" for a in ("dp", "pp", "tp", "cp", "ep")
                   if getattr(p, a) > 1]
        empty_note(fig, "no communication at dp=1" if not degrees else
                   "no communication recorded in the step")
    else:
        empty_note(fig, None)
    m0 = metrics[0] if metrics else {}
    rules = [f"Ψ = {S.fmt(m0.get('n_params'), ',')} parameters"]
    if p.dp > 1:
        rules[0] += f"; dp: {'3Ψ' if cfg.zero_stage == 3 else '2Ψ'}·(N−1)/N·bytes"
    if p.pp > 1:
        rules.append("pp: one (b, S, H) activation per send")
    ops = sorted({op for m in metrics for _a, op, _g, _w in _rows(m) if op in SHORT_OPS
                  and SHORT_OPS[op] != op})
    if ops:
        rules.append(" · ".join(f"{SHORT_OPS[o]} {o.replace('_', '-')}" for o in ops))
    fig.layout.title.text = ("bytes per rank per step: measured, formula hatched"
                             "<br><sup>" + "<br>".join(rules) + "</sup>")
