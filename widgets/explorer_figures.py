"""Controls, figures and history rows of the :class:`~labkit_widgets.explorer.Explorer`.

Pure builders and painters: ``*_figure()`` returns an empty ``go.Figure`` with the traces
the painter fills; ``draw_*(fig, ...)`` swaps their data in place (call it inside the
widget's ``batch_update()``). They read the per-rank ``metrics`` dicts of
:func:`labkit.train.run` or :func:`labkit.parallel.zero_jobs.zero_train` (bytes, seconds)
and draw MiB and milliseconds.

* memory: peak bytes per rank by category, measured beside predicted (hatched), stacked;
  for ZeRO-3 the predicted "other" is the working set of gathered units.
* MFU: a gauge with the lecture's bars (30 % good, 40 % excellent) and the step time.
* communication: bytes per collective per rank per step (all-reduce for DP; reduce-scatter,
  all-gather and HSDP's all-reduce for ZeRO), measured beside the formula (hatched).

Pipeline runs (``pp > 1``) are painted by :mod:`labkit_widgets.explorer_pipeline`; the
history table has their pp, schedule, microbatches and bubble (measured / simulated).
"""
from __future__ import annotations

from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go

from . import _style as S

__all__ = ["dp_controls", "HISTORY_COLUMNS", "summarize", "describe", "memory_figure",
           "draw_memory", "mfu_figure",
           "draw_mfu", "comm_figure", "draw_comm", "COMM_OPS"]

#: collectives in the order the communication figure lists them
COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _pct(v) -> str:
    return S.fmt(v, ".1f")


HISTORY_COLUMNS = [
    ("#", "run", str), ("dp", "dp", str), ("micro", "micro_batch", str),
    ("bucket MiB", "bucket_mb", lambda v: S.fmt(v, "g")), ("mode", "dp_mode", str),
    ("recompute", "checkpoint", str), ("ZeRO", "zero_stage", str),
    ("prefetch", "prefetch", lambda v: "–" if v is None else ("on" if v else "off")),
    ("replicas", "replicas", str), ("AG hidden %", "overlap_pct", _pct), ("pp", "pp", str),
    ("schedule", "schedule", str), ("M", "microbatches", lambda v: S.fmt(v, "d")),
    ("bubble % meas", "bubble_pct", _pct), ("bubble % sim", "bubble_sim_pct", _pct),
    ("step ms", "step_ms", lambda v: S.fmt(v, ".1f")), ("MFU %", "mfu_pct", _pct),
    ("HFU %", "hfu_pct", _pct),
    ("peak MiB", "peak_mib", lambda v: S.fmt(v, ".2f")), ("bytes/step", "comm_bytes", S.fmt_bytes),
    ("loss", "loss", lambda v: S.fmt(v, ".4f")), ("run s", "wall_s", lambda v: S.fmt(v, ".2f")),
    ("latency s", "latency_s", lambda v: S.fmt(v, ".2f"))]


