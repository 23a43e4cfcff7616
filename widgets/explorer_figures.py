"""Figures and history rows of the :class:`~labkit_widgets.explorer.Explorer`.

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

import html
from typing import Optional

import plotly.graph_objects as go

from . import _style as S

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


# --------------------------------------------------------------------------- words
def layout_string(cfg) -> str:
    """The layout in a few characters: ``dp2·pp2·Z3·1f1b M4`` (degrees above 1 — dp always
    —, ZeRO stage and HSDP replicas, the schedule with its microbatches per flush and, when
    above one, virtual stages)."""
    p = cfg.parallel
    parts = [f"dp{p.dp}"] + [f"{a}{getattr(p, a)}" for a in ("pp", "tp", "cp", "ep")
                             if getattr(p, a) > 1]
    if cfg.zero_stage:
        parts.append(f"Z{cfg.zero_stage}")
    if cfg.zero_stage and cfg.hsdp_replicas > 1:
        parts.append(f"HSDP{cfg.hsdp_replicas}")
    out = "·".join(parts)
    if p.pp > 1:
        out += f"·{cfg.schedule} M{cfg.flush_microbatches}"
        if cfg.stages_per_rank > 1:
            out += f" V{cfg.stages_per_rank}"
    return out


def knobs_string(cfg) -> str:
    """The other knobs that differ from their defaults, briefly (``"µb2 full bf16"``);
    a lab model other than ``tiny`` first, so two models' runs of one layout differ."""
    out = []
    if cfg.model != "tiny":
        out.append(cfg.model if isinstance(cfg.model, str) else (cfg.model.name or "custom"))
    if cfg.accum_steps > 1 and cfg.parallel.pp == 1:
        out.append(f"µb{cfg.micro}")
    if cfg.zero_stage == 3 and not cfg.prefetch:
        out.append("no-prefetch")
    if cfg.zero_stage == 0 and cfg.dp_mode != "ddp":
        out.append(cfg.dp_mode)
    if cfg.zero_stage == 0 and cfg.dp_mode == "ddp" and cfg.bucket_mb != 25.0:
        out.append(f"bucket {cfg.bucket_mb:g}")
    if cfg.checkpoint != "none":
        out.append(f"ckpt {cfg.checkpoint}")
    if cfg.precision != "fp32":
        out.append(cfg.precision)
    if cfg.parallel.tp > 1 and cfg.sequence_parallel:
        out.append("SP")
    if cfg.parallel.cp > 1:
        out.append(cfg.cp_method + ("" if cfg.cp_zigzag else " no-zigzag"))
    return " ".join(out)


def describe(cfg) -> str:
    """The configuration in one line (a history row's tooltip): the model, the degrees and
    every field that differs from its default."""
    from .explorer_controls import DEFAULTS

    skip = {"model", "parallel", "timeout_s", "return_state", "return_grads"}
    fields = [f"{k}={getattr(cfg, k)!r}" for k in cfg.__dataclass_fields__
              if k not in skip and getattr(cfg, k) != getattr(DEFAULTS, k)]
    p = cfg.parallel
    return (f"{cfg.model_config.name} ({cfg.model_config.n_layers} layers), dp={p.dp} "
            f"tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} " + " ".join(fields))


def _f(spec: str):
    return lambda v: S.fmt(v, spec)


#: (header, key, formatter) — compact enough for a 1280 px window with the file browser open
HISTORY_COLUMNS = [
    ("#", "run", str), ("layout", "layout", str), ("step ms", "step_ms", _f(".1f")),
    ("MFU %", "mfu_pct", _f(".1f")), ("peak MiB", "peak_mib", _f(".2f")),
    ("bytes/step", "comm_bytes", S.fmt_bytes), ("bubble %", "bubble_pct", _f(".1f")),
    ("loss", "loss", _f(".4f")), ("latency s", "latency_s", _f(".2f"))]


