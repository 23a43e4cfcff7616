"""The :class:`~labkit_widgets.explorer.Explorer`'s pipeline-parallel knobs and figures.

``pp`` (a divisor of the cluster's world size; 1 = off), the microbatch count ``M`` (a
divisor of the global batch) and the schedule. With ``pp > 1`` the explorer runs
:func:`labkit.parallel.pipeline.lab.pipeline_train_mfu` (``pipeline_train`` plus FLOPs and
MFU) on a :class:`~labkit.parallel.pipeline.config.PipelineConfig` from
:func:`~labkit.parallel.pipeline.lab.lab_config` (a model shallower than ``pp · V`` stages
gets one layer per stage) and draws, from :func:`~labkit.parallel.pipeline.lab.
pipeline_report`:

* memory per rank: activations measured (the peak saved for backward), model state from
  the rank's parameter count (4/4/8 B, hatched);
* the bubble (idle / total) measured from the trace beside the simulator, over all ranks
  and per rank;
* point-to-point bytes per rank per step, measured (activations forward, gradients back,
  the tied-embedding gradient).

Data and ZeRO parallelism do not compose with it yet: :func:`compose` turns them off when
``pp`` goes above 1 and refuses an explicit combination.
"""
from __future__ import annotations

import ipywidgets as W
import plotly.graph_objects as go

from . import _style as S

__all__ = ["PP_CONTROLS", "SCHEDULE_OPTIONS", "OFF", "make_controls", "microbatch_options",
           "compose", "plan", "report", "summarize", "draw", "mfu_note", "bubble_figure",
           "draw_bubble"]

PP_CONTROLS = ("pp", "microbatches", "schedule")
#: schedules offered; ``interleaved`` and ``zb-v`` run two stages per rank
SCHEDULE_OPTIONS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
#: what ``pp > 1`` needs of the data-parallel / ZeRO controls (no N-D composition yet)
OFF = {"dp": 1, "zero_stage": 0, "hsdp_replicas": 1}


def microbatch_options(global_batch: int) -> list:
    """Microbatch counts that split the global batch (one flush per step)."""
    return S.divisors(global_batch)


def make_controls(world_size: int, global_batch: int, opts: dict) -> dict:
    """``pp`` slider, ``microbatches`` slider and ``schedule`` dropdown (1F1B by default)."""
    ms = microbatch_options(global_batch)
    return {"pp": W.SelectionSlider(options=S.divisors(world_size), value=1,
                                    description="pp", **opts),
            "microbatches": W.SelectionSlider(options=ms, value=max(m for m in ms if m <= 4),
                                              description="µbatches M", **opts),
            "schedule": W.Dropdown(options=list(SCHEDULE_OPTIONS), value="1f1b",
                                   description="schedule", layout=W.Layout(width="190px"))}


def compose(vals: dict, explicit: dict) -> None:
    """With ``vals["pp"] > 1`` set dp 1, ZeRO 0 and HSDP off in ``vals``; raise
    ``ValueError`` if ``explicit`` (the caller's own changes) asks for any of them."""
    if vals["pp"] == 1:
        return
    asked = [f"{k}={explicit[k]}" for k, off in OFF.items() if explicit.get(k, off) != off]
    if asked:
        raise ValueError(f"N-D composition is not available yet: pp={vals['pp']} with "
                         f"{', '.join(asked)}; set pp=1 for data parallelism / ZeRO")
    vals.update(OFF)


def plan(run, pp: int, microbatches: int, schedule: str, zero: dict) -> tuple:
    """``(job, PipelineConfig)`` for a ``RunConfig`` ``run`` and the pipeline knobs.

    Raises:
        ValueError: data parallelism or ZeRO still on (no N-D composition yet).
    """
    on = {k: v for k, v in {"dp": run.parallel.dp, **zero}.items() if k in OFF and v != OFF[k]}
    if on:
        raise ValueError(f"N-D composition is not available yet: pp={pp} with "
                         f"{', '.join(f'{k}={v}' for k, v in on.items())}")
    from labkit.parallel.pipeline.lab import lab_config, pipeline_train_mfu

    return pipeline_train_mfu, lab_config(run.model, pp=pp, microbatches=microbatches,
                                          schedule=schedule, global_batch=run.global_batch,
                                          steps=run.steps, seed=run.seed, lr=run.lr)


def report(result):
    """:func:`~labkit.parallel.pipeline.lab.pipeline_report` of a pipeline ``RunResult``;
    None for any other run."""
    if not hasattr(result.config, "schedule"):
        return None
    from labkit.parallel.pipeline.lab import pipeline_report

    return pipeline_report(result.config, result.metrics, result.trace)