def summarize(result) -> dict:
    """One history row from a ``RunResult`` of the train or the ZeRO job (missing metrics
    read as ``None``). ZeRO rows carry ``zero_stage``, ``prefetch`` (stage 3 only, else
    ``None``), ``replicas`` and ``overlap_pct``: the mean over ranks of the all-gather time
    hidden under compute (stage 3), in percent; DP-only knobs read ``"–"`` there."""
    ms, cfg = result.metrics, result.config
    run = getattr(cfg, "run", cfg)
    stage = getattr(cfg, "zero_stage", None)
    zero = stage is not None
    last = [o["losses"][-1] for o in result.outputs if isinstance(o, dict) and o.get("losses")]
    mfus, hfus = [m.get("mfu") for m in ms], [m.get("hfu") for m in ms]
    overlap = S.mean((m.get("overlap") or {}).get("total") for m in ms)
    return {"dp": run.parallel.dp, "micro_batch": run.micro,
            "bucket_mb": None if zero and stage > 0 else run.bucket_mb,
            "dp_mode": "–" if zero else run.dp_mode,
            "checkpoint": getattr(run, "checkpoint", "none"),
            "zero_stage": stage if zero else 0,
            "prefetch": cfg.prefetch if zero and stage == 3 else None,
            "replicas": cfg.hsdp_replicas if zero else 1,
            "overlap_pct": None if overlap is None else 100 * overlap, "pp": 1,
            "schedule": "–", "microbatches": None, "bubble_pct": None, "bubble_sim_pct": None,
            "hfu_pct": None if S.mean(hfus) is None else 100 * S.mean(hfus),
            "step_ms": max((m.get("step_time_s") or 0.0 for m in ms), default=0.0) * 1e3,
            "mfu_pct": None if S.mean(mfus) is None else 100 * S.mean(mfus),
            "peak_mib": S.mib(max(((m.get("memory") or {}).get("peak_total") or 0 for m in ms),
                                  default=0)),
            "comm_bytes": max((m.get("comm_bytes_per_step") or 0.0 for m in ms), default=0.0),
            "loss": S.mean(last), "wall_s": result.wall_s}


# --------------------------------------------------------------------------- controls
#: the tiny model's parameters are ~0.4 MB, so buckets below 1 MiB are where things happen
BUCKET_OPTIONS_MB = (0.001, 0.01, 0.1, 1.0, 25.0)
DP_MODES = ("ddp", "naive", "torch")
#: activation-checkpointing policies offered (``every`` needs a segment size: use ``set``)
CHECKPOINT_OPTIONS = ("none", "full", "selective")


def dp_controls(ws: int, base, opts: dict) -> dict:
    """The data-parallel and ZeRO widgets for a cluster of ``ws`` ranks, starting from the
    ``RunConfig`` ``base`` (micro-batch and HSDP options are filled in by the explorer)."""
    dps = S.divisors(ws)
    buckets = sorted(set(BUCKET_OPTIONS_MB) | {float(base.bucket_mb)})
    return {
        "dp": W.SelectionSlider(options=dps, value=base.parallel.dp if base.parallel.dp
                                in dps else ws, description="dp", **opts),
        "micro_batch": W.SelectionSlider(options=[1], value=1, description="micro-batch",
                                         **opts),
        "bucket_mb": W.SelectionSlider(options=buckets, value=float(base.bucket_mb),
                                       description="bucket MiB", **opts),
        "dp_mode": W.ToggleButtons(options=list(DP_MODES), value=base.dp_mode
                                   if base.dp_mode in DP_MODES else "ddp",
                                   description="sync", style={"button_width": "60px"}),
        "checkpoint": W.ToggleButtons(
            options=sorted(set(CHECKPOINT_OPTIONS) | {base.checkpoint},
                           key=("none", "full", "every", "selective").index),
            value=base.checkpoint, description="recompute",
            tooltips=["store every activation", "recompute each block in backward",
                      "recompute attention and element-wise ops, keep matmul outputs"],
            style={"button_width": "72px"}),
        "zero_stage": W.ToggleButtons(
            options=[0, 1, 2, 3], value=0, description="ZeRO",
            tooltips=["plain data parallelism (16Ψ per rank)", "shard optimizer state",
                      "+ shard gradients", "+ shard parameters (FSDP)"],
            style={"button_width": "40px"}),
        "prefetch": W.Checkbox(value=True, description="prefetch (stage 3)", indent=False),
        "hsdp_replicas": W.Dropdown(options=[("1 (off)", 1)], value=1,
                                    description="HSDP M", layout=W.Layout(width="190px"))}


# --------------------------------------------------------------------------- memory
def memory_figure() -> go.Figure:
    """Stacked bars, one trace per category of :data:`_style.MEMORY_CATEGORIES`."""
    bars = [go.Bar(name=c, x=[[], []], y=[], marker_color=S.MEMORY_COLORS[c],
                   hovertemplate=f"{c}: %{{y:.3f}} MiB<br>%{{x}}<extra></extra>")
            for c in S.MEMORY_CATEGORIES]
    return go.Figure(bars, dict(
        barmode="stack", template="plotly_white", height=340, width=620,
        title=dict(text="peak memory per rank — measured vs predicted (hatched)", font_size=14),
        yaxis_title="MiB", margin=dict(l=60, r=10, t=50, b=60)))


