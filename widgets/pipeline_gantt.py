"""PipelineView's data: measured and simulated F/B/W spans as Gantt bars, the drawn flush's
length and idle, and the status table (:class:`labkit_widgets.pipeline_view.PipelineView`
draws them). Times in milliseconds unless a scale is given.
"""
from __future__ import annotations

import html
from typing import Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.parallel.pipeline.actions import Action
from labkit.parallel.pipeline.bubble import BubbleReport
from labkit.parallel.pipeline.simulate import Span

from . import _style as S

KINDS = ("F", "B", "W", "BW")
PATTERNS = {"F": "", "B": "/", "W": "x", "BW": "."}
PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2",
           "#FF9DA6", "#9D755D", "#BAB0AC", "#17BECF", "#8C564B", "#BCBD22", "#7F7F7F",
           "#1F77B4", "#D62728"]
IDLE = "rgba(150,150,150,0.25)"
KIND_SWATCH = "#8C8C8C"  # the kind legend's neutral grey: the pattern is the key
KIND_NAMES = {"idle": "idle", "F": "F forward", "B": "B input-grad", "W": "W weight-grad",
              "BW": "BW full backward"}
N_DATA = 2 * (1 + len(KINDS))  # bar traces: (idle + kinds) per panel; legend keys follow
FRAMES = 40


def pick_flush(trace, step: Optional[int] = None,
               flush: Optional[int] = None) -> Optional[tuple]:
    """Which flush :func:`measured_spans` draws: ``(step, flush, flushes)``, ``flushes`` being
    how many flushes that step ran (several with gradient accumulation across flushes,
    :attr:`labkit.config.RunConfig.flushes`); ``None`` when the trace holds no pipeline
    spans. Default: the last flush of the last step not run under the memory tracker (that
    step's spans stretch several-fold), i.e. the last flush measured."""
    events = trace.events if hasattr(trace, "events") else trace
    ev = [e for e in events if e.cat == "compute" and e.name in KINDS and "stage" in e.args]
    if step is None and any("instrumented" not in e.args for e in ev):
        ev = [e for e in ev if "instrumented" not in e.args]
    if not ev:
        return None
    step = max(e.step for e in ev) if step is None else step
    ran = sorted({e.args.get("flush", 0) for e in ev if e.step == step})
    if not ran:
        return None
    return step, (ran[-1] if flush is None else flush), len(ran)


def flush_name(which: Optional[tuple]) -> str:
    """The drawn flush as the measured panel's title names it, from :func:`pick_flush`'s
    ``(step, flush, flushes)``: ``"last flush (step 3, flush 2 of 2)"``
    (flushes counted from 1, steps as the trace numbers them); ``"one flush"`` when not
    known."""
    if which is None:
        return "one flush"
    step, flush, n = which
    # short: the title also carries the flush's length and every rank's idle, and a
    # 4-rank title must fit a notebook cell at 1280 px
    where = f"step {step}, flush {flush + 1} of {n}" if n > 1 else f"step {step}"
    return (f"last flush ({where})" if flush == n - 1 else
            f"flush {flush + 1} of {n}, step {step}")


def measured_spans(trace, step: Optional[int] = None, flush: Optional[int] = None) -> list:
    """The compute spans of one flush (default: the last flush measured,
    :func:`pick_flush`) as simulator :class:`~labkit.parallel.pipeline.simulate.Span`\\ s,
    seconds from the flush's start. ``trace``: a Trace or a list of events."""
    which = pick_flush(trace, step, flush)
    if which is None:
        return []
    step, flush, _ = which
    events = trace.events if hasattr(trace, "events") else trace
    ev = [e for e in events if e.cat == "compute" and e.name in KINDS and "stage" in e.args
          and e.step == step and e.args.get("flush", 0) == flush]
    if not ev:
        return []
    t0 = min(e.start for e in ev)
    return [Span(e.rank, Action(e.args["stage"], e.name, e.args["microbatch"]),
                 e.start - t0, e.end - t0) for e in ev]


