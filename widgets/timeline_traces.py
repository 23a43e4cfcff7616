"""The timeline's data: trace events turned into plotly bar arrays, one fixed trace per
compute and communication family (:class:`labkit_widgets.timeline.TimelineView` draws them).

Spans in milliseconds from the run's first event; a call left in flight is drawn as an
in-flight line plus its own bar (:func:`~labkit_widgets.timeline_spans._drawn_spans`).
"""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go

from labkit.trace import COMPUTE, MARK, Trace

from . import _style as S
from .timeline_spans import (  # noqa: F401  (moved; importable from here as before)
    BLOCKED_CATS, _where, _group, _ms, _drawn_spans, _inflight_text)

#: the step selector's value for "all steps" (``None`` would leave the dropdown blank)
ALL_STEPS = "all"
#: shade of every other call in a communication lane
_ALT_OPACITY = 0.55

#: the comm lane sits this far below its rank's compute lane (rank rows are 1 apart)
COMM_OFFSET = 0.42
#: with point-to-point calls, their lane sits this far below the compute lane, and rank
#: rows are :data:`P2P_PITCH` apart
P2P_OFFSET, P2P_PITCH = 0.74, 1.4
_COMPUTE_WIDTH, _COMM_WIDTH, _BLOCKED_WIDTH, _P2P_WIDTH = 0.4, 0.3, 0.26, 0.24
#: top + bottom margin of the figure (px): the plot area, and the legend, get the rest
_MARGINS = 104

_COMPUTE_HOVER = ("<b>%{customdata[0]}</b> · rank %{customdata[7]}<br>step %{customdata[1]}"
                  "<br>%{customdata[5]:.3f} ms (from %{customdata[6]:.3f} ms)<extra>%{fullData.name}"
                  "</extra>")
_COMM_HOVER = ("<b>%{customdata[0]}</b> · rank %{customdata[7]}<br>step %{customdata[1]} · "
               "op %{customdata[2]} · axis %{customdata[8]}<br>%{customdata[9]}%{hovertext}"
               "<br>sent %{customdata[3]} · "
               "recv %{customdata[4]}<br>%{customdata[5]:.3f} ms (from %{customdata[6]:.3f} ms)"
               "<extra>%{fullData.name}</extra>")

_BLOCKED_HOVER = ("<b>%{customdata[0]}</b> · rank %{customdata[7]}<br>step %{customdata[1]}"
                  " · unit %{customdata[2]} · phase %{customdata[8]}<br>blocked "
                  "%{customdata[5]:.3f} ms (from %{customdata[6]:.3f} ms)<extra>blocked</extra>")

#: the thin, faint line behind an asynchronous call: issued until its ``wait()`` returned
_INFLIGHT_WIDTH, _INFLIGHT_OPACITY = 0.1, 0.45
_INFLIGHT_HOVER = ("<b>%{customdata[0]}</b> in flight · rank %{customdata[7]}<br>step "
                   "%{customdata[1]}%{hovertext}<extra>in flight</extra>")

# compute families, then "blocked" (drawn over compute), then the in-flight lines (below
# the comm bars), then comm
_FAMILIES = [("compute", fam) for fam in S.COMPUTE_COLORS] + [("blocked", "blocked")] + \
            [("inflight", "in flight")] + [("comm", op) for op in S.COMM_COLORS]


def _empty_traces() -> list:
    traces = []
    for kind, fam in _FAMILIES:
        if kind == "inflight":
            traces.append(go.Bar(
                name=fam, orientation="h", legendgroup="comm", legendgrouptitle_text="comm",
                width=_INFLIGHT_WIDTH, opacity=_INFLIGHT_OPACITY,
                marker=dict(color=[], line_width=0), hovertemplate=_INFLIGHT_HOVER,
                x=[], y=[], base=[], customdata=[], hovertext=[], showlegend=False))
            continue
        compute, blocked = kind == "compute", kind == "blocked"
        color = (S.BLOCKED_COLOR if blocked else
                 (S.COMPUTE_COLORS if compute else S.COMM_COLORS)[fam])
        traces.append(go.Bar(
            name=fam if compute or blocked else fam.replace("_", "-"), orientation="h",
            legendgroup="compute" if blocked else kind,
            legendgrouptitle_text="compute" if blocked else kind,
            width=(_BLOCKED_WIDTH if blocked else _COMPUTE_WIDTH if compute
                   else _P2P_WIDTH if fam == "p2p" else _COMM_WIDTH),
            marker=dict(color=color, line_width=0),
            hovertemplate=(_BLOCKED_HOVER if blocked else
                           _COMPUTE_HOVER if compute else _COMM_HOVER),
            textposition="inside", insidetextanchor="middle", textangle=0,
            textfont=dict(size=10, color="white"),
            x=[], y=[], base=[], customdata=[], text=[], hovertext=[], showlegend=False))
    return traces