def summarize(result, pipe: dict) -> dict:
    """A history row of a pipeline run (the DP-only columns read ``–``)."""
    cfg, s, ms = result.config, pipe["summary"], result.metrics
    return {"dp": 1, "micro_batch": cfg.micro, "bucket_mb": None, "dp_mode": "–",
            "checkpoint": "–", "zero_stage": 0, "prefetch": None, "replicas": 1,
            "overlap_pct": None, "pp": cfg.pp, "schedule": cfg.schedule,
            "microbatches": cfg.microbatches, "bubble_pct": 100 * s["bubble"],
            "bubble_sim_pct": 100 * s["bubble_simulated"],
            "step_ms": max(m["step_time_s"] for m in ms) * 1e3,
            "mfu_pct": None if s["mfu"] is None else 100 * s["mfu"], "hfu_pct": None,
            "peak_mib": S.mib(max(m["peak_activation_bytes"] + m["memory_predicted"]["total"]
                                  for m in ms)),
            "comm_bytes": max(_p2p_bytes(result.trace, m["rank"]) for m in ms),
            "loss": next(o["losses"][-1] for o in result.outputs if o.get("losses")),
            "wall_s": result.wall_s}


def _p2p_bytes(trace, rank: int) -> float:
    """Bytes ``rank`` sent point-to-point in the last step of the run."""
    last = max((e.step for e in trace.events), default=-1)
    return sum(e.bytes_sent for e in trace.events
               if e.rank == rank and e.cat == "p2p" and e.step == last)


def draw(figures: dict, result, pipe: dict) -> None:
    """Paint the explorer's ``memory``, ``comm`` and ``bubble`` figures for a pipeline run
    (the MFU gauge takes :func:`mfu_note`)."""
    rows = pipe["rows"]
    x = [[f"rank {r['rank']}" for r in rows],
         [f"stage{'s' * (len(r['stages']) > 1)} {','.join(map(str, r['stages']))}"
          for r in rows]]
    for tr in figures["memory"].data:
        cat = tr.name
        ys = [S.mib(r["peak_activation_bytes"]) if cat == "activations" else
              S.mib((r["model_state"] or {}).get(cat)) for r in rows]
        tr.update(x=x, y=ys,
                  marker_pattern_shape=["" if cat == "activations" else "/"] * len(rows))
    inflight = "/".join(str(r["peak_inflight"]) for r in rows)
    figures["memory"].layout.title.text = (
        f"memory per rank — activations measured (peak; {inflight} µb in flight), "
        f"model state 16 B/param of the rank's stages (hatched)")
    meas, pred = figures["comm"].data
    meas.update(x=[x[0], ["p2p send"] * len(rows)],
                y=[S.mib(_p2p_bytes(result.trace, r["rank"])) for r in rows],
                marker_color=S.COMM_COLORS["p2p"])
    pred.update(x=[[], []], y=[])
    figures["comm"].layout.title.text = ("point-to-point bytes per rank per step, measured "
                                         "(activations →, gradients ←, tied embedding)")
    draw_bubble(figures["bubble"], pipe)


def mfu_note(pipe) -> str:
    """The MFU gauge's last title line: the ceiling 1 − bubble ("" without a pipeline)."""
    if pipe is None:
        return ""
    s = pipe["summary"]
    return (f"ceiling 1 − bubble: {100 * s['mfu_ceiling']:.0f} % measured, "
            f"{100 * s['mfu_ceiling_simulated']:.0f} % simulated")


def bubble_figure() -> go.Figure:
    """Grouped bars over all ranks and each rank: ``data[0]`` measured, ``data[1]``
    simulated (hatched), idle / total in percent."""
    color = S.COMPUTE_COLORS["other"]
    return go.Figure([
        go.Bar(name="measured (trace)", x=[], y=[], marker_color=color,
               hovertemplate="%{x}: %{y:.1f} % idle measured<extra></extra>"),
        go.Bar(name="simulated (measured costs)", x=[], y=[], marker_color=color,
               marker_pattern_shape="/", opacity=0.6,
               hovertemplate="%{x}: %{y:.1f} % idle simulated<extra></extra>")],
        dict(template="plotly_white", height=300, width=520, barmode="group",
             yaxis=dict(title="idle / total, %", rangemode="tozero"),
             title=dict(text="bubble — pp = 1: no pipeline", font_size=14),
             margin=dict(l=60, r=10, t=50, b=40), legend=dict(orientation="h", y=-0.2)))


def draw_bubble(fig, pipe) -> None:
    """The bubble of ``pipe`` (a pipeline report), or empty bars when ``pipe`` is None."""
    if pipe is None:
        for tr in fig.data:
            tr.update(x=[], y=[])
        fig.layout.title.text = "bubble — pp = 1: no pipeline"
        return
    s, rows = pipe["summary"], pipe["rows"]
    x = ["all ranks"] + [f"rank {r['rank']}" for r in rows]
    fig.data[0].update(x=x, y=[100 * s["bubble"]] + [100 * r["idle_frac"] for r in rows])
    fig.data[1].update(x=x, y=[100 * s["bubble_simulated"]] +
                       [100 * r["predicted_idle_frac"] for r in rows])
    fig.layout.title.text = (f"bubble — {s['schedule']} P={s['pp']} M={s['microbatches']} "
                             f"V={s['virtual_stages']}: measured {100 * s['bubble']:.1f} % vs "
                             f"simulated {100 * s['bubble_simulated']:.1f} %")