def gantt_data(spans: list, pp: int, until: Optional[float] = None, scale: float = 1e3) -> dict:
    """Bar columns for :class:`PipelineView` (pure data, cheap to test).

    Returns ``{kind: {x, base, y, color, text}}`` for each kind in :data:`KINDS`, plus
    ``"idle"`` (the gaps between a rank's spans up to the last end). Times are multiplied
    by ``scale`` (ms by default); spans starting after ``until`` are left out and those
    running across it are cut there (the animation).
    """
    end = max((sp.end for sp in spans), default=0.0)
    cut = end if until is None else until
    out = {k: {"x": [], "base": [], "y": [], "color": [], "text": []} for k in KINDS + ("idle",)}
    for sp in sorted(spans, key=lambda s: s.start):
        if sp.start > cut:
            continue
        col = out[sp.action.kind]
        col["base"].append(sp.start * scale)
        col["x"].append((min(sp.end, cut) - sp.start) * scale)
        col["y"].append(f"rank {sp.rank}")
        col["color"].append(PALETTE[sp.action.microbatch % len(PALETTE)])
        col["text"].append(str(sp.action))
    for r in range(pp):
        t = 0.0
        for sp in sorted((s for s in spans if s.rank == r), key=lambda s: s.start) + [None]:
            nxt = min(end if sp is None else sp.start, cut)
            if nxt > t:
                idle = out["idle"]
                idle["base"].append(t * scale)
                idle["x"].append((nxt - t) * scale)
                idle["y"].append(f"rank {r}")
                idle["color"].append(IDLE)
                idle["text"].append(f"idle {(nxt - t) * scale:.2f}"
                                    + (" ms" if scale == 1e3 else " units"))
            if sp is not None:
                t = max(t, sp.end)
    return out


def drawn_flush(spans: list, pp: int, scale: float = 1e3, unit: str = "ms",
                name: str = "one flush") -> str:
    """What the measured panel shows, in the panel's title: ``"last flush (step 3):
    461.2 ms, idle per rank 120.3, 95.1 ms"`` — this one flush's length and each
    rank's idle (its gaps up to the flush's end, as :func:`gantt_data` draws them);
    ``name`` says which flush ``spans`` are (:func:`flush_name`). The status table's
    idle and flush time are means over all measured flushes, so they differ from it."""
    cols = gantt_data(spans, pp, scale=scale)["idle"]
    idle = [sum(x for x, y in zip(cols["x"], cols["y"]) if y == f"rank {r}") for r in range(pp)]
    end = max((sp.end for sp in spans), default=0.0) * scale
    return (f"{name}: {end:.1f} {unit}, idle per rank "
            + ", ".join(f"{i:.1f}" for i in idle) + f" {unit}")


def flush_bubbles(report: BubbleReport) -> list:
    """The measured bubble (idle/total) of each flush of ``report``, in run order."""
    p = len(report.busy)
    return [sum(w - b for b in busy) / (p * w) if w else 0.0 for w, busy in report.per_flush]


def status_table(report: BubbleReport, metrics: Optional[list] = None) -> str:
    """The status as HTML: bubble and idle per rank measured (with the spread over flushes),
    simulated on this machine, and with unit costs; the measured terms; memory."""
    pct = lambda b: f"{100 * b:.1f} %"  # noqa: E731
    ms = lambda v: ", ".join(f"{1e3 * x:.1f}" for x in v)  # noqa: E731
    per = flush_bubbles(report)
    # the table's times are means over the measured flushes; the drawn flush is one of them
    over = (f" over {report.flushes} flushes" if report.flushes > 1 else "")
    per_flush = f" (mean{over})"
    spread = (f"{len(per)} flushes: {pct(min(per))} – {pct(max(per))}" if len(per) > 1 else
              "one flush: no spread; run more steps to see how much a reading moves")
    rows = [("measured", pct(report.bubble), spread, ms(report.idle)),
            ("simulated on this machine", pct(report.predicted.bubble),
             f"gap {report.gap_pp:+.1f} pp", ms(report.predicted.idle)),
            ("simulated, unit costs (lecture)", pct(report.unit.bubble), "", "")]
    td = "padding:1px 12px 1px 0;text-align:left"
    body = "".join(f"<tr><td style='{td}'>{html.escape(a)}</td><td style='{td};"
                   f"text-align:right;font-weight:bold'>{html.escape(b)}</td><td style='{td};"
                   f"color:{S.MUTED}'>{html.escape(c)}</td><td style='{td}'>"
                   f"{html.escape(d)}</td></tr>" for a, b, c, d in rows)
    head = (f"<tr><th style='{td}'></th><th style='{td};text-align:right'>bubble</th>"
            f"<th style='{td}'></th><th style='{td}'>idle per rank, ms{per_flush}</th></tr>")
    terms = [f"message {1e3 * report.comm_s:.2f} ms/hop"]
    if report.executor_s:
        terms.append(f"executor {1e3 * report.executor_s:.2f} ms/action")
    lines = ["simulated with the measured stage costs, " + ", ".join(terms)]
    if report.flushes > 1:  # the panel title's idle and the table's differ: say why
        lines.append(f"the measured panel's title is the drawn flush alone (the last); this "
                     f"table's bubble and idle per rank are the mean over the "
                     f"{report.flushes} measured flushes, so the two idles differ by the "
                     "flushes' spread")
    if report.shared is not None:
        lines.append(f"the {len(report.busy)} ranks shared {report.cores:.2f} cores: a flush "
                     f"took {1e3 * report.window:.1f} ms on average{over} "
                     f"({1e3 * report.shared.makespan:.1f} "
                     "ms with processor sharing), stretched spans count as busy")
    if metrics:
        mem = ", ".join(S.fmt_bytes(m.get("peak_activation_bytes")) for m in metrics)
        lines.append(f"peak activations per rank: {mem}; stage-microbatches in flight "
                     f"{[m.get('peak_inflight') for m in metrics]} (simulated "
                     f"{report.predicted.peak_inflight})")
    notes = "".join(f"<div style='color:{S.MUTED}'>{html.escape(t)}</div>" for t in lines)
    return (f"<div class='labkit-status labkit-status-ok' style='font-size:12px;"
            f"color:#222'><table style='border-collapse:collapse'>{head}{body}</table>"
            f"{notes}</div>")