def _family(e) -> tuple:
    if e.cat == COMPUTE:
        return ("compute", S.compute_family(e.name))
    if e.cat in BLOCKED_CATS:
        return ("blocked", "blocked")
    return ("comm", S.comm_family(e.op))


def _legend_height(cols) -> int:
    """Pixels the vertical legend needs: a row per shown family, a title and the gap
    before it per group, and the legend's padding (measured in Chromium: 19 px a row, a
    title and gap 30 px; a legend taller than the plot area gets a scrollbar)."""
    shown = [fam for fam, c in zip(_FAMILIES, cols) if c["showlegend"]]
    groups = {{"blocked": "compute", "inflight": "comm"}.get(k, k) for k, _ in shown}
    return 21 * len(shown) + 30 * len(groups) + 16


def timeline_traces(trace: Trace, step: Optional[int] = None) -> tuple[list[dict], dict]:
    """The bar data for ``trace`` (only ``step``'s events when given).

    Returns ``(per_trace, layout)``: one ``{x, y, base, customdata, showlegend}`` dict per
    family in :data:`_FAMILIES` order (communication families also carry a per-bar
    ``marker.opacity`` alternating along each lane), and the layout for the ranks present:
    y-axis ticks, a title with the shown step's own length, the x range, shaded windows
    (``shapes``/``annotations``) for instrumented steps, and a height that fits the legend.
    Pure data: no widget is touched, so it is cheap to test.
    """
    ranks = trace.ranks
    index = {fam: i for i, fam in enumerate(_FAMILIES)}
    cols = [{"x": [], "y": [], "base": [], "customdata": []} for _ in _FAMILIES]
    drawn = [e for e in trace.events if e.cat != MARK]
    events = drawn if step is None else [e for e in drawn if e.step == step]
    # a p2p lane when the run has point-to-point calls (any step: the rows stay put when
    # the step selector moves)
    p2p = any(_family(e) == ("comm", "p2p") for e in drawn)
    pitch = P2P_PITCH if p2p else 1.0
    row = {r: round(i * pitch, 6) for i, r in enumerate(ranks)}
    drawn_spans = _drawn_spans(trace, events)
    inflight = cols[index[("inflight", "in flight")]]
    inflight.update({"hovertext": [], "marker.color": []})
    # longest first inside a trace, so nested regions (layers.1.backward in backward) and
    # short collectives draw on top of the spans that contain them
    for e in sorted(events, key=lambda e: -e.duration):
        fam = _family(e)
        col = cols[index[fam]]
        lane_y = round(row[e.rank] + (P2P_OFFSET if fam == ("comm", "p2p") else
                                      COMM_OFFSET if fam[0] == "comm" else 0.0), 6)
        lo, hi, how = drawn_spans.get(id(e), (e.start, e.end, None))
        start_ms, dur_ms = _ms(trace, lo), max(hi - lo, 0.0) * 1e3
        col["x"].append(dur_ms)
        col["base"].append(start_ms)
        col["y"].append(lane_y)
        if fam[0] == "comm":
            label, where = _where(e)
            if how is not None:
                where += _inflight_text(trace, e, how)
                inflight["x"].append(max(e.duration, 0.0) * 1e3)
                inflight["base"].append(_ms(trace, e.start))
                inflight["y"].append(lane_y)
                inflight["hovertext"].append(where)
                inflight["marker.color"].append(S.COMM_COLORS[fam[1]])
                inflight["customdata"].append([e.name, e.step, "", "", "", 0, 0, e.rank, "", ""])
            col.setdefault("text", []).append(label)
            col.setdefault("hovertext", []).append(where)
            col.setdefault("marker.pattern.shape", []).append("/" if how == "waited" else "")
        if fam[0] == "blocked":  # op / axis slots carry the unit and phase waited for
            args = e.args or {}
            extra = [args.get("unit", "–"), args.get("phase", "–")]
        else:
            extra = [e.op or "–", e.axis or "–"]
        col["customdata"].append([e.name, e.step, extra[0], S.fmt_bytes(e.bytes_sent),
                                  S.fmt_bytes(e.bytes_recv), dur_ms, start_ms, e.rank,
                                  extra[1], _group(e) if fam[0] == "comm" else ""])
    for (kind, _fam), c in zip(_FAMILIES, cols):
        c["showlegend"] = bool(c["x"])
        if kind == "comm":
            c["marker.opacity"] = _alternating(c)
            c.setdefault("text", [])  # an emptied lane drops the labels it showed before
            c.setdefault("hovertext", [])
            c.setdefault("marker.pattern.shape", [])
    tickvals, ticktext = [], []
    for r, y in row.items():
        tickvals += [round(y + d, 6) for d in (0.0, COMM_OFFSET) + ((P2P_OFFSET,) if p2p else ())]
        ticktext += [f"rank {r}", "comm"] + (["p2p"] if p2p else [])
    flagged = trace.instrumented_steps()
    last = (P2P_OFFSET + _P2P_WIDTH / 2 + 0.1) if p2p else COMM_OFFSET + 0.4
    layout = {"yaxis.tickvals": tickvals, "yaxis.ticktext": ticktext,
              "yaxis.range": [row[ranks[-1]] + last, -0.5] if ranks else [1, -1],
              "title.text": _title(events, ranks, trace, step, flagged),
              "height": max(140 + round(70 * pitch) * max(len(ranks), 1),
                            _MARGINS + _legend_height(cols)),
              "shapes": [], "annotations": [], "xaxis.autorange": True}
    if events and step is not None:  # the step fills the width
        lo = (min(e.start for e in events) - trace.t0) * 1e3
        hi = (max(e.end for e in events) - trace.t0) * 1e3
        pad = 0.02 * max(hi - lo, 1e-3)
        layout.update({"xaxis.autorange": False, "xaxis.range": [lo - pad, hi + pad]})
    for s, what in sorted(flagged.items()):
        span = [e for e in drawn if e.step == s]
        if not span or (step is not None and step != s):
            continue
        x0 = (min(e.start for e in span) - trace.t0) * 1e3
        x1 = (max(e.end for e in span) - trace.t0) * 1e3
        layout["shapes"].append(dict(type="rect", xref="x", yref="paper", x0=x0, x1=x1, y0=0,
                                     y1=1, fillcolor=S.INSTRUMENTED_COLOR, opacity=0.35,
                                     line_width=0, layer="below"))
        layout["annotations"].append(dict(
            x=(x0 + x1) / 2, xref="x", y=1.0, yref="paper", yanchor="bottom", showarrow=False,
            text=f"step {s}: {what}-tracked, slower by design", font=dict(size=11,
                                                                            color=S.MUTED)))
    return cols, layout