def draw_memory(fig, metrics: list) -> None:
    """Per rank a measured (``memory.peak``) and a predicted (``memory_predicted``) stack,
    MiB. ZeRO-3: the predicted "other" is ``working_set.gathered_units_predicted``."""
    x0 = [f"rank {m.get('rank', r)}" for r, m in enumerate(metrics) for _ in (0, 1)]
    x1 = ["measured", "predicted"] * len(metrics)
    for tr, cat in zip(fig.data, S.MEMORY_CATEGORIES):
        ys = []
        for m in metrics:
            pred = dict(m.get("memory_predicted") or {})
            mem = m.get("memory") or {}
            gathered = (mem.get("working_set") or {}).get("gathered_units_predicted")
            if gathered is not None:
                pred["other"] = gathered
            ys += [S.mib(mem.get("peak", {}).get(cat)), S.mib(pred[cat]) if cat in pred else None]
        tr.update(x=[x0, x1], y=ys, marker_pattern_shape=["", "/"] * len(metrics))
    stage = metrics[0].get("zero_stage") if metrics else None
    what = "" if stage is None else f" · ZeRO-{stage}, K={metrics[0].get('shards')}"
    fig.layout.title.text = f"peak memory per rank — measured vs predicted (hatched){what}"


# --------------------------------------------------------------------------- MFU
def mfu_figure() -> go.Figure:
    """A 0–100 % gauge banded at the lecture's 30 % / 40 %."""
    g, e = 100 * S.MFU_GOOD, 100 * S.MFU_EXCELLENT
    return go.Figure(go.Indicator(
        mode="gauge+number+delta", value=None, number=dict(suffix=" %", valueformat=".1f"),
        delta=dict(valueformat=".1f", suffix=" pts"),
        gauge=dict(axis=dict(range=[0, 100]), bar=dict(color="#333"),
                   steps=[dict(range=[0, g], color="#F6D5D1"),
                          dict(range=[g, e], color="#FCEFC7"),
                          dict(range=[e, 100], color="#D5EFD8")],
                   threshold=dict(line=dict(color=S.OK_GREEN, width=3), value=e))),
        dict(height=340, width=330, margin=dict(l=30, r=30, t=80, b=20),
             title=dict(text="MFU", font_size=14)))


def draw_mfu(fig, row: dict, prev_pct: Optional[float], note: str = "") -> None:
    """Show ``row["mfu_pct"]`` with the change from ``prev_pct``, the step time and
    ``note`` (a last title line, e.g. a pipeline's MFU ceiling)."""
    v = row["mfu_pct"]
    rating = "n/a" if v is None else ("excellent" if v > 100 * S.MFU_EXCELLENT else
                                      "good" if v > 100 * S.MFU_GOOD else "low")
    fig.data[0].update(value=v, delta_reference=prev_pct if prev_pct is not None else v)
    fig.layout.title.text = (f"MFU ({rating}; >30 % good, >40 % excellent)<br>"
                             f"step {row['step_ms']:.1f} ms{'<br>' + note if note else ''}")


# --------------------------------------------------------------------------- comm
def comm_figure() -> go.Figure:
    """Grouped bars over (rank, collective): ``data[0]`` measured, ``data[1]`` predicted."""
    return go.Figure([
        go.Bar(name="measured (labkit.comm traces)", x=[[], []], y=[],
               marker_color=S.COMM_COLORS["all_reduce"],
               hovertemplate="%{x}: %{y:.4f} MiB/step measured<extra></extra>"),
        go.Bar(name="predicted (formula)", x=[[], []], y=[], marker_pattern_shape="/",
               marker_color=S.COMM_COLORS["all_reduce"], opacity=0.6,
               hovertemplate="%{x}: %{y:.4f} MiB/step predicted<extra></extra>")],
        dict(template="plotly_white", height=300, yaxis_title="MiB per step", barmode="group",
             title=dict(text="communication per rank per step", font_size=14),
             margin=dict(l=60, r=10, t=50, b=40), legend=dict(orientation="h", y=-0.25)))


