"""A pipeline run as ``labkit run --pp`` and the explorer show it: config, job, report.

* :func:`lab_config` — a :class:`~.config.PipelineConfig` from the knobs; a model with fewer
  layers than ``pp · V`` stages is deepened to one layer per stage (``n_layers``), any
  other impossible combination is left for :meth:`~.config.PipelineConfig.validate`.
* :func:`pipeline_train_mfu` — the cluster job: :func:`~.jobs.pipeline_train`, then this
  rank's FLOPs per step (torch's counter on its own stages, one microbatch, × ``M ·
  accum_steps``), the peak FLOP/s (as :func:`labkit.train.flops_and_mfu` gets it) and MFU;
  model-state bytes of the rank's stages (fp32 AdamW: 4/4/8 B per parameter).
* :func:`pipeline_report` — the bubble measured from the trace beside the simulator
  (:func:`~.bubble.measure_bubble` with the measured one-way p2p time per hop) and one
  plain-data row per rank: idle, in-flight activations, memory and MFU.

MFU of a rank = its model FLOPs / (step time · one device's peak); over the pipeline it is
Σ FLOPs / (step time · P · peak). The bubble bounds it: MFU ≤ 1 − bubble (the ceiling).
"""
from __future__ import annotations

from typing import Optional

from .bubble import measure_bubble
from .config import PipelineConfig

__all__ = ["lab_config", "pipeline_train_mfu", "stage_flops", "pipeline_report"]


def lab_config(model="tiny", pp: int = 2, microbatches: int = 4, schedule: str = "1f1b",
               virtual_stages: Optional[int] = None, n_layers: Optional[int] = None,
               **fields) -> PipelineConfig:
    """The config for these knobs (not validated). Without ``n_layers``, a model shallower
    than ``pp · V`` stages gets ``n_layers = pp · V`` (e.g. ``tiny``'s 2 layers at
    ``pp=4``); ``cfg.n_layers`` is then set, so callers can say so."""
    cfg = PipelineConfig(model=model, pp=pp, microbatches=microbatches, schedule=schedule,
                         virtual_stages=virtual_stages, n_layers=n_layers, **fields)
    shallow = (n_layers is None and isinstance(pp, int) and pp >= 1
               and cfg.stages_per_rank >= 1 and cfg.model_config.n_layers < cfg.n_stages)
    if shallow:
        cfg = cfg.replace(n_layers=cfg.n_stages)
    return cfg


def stage_flops(cfg: PipelineConfig, rank: int, device="cpu") -> int:
    """Model FLOPs of one microbatch's forward + backward through ``rank``'s stages
    (torch's counter; a non-first stage also computes its input gradient, as in the run)."""
    import torch

    from ...measure.flops import count_flops
    from ...models.data import text_batch
    from .stage import build_stages

    sched, mc = cfg.build_schedule(), cfg.model_config
    stages = build_stages(mc, sched.stages_of(rank), sched.n_stages, cfg.seed, device)
    x, y = text_batch(0, cfg.micro, mc.seq_len, cfg.seed)
    x, y = x.to(device), y.to(device)

    def fwd_bwd():
        for mod in stages.values():
            inp = x if mod.is_first else torch.zeros(
                cfg.micro, mc.seq_len, mc.d_model, dtype=mod.rope_cos.dtype, device=device,
                requires_grad=True)
            out = mod(inp)
            (mod.loss(out, y) if mod.is_last else out.sum()).backward()

    return count_flops(fwd_bwd).total