def _alternating(col) -> list:
    """Opacity per bar: calls in one lane alternate 1 / :data:`_ALT_OPACITY` by start."""
    out = [1.0] * len(col["x"])
    by_lane: dict = {}
    for i, (y, b) in enumerate(zip(col["y"], col["base"])):
        by_lane.setdefault(y, []).append((b, i))
    for calls in by_lane.values():
        for k, (_b, i) in enumerate(sorted(calls)):
            out[i] = 1.0 if k % 2 == 0 else _ALT_OPACITY
    return out


def _title(events, ranks, trace, step, flagged) -> str:
    if not events:
        return "no events recorded"
    lo, hi = min(e.start for e in events), max(e.end for e in events)
    length = (hi - lo) * 1e3
    if step is None:
        steps = sorted({e.step for e in events if e.step >= 0})
        what = ("the whole run" if not steps else "1 step" if len(steps) == 1
                else f"all {len(steps)} steps")
        note = ""
        if flagged:
            names = ", ".join(f"step {s} ({w}-tracked)" for s, w in sorted(flagged.items()))
            note = f"<br><sup>shaded: {names}: instrumented, slower by design</sup>"
        return f"{what}: {length:.1f} ms, {len(events)} spans on {_ranks(ranks)}{note}"
    start = (lo - trace.t0) * 1e3
    note = (f"<br><sup>step {step} ran {flagged[step]}-tracked: slower by design, not a "
            "step time</sup>" if step in flagged else "")
    return (f"step {step}: {length:.1f} ms long (from {start:.1f} ms), {len(events)} spans "
            f"on {_ranks(ranks)}{note}")


def _ranks(ranks) -> str:
    return "1 rank" if len(ranks) == 1 else f"{len(ranks)} ranks"


def _base_layout() -> dict:
    return dict(barmode="overlay", bargap=0, template="plotly_white",
                xaxis=dict(title="ms from the first event", zeroline=False),
                yaxis=dict(tickmode="array", tickvals=[], ticktext=[], range=[1, -1],
                           zeroline=False, showgrid=False),
                legend=dict(groupclick="toggleitem"),
                margin=dict(l=70, r=20, t=_MARGINS - 40, b=40),
                title=dict(text="no events recorded", font_size=14), height=210,
                hoverlabel=dict(align="left"), uniformtext=dict(minsize=8, mode="hide"))