#: below this ratio of their lengths, measured and simulated panels get their own time axes
SHARED_AXIS_RATIO = 0.5


#: the pattern of each kind's data bars, where it differs from the legend key's: the
#: default dots (solidity 0.3, half-opaque white) sit under a ``BW`` bar's label and break
#: its letters up, so the bars get smaller, fainter dots; the 12 px legend key keeps the
#: default dots, which sparser ones would leave looking like a plain ``F`` swatch
BAR_PATTERN = {"BW": dict(solidity=0.12, fgopacity=0.3)}


def _base_figure() -> go.Figure:
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("measured (trace)", "simulated on this machine"))
    for row in (1, 2):
        for kind in ("idle",) + KINDS:
            # cliponaxis off: a label is drawn inside its bar and every bar lies inside the
            # axis range (the view sets the range to the panel's last end), so nothing needs
            # clipping; with clipping on, a label a browser renders a few pixels wider than
            # plotly measured it ("idle 16.98 ms" on a bar ending at the right edge) lost
            # its letters at the plot area's edge
            fig.add_trace(go.Bar(
                name=kind, orientation="h", x=[], y=[], base=[], text=[], showlegend=False,
                textposition="inside", insidetextanchor="middle", textangle=0,
                cliponaxis=False, hovertemplate="%{text}<extra></extra>",
                marker=dict(color=IDLE if kind == "idle" else "#999", line_width=0,
                            pattern=dict(shape=PATTERNS.get(kind, ""),
                                         **BAR_PATTERN.get(kind, {})))),
                row=row, col=1)
    for kind in ("idle",) + KINDS:  # legend keys only: the kinds, by pattern
        fig.add_trace(go.Bar(name=KIND_NAMES[kind], orientation="h", x=[None], y=[None],
                             legend="legend", hoverinfo="skip",
                             marker=dict(color=IDLE if kind == "idle" else KIND_SWATCH,
                                         pattern_shape=PATTERNS.get(kind, ""))), row=1, col=1)
    for i, colour in enumerate(PALETTE):  # legend keys only: the microbatch colours
        fig.add_trace(go.Bar(name=str(i), orientation="h", x=[None], y=[None],
                             legend="legend2", hoverinfo="skip", visible=i < 4,
                             marker=dict(color=colour)), row=1, col=1)
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="ms", row=2, col=1)
    fig.update_layout(barmode="overlay", height=560, margin=dict(l=60, r=100, t=100, b=40),
                      title=dict(text="pipeline", y=0.98),
                      uniformtext=dict(minsize=9, mode="hide"),  # hide what cannot fit
                      legend=dict(orientation="h", x=0, y=1.14, xanchor="left",
                                  title_text="kind", font_size=11),
                      legend2=dict(x=1.01, y=1, xanchor="left", title_text="microbatch",
                                   font_size=11, tracegroupgap=0))
    return fig