def pipeline_train_mfu(ctx, cfg: PipelineConfig) -> dict:
    """:func:`~.jobs.pipeline_train` plus ``model``, ``n_layers``, ``model_params``,
    ``memory_predicted`` (this rank's model state, bytes), ``flops_per_step``,
    ``peak_flops`` and ``mfu`` in the metrics (FLOPs and the peak cached per process)."""
    import torch

    from ...measure.rank_peak import rank_peak_flops
    from ...models.gpt import count_params
    from ...plan.memory import model_state_bytes
    from .jobs import pipeline_train

    out = pipeline_train(ctx, cfg)
    m, mc = out["metrics"], cfg.model_config
    key = ("pp-flops", mc, cfg.pp, cfg.schedule, cfg.stages_per_rank, cfg.micro, ctx.rank,
           str(ctx.device))
    if key not in ctx.cache:
        ctx.cache[key] = stage_flops(cfg, ctx.rank, ctx.device)
    flops = float(ctx.cache[key] * cfg.microbatches * cfg.accum_steps)
    peak = rank_peak_flops(ctx, torch.float32)
    m.update(model=mc.name, n_layers=mc.n_layers, model_params=count_params(mc),
             memory_predicted={k: int(v) for k, v in model_state_bytes(
                 m["n_params"], 1, 0, mixed_precision=False).items()},
             flops_per_step=flops, peak_flops=peak,
             mfu=flops / (m["step_time_s"] * peak) if peak and m["step_time_s"] else None)
    return out


def pipeline_report(cfg: PipelineConfig, metrics: list, trace) -> dict:
    """The bubble of a finished run and one row per rank (plain data but ``"bubble"``).

    Returns:
        ``{"bubble": BubbleReport, "summary": {...}, "rows": [...]}``. ``summary``:
        ``bubble`` / ``bubble_simulated`` (idle/total), ``mfu_ceiling`` /
        ``mfu_ceiling_simulated``, ``mfu`` (Σ FLOPs / (step time · P · peak)),
        ``p2p_latency_s``, ``window_s``, ``bubble_explained`` with ``hop_s`` and
        ``dispatch_s`` (the executor's overheads, :func:`~.bubble.overheads`),
        ``ladder`` (``[(rung, bubble)]``). Each row: ``rank``, ``stages``, ``step_time_s``,
        ``busy_s``, ``idle_s``, ``predicted_idle_s``, ``idle_frac`` /
        ``predicted_idle_frac``, ``peak_activation_bytes``, ``peak_inflight`` /
        ``predicted_inflight``, ``model_state`` (bytes by category), ``flops_per_step``,
        ``mfu``.

    Raises:
        ValueError: the trace holds no pipeline compute spans.
    """
    lat = (metrics[0].get("p2p_latency_s") or 0.0) if metrics else 0.0
    rep = measure_bubble(trace, cfg.build_schedule(), comm=lat)
    pred = rep.predicted
    rows = []
    for row, m in zip(rep.rows(), metrics):
        r = row["rank"]
        rows.append({**row, "stages": m.get("stages"), "step_time_s": m.get("step_time_s"),
                     "idle_frac": row["idle_s"] / rep.window if rep.window else None,
                     "predicted_idle_frac": row["predicted_idle_s"] / pred.makespan
                     if pred.makespan else None,
                     "peak_activation_bytes": m.get("peak_activation_bytes"),
                     "peak_inflight": m.get("peak_inflight"),
                     "predicted_inflight": pred.peak_inflight[r],
                     "model_state": m.get("memory_predicted"),
                     "flops_per_step": m.get("flops_per_step"), "mfu": m.get("mfu")})
    flops = [m.get("flops_per_step") for m in metrics]
    peak = metrics[0].get("peak_flops") if metrics else None
    step = max((m.get("step_time_s") or 0.0 for m in metrics), default=0.0)
    mfu = (sum(flops) / (step * len(metrics) * peak)
           if peak and step and None not in flops else None)
    summary = {"schedule": cfg.schedule, "pp": cfg.pp, "microbatches": cfg.microbatches,
               "virtual_stages": cfg.stages_per_rank, "bubble": rep.bubble,
               "bubble_simulated": pred.bubble, "mfu_ceiling": rep.mfu_ceiling,
               "mfu_ceiling_simulated": rep.predicted_mfu_ceiling, "mfu": mfu,
               "p2p_latency_s": lat, "window_s": rep.window, "flushes": rep.flushes,
               "replayed_bubble": rep.replayed_bubble, "fitted_comm_s": rep.fitted_comm_s,
               "bubble_explained": rep.explained.bubble, "hop_s": rep.hop_s,
               "dispatch_s": rep.dispatch_s, "ladder": rep.ladder}
    return {"bubble": rep, "summary": summary, "rows": rows}