def _comm_rows(m: dict) -> list:
    """``[(op, measured bytes, predicted bytes or None)]`` of one rank's metrics."""
    if "comm_bytes_by_op" not in m:  # the DP train job: one gradient all-reduce
        return [("all_reduce", m.get("comm_bytes_per_step"), m.get("comm_bytes_predicted"))]
    meas, pred = m.get("comm_bytes_by_op") or {}, m.get("comm_predicted_by_op") or {}
    ops = [op for op in COMM_OPS if op in meas or op in pred]
    ops += sorted((set(meas) | set(pred)) - set(ops))
    return [(op, meas.get(op, 0.0), pred.get(op)) for op in ops]


def draw_comm(fig, metrics: list, cfg) -> None:
    """Bytes per collective per rank of one steady step, measured beside predicted, MiB."""
    x0, x1, ym, yp, colors = [], [], [], [], []
    for r, m in enumerate(metrics):
        for op, meas, pred in _comm_rows(m):
            x0.append(f"rank {m.get('rank', r)}")
            x1.append(op)
            ym.append(S.mib(meas))
            yp.append(None if pred is None else S.mib(pred))
            colors.append(S.COMM_COLORS[S.comm_family(op)])
    fig.data[0].update(x=[x0, x1], y=ym, marker_color=colors)
    fig.data[1].update(x=[x0, x1], y=yp, marker_color=colors)
    m0 = metrics[0] if metrics else {}
    run = getattr(cfg, "run", cfg)
    params = f"Ψ = {S.fmt(m0.get('n_params'), ',')} params"
    if "comm_bytes_by_op" in m0:
        stage, k = m0.get("zero_stage"), m0.get("shards")
        factor = {0: "2Ψ", 1: "2Ψ", 2: "2Ψ", 3: "3Ψ"}.get(stage, "?")
        fig.layout.title.text = (
            f"bytes per collective per rank per step — ZeRO-{stage}, K={k} × M="
            f"{m0.get('replicas')}, {params}; lecture {factor}·(K−1)/K·bytes = "
            f"{S.fmt_bytes(m0.get('comm_bytes_predicted'))}")
    else:
        fig.layout.title.text = (f"all-reduce per rank per step — dp={run.parallel.dp}, "
                                 f"{run.dp_mode}, {params}; 2(N−1)/N·Ψ·bytes")


def describe(cfg) -> str:
    """One line naming a ``RunConfig``, ``ZeroConfig`` or ``PipelineConfig`` (the status
    line's words)."""
    if hasattr(cfg, "schedule"):
        return (f"pp={cfg.pp} {cfg.schedule} M={cfg.microbatches} V={cfg.stages_per_rank} "
                f"({cfg.model_config.n_layers} layers; dp/ZeRO off: no N-D composition yet)")
    run = getattr(cfg, "run", cfg)
    if run is not cfg:  # a ZeroConfig
        pf = f" prefetch={'on' if cfg.prefetch else 'off'}" if cfg.zero_stage == 3 else ""
        hsdp = f" HSDP {cfg.hsdp_replicas}×{cfg.shards}" if cfg.hsdp_replicas > 1 else ""
        return f"dp={run.parallel.dp} micro={run.micro} ZeRO-{cfg.zero_stage}{pf}{hsdp}"
    ckpt = "" if cfg.checkpoint == "none" else f" recompute={cfg.checkpoint}"
    return (f"dp={cfg.parallel.dp} micro={cfg.micro} bucket={cfg.bucket_mb:g} MiB "
            f"mode={cfg.dp_mode}{ckpt}")