def summarize(result, metrics: list, pipe: Optional[dict] = None) -> dict:
    """One history row: ``layout``, ``knobs``, ``step_ms`` (the slowest rank), ``mfu_pct`` /
    ``hfu_pct`` (mean over ranks), ``peak_mib`` (the largest rank's peak), ``comm_bytes``
    (the most any rank sent in a step), ``bubble_pct`` (with a pipeline), ``loss`` (the
    global loss of the timed step), ``wall_s``; the peak MFU divides by: ``peak_gflops``
    (per rank), ``peak_age_s`` (the oldest rank's), ``peak_conditions`` and ``peak_source``
    (rank 0's), and ``mfu_error`` (the first rank's, when a step ran faster than the peak).
    ``metrics`` are the per-rank dicts the figures show (memory possibly from an earlier run
    of the same configuration)."""
    cfg = result.config
    mean = lambda key: S.mean(m.get(key) for m in metrics)  # noqa: E731
    pct = lambda v: None if v is None else 100 * v  # noqa: E731
    peaks = [(m.get("memory") or {}).get("peak_total") for m in metrics]
    return {"layout": layout_string(cfg), "knobs": knobs_string(cfg),
            "step_ms": 1e3 * max((m.get("step_time_s") or 0.0 for m in metrics), default=0.0),
            "mfu_pct": pct(mean("mfu")), "hfu_pct": pct(mean("hfu")),
            "peak_mib": None if None in peaks or not peaks else S.mib(max(peaks)),
            "comm_bytes": max((m.get("comm_bytes_per_step") or 0.0 for m in metrics),
                              default=0.0),
            "bubble_pct": None if pipe is None else 100 * pipe["summary"]["bubble"],
            "loss": _timed_loss(result),
            "wall_s": result.wall_s, **_peak(metrics)}


def _peak(metrics: list) -> dict:
    first = metrics[0] if metrics else {}
    ages = [m.get("peak_age_s") for m in metrics if m.get("peak_age_s") is not None]
    peak = first.get("peak_flops")
    return {"peak_gflops": None if peak is None else peak / 1e9,
            "peak_age_s": max(ages) if ages else None,
            "peak_conditions": first.get("peak_conditions"),
            "peak_source": first.get("peak_source"),
            "mfu_error": next((m["mfu_error"] for m in metrics if m.get("mfu_error")), None)}


def peak_line(row: dict) -> str:
    """Where the peak came from, short enough for the gauge's title, e.g. ``"peak 41.5
    GFLOP/s/rank · 3 min old · load 2.1"``; ``"… (datasheet)"`` for a GPU; empty when no
    peak was read."""
    g = row.get("peak_gflops")
    if g is None:
        return ""
    if row.get("peak_source") == "datasheet":
        return f"peak {g:.4g} GFLOP/s/rank (datasheet)"
    age, cond = row.get("peak_age_s"), row.get("peak_conditions") or {}
    parts = [f"peak {g:.3g} GFLOP/s/rank"]
    if age is not None:
        parts.append(f"{age:.0f} s old" if age < 120 else f"{age / 60:.0f} min old")
    if cond.get("loadavg_1m") is not None:
        parts.append(f"load {cond['loadavg_1m']:.1f}")
    return " · ".join(parts)


def _timed_loss(result) -> Optional[float]:
    """The global loss of the timed step (the second; the only one of a one-step run): the
    same step whether or not the run added a memory-tracked step after it."""
    losses = list(getattr(result, "losses", None) or [])
    return losses[min(1, len(losses) - 1)] if losses else None


def history_html(rows: list) -> str:
    """The history table: one row per run, the latest in bold, the knobs beside the
    layout in grey, the whole configuration as each row's tooltip."""
    head = "".join(f"<th style='padding:1px 6px;text-align:right'>{html.escape(h)}</th>"
                   for h, _k, _f in HISTORY_COLUMNS)
    body = []
    for i, row in enumerate(rows):
        bold = "font-weight:bold;" if i == len(rows) - 1 else ""
        cells = []
        for _h, key, fmt in HISTORY_COLUMNS:
            text = html.escape(fmt(row.get(key)))
            if key == "layout" and row.get("knobs"):
                text += f" <span style='color:{S.MUTED}'>{html.escape(row['knobs'])}</span>"
            align = "left" if key == "layout" else "right"
            cells.append(f"<td style='padding:1px 6px;text-align:{align}'>{text}</td>")
        body.append(f"<tr style='{bold}' title='{html.escape(row.get('config', ''))}'>"
                    f"{''.join(cells)}</tr>")
    if not body:
        body.append(f"<tr><td colspan='{len(HISTORY_COLUMNS)}' style='color:{S.MUTED}'>"
                    "no runs yet</td></tr>")
    # no height limit: a scroll box hid the older runs behind a scrollbar the browser may
    # not draw; the table is the explorer's last element, so growing pushes nothing down
    return ("<div style='max-width:100%'>"
            "<table class='labkit-history' style='border-collapse:collapse;font-size:12px'>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(reversed(body))}</tbody>"
            "</table></div>")


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
