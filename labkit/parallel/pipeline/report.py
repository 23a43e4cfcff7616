"""A pipeline run of the training job as ``labkit run --pp`` and the explorer show it.

* :func:`deepen_for_pipeline` — a config whose model has fewer layers than ``pp · V``
  stages is deepened to one layer per stage (e.g. ``tiny``'s 2 layers at ``pp=4``); any
  other impossible combination is left for :meth:`~labkit.config.RunConfig.validate`.
* :func:`pipeline_trace` — the first pipeline's events with each global rank replaced by
  its pipeline rank: with data parallelism several pipelines run at once, and the bubble
  is read from one of them.
* :func:`pipeline_report` — the bubble measured from the trace beside the simulator
  (:func:`~.bubble.measure_bubble` with the measured one-way p2p time per hop) and one
  plain-data row per pipeline rank: idle, in-flight activations, memory and MFU.

MFU of a rank = its model FLOPs / (step time · one device's peak); over the pipeline it is
Σ FLOPs / (step time · P · peak). The bubble bounds it: MFU ≤ 1 − bubble (the ceiling).
"""
from __future__ import annotations

import dataclasses

from .bubble import measure_bubble

__all__ = ["deepen_for_pipeline", "pipeline_trace", "pipeline_report"]


def deepen_for_pipeline(cfg):
    """``cfg`` with the model deepened to ``pp · V`` layers when it is shallower (and
    ``pp > 1``); otherwise ``cfg`` itself. Callers compare ``n_layers`` to say so."""
    p = cfg.parallel.pp
    if not isinstance(p, int) or p < 2:
        return cfg
    try:
        stages = cfg.n_stages
    except Exception:  # noqa: BLE001 - an unknown schedule: validate names it
        return cfg
    mc = cfg.model_config
    if mc.n_layers >= stages:
        return cfg
    return cfg.replace(model=dataclasses.replace(mc, n_layers=stages))


def pipeline_trace(trace, mesh, dp_index: int = 0) -> list:
    """The events of the pipeline whose first rank is ``mesh``'s ``dp_index``-th data rank
    (tp/cp index 0), with ``rank`` set to each event's pipeline rank."""
    first = mesh.rank(dp_shard=dp_index % mesh.dp_shard,
                      dp_replicate=dp_index // mesh.dp_shard)
    ranks = mesh.group(first, "pp")
    where = {g: i for i, g in enumerate(ranks)}
    return [dataclasses.replace(e, rank=where[e.rank]) for e in trace.events
            if e.rank in where]


def pipeline_report(cfg, metrics: list, trace) -> dict:
    """The bubble of a finished run and one row per pipeline rank (plain data but
    ``"bubble"``), from the first pipeline.

    Returns:
        ``{"bubble": BubbleReport, "summary": {...}, "rows": [...]}``. ``summary``:
        ``bubble`` / ``bubble_simulated`` (idle/total), ``mfu_ceiling`` /
        ``mfu_ceiling_simulated``, ``mfu`` (Σ FLOPs / (step time · P · peak)),
        ``p2p_latency_s``, ``window_s``, ``bubble_explained`` with ``hop_s`` and
        ``dispatch_s`` (the executor's overheads), ``ladder`` (``[(rung, bubble)]``).
        Each row: ``rank`` (pipeline rank), ``global_rank``, ``stages``, ``step_time_s``,
        ``busy_s``, ``idle_s``, ``predicted_idle_s``, ``idle_frac`` /
        ``predicted_idle_frac``, ``peak_activation_bytes``, ``peak_inflight`` /
        ``predicted_inflight``, ``model_state`` (bytes by category), ``flops_per_step``,
        ``mfu``.

    Raises:
        ValueError: the trace holds no pipeline compute spans.
    """
    mesh = cfg.mesh
    ranks = mesh.group(0, "pp")
    pm = [metrics[g] for g in ranks]
    lat = max((m.get("p2p_latency_s") or 0.0) for m in metrics) if metrics else 0.0
    sched = cfg.build_schedule()
    rep = measure_bubble(pipeline_trace(trace, mesh), sched, comm=lat)
    pred = rep.predicted
    rows = []
    for row, m, g in zip(rep.rows(), pm, ranks):
        r = row["rank"]
        rows.append({**row, "global_rank": g, "stages": m.get("stages"),
                     "step_time_s": m.get("step_time_s"),
                     "idle_frac": row["idle_s"] / rep.window if rep.window else None,
                     "predicted_idle_frac": row["predicted_idle_s"] / pred.makespan
                     if pred.makespan else None,
                     "peak_activation_bytes": m.get("peak_activation_bytes"),
                     "peak_inflight": m.get("peak_inflight"),
                     "predicted_inflight": pred.peak_inflight[r],
                     "model_state": m.get("memory_predicted"),
                     "flops_per_step": m.get("flops_per_step"), "mfu": m.get("mfu")})
    flops = [m.get("flops_per_step") for m in pm]
    peak = pm[0].get("peak_flops") if pm else None
    step = max((m.get("step_time_s") or 0.0 for m in pm), default=0.0)
    mfu = (sum(flops) / (step * len(pm) * peak)
           if peak and step and None not in flops else None)
    summary = {"schedule": cfg.schedule, "pp": cfg.parallel.pp,
               "microbatches": cfg.flush_microbatches, "virtual_stages": cfg.stages_per_rank,
               "bubble": rep.bubble, "bubble_simulated": pred.bubble,
               "mfu_ceiling": rep.mfu_ceiling, "mfu_ceiling_simulated": rep.predicted_mfu_ceiling,
               "mfu": mfu, "p2p_latency_s": lat, "window_s": rep.window, "flushes": rep.flushes,
               "replayed_bubble": rep.replayed_bubble, "fitted_comm_s": rep.fitted_comm_s,
               "bubble_explained": rep.explained.bubble, "hop_s": rep.hop_s,
               "dispatch_s": rep.dispatch_s, "ladder": rep.ladder}
    return {"bubble": rep, "summary": summary, "rows": rows}
