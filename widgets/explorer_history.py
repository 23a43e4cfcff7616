"""The :class:`~labkit_widgets.explorer.Explorer`'s words for a run: the layout in a few
characters, the knobs that differ from their defaults, the configuration in one line, and
the history table's rows (one per run: step time, MFU, peak memory, bytes, bubble, loss,
and where the peak FLOP/s the MFU divides by came from). Pure functions of a ``RunResult``
and its per-rank ``metrics``; importable from :mod:`labkit_widgets.explorer_figures` as
before.
"""
from __future__ import annotations

import html
from typing import Optional

from . import _style as S

__all__ = ["layout_string", "knobs_string", "describe", "HISTORY_COLUMNS", "summarize",
           "history_html", "peak_line"]


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
