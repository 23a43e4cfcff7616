"""The ONE training job: every parallelism composed over one mesh, traced and measured.

``run(ctx, cfg)`` is what :func:`labkit.jobs.train` executes on each rank of a
:class:`labkit.Cluster` (or under ``torchrun``). It

1. validates ``cfg`` and takes this rank's view of the mesh (``cfg.mesh``, the groups
   already created on every rank of the pool: :mod:`labkit.mesh`);
2. composes the rank's model (:mod:`labkit.train.build`): pipeline split → (tensor,
   context, expert) → activation checkpointing → data parallelism / ZeRO / FSDP / HSDP →
   AdamW; a warm rank re-running a config reuses what it composed for it, restored
   (:mod:`labkit.train.cache`; ``metrics["reused"]`` says what);
3. runs ``cfg.steps`` steps (:mod:`labkit.train.step`): microbatches, or pipeline flushes
   through the executor, then the gradient reductions and the optimizer — every rank's
   loss is the sum of its token losses over the global token count, every reduction a sum;
4. measures (:mod:`labkit.train.metrics`): step time, memory by category, bytes per axis
   and collective, FLOPs and MFU/HFU, each beside its prediction.

``reference(cfg)`` trains the same model on the same global batches in one process with
no communication: the ground truth every composition must match.
"""
from __future__ import annotations

import contextlib
import gc
import warnings

import torch

from .. import comm
from ..config import RunConfig
from ..faults import inject
from ..parallel.dp import unique_parameters
from ..snapshot.folder import ObjectiveChangeWarning
from .build import RankSetup, build_rank
from .cache import measured
from .data import local_rows, rank_batch, tokens_per_sample
from .experts import ep_predicted, recording, routing_summary
# the returned state and gradients, and the single-process reference, live in their own
# modules; their names stay importable from here
from .gather import _full, _gather, _grab_grads, _named, _rank_state  # noqa: F401
from .metrics import (comm_metrics, flops_and_mfu, memory_metrics, overlap_fraction,
                      predicted_memory, run_steps, steady_step_time)
from .planned import planned_state
from .noise_scale import NoiseScaleMeter
from .single_process import reference, token_groups  # noqa: F401
from .step import make_step

__all__ = ["run", "reference", "flat_params", "local_rows", "rank_batch", "run_steps",
           "steady_step_time", "RankSetup"]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All trainable parameters (tied ones once), flattened into one fp32 CPU vector."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for _, p in unique_parameters(model)])


def run(ctx, cfg: RunConfig) -> dict:
    """Train ``cfg`` (a :class:`labkit.config.RunConfig`) on this rank.

    Returns plain data: ``{"losses": [global mean loss per step, the same on every rank],
    "metrics": {...}}``, plus ``"state"`` (this rank's parameters by full-model name, full
    shape, fp32, after training) with ``cfg.return_state`` and ``"grads"`` (the first
    step's reduced gradients, the same form) with ``cfg.return_grads``.
    """
    with warnings.catch_warnings():
        # the caller was warned before launch; the run reports it in its snapshot metrics
        warnings.simplefilter("ignore", ObjectiveChangeWarning)
        cfg.validate(ctx.world_size)
    mg = ctx.mesh_groups(cfg.mesh)
    setup = build_rank(ctx, cfg, mg)
    executor = meter = None
    if cfg.parallel.pp > 1 and cfg.impl == "torch":
        from .pipeline import TorchPipeline

        executor = TorchPipeline(setup)
    elif cfg.parallel.pp > 1:
        from .pipeline import make_executor

        executor, meter = make_executor(setup)
    out: dict = {}
    noise = NoiseScaleMeter(setup) if cfg.noise_scale else None
    step = make_step(setup, executor, on_synced=_grab_grads(setup, out, ctx.tracer) if cfg.return_grads
                     else None, noise=noise)
    if meter is not None:
        from .pipeline import meter_untracked_steps

        step = meter_untracked_steps(step, meter, cfg)
    # Garbage left by the build is collected now, not by an automatic collection inside a
    # timed step: all of the heap after a cold build (it allocates far more), the young
    # generations after a warm one (a full walk would cost it tens of milliseconds). The
    # memory-tracked step pauses the collector itself (labkit.measure.memory).
    start, snapshots = _resume(ctx, setup)
    gc.collect(1 if "stages" in setup.reused else 2)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(recording(setup, ctx.tracer)) \
            if cfg.model_config.n_experts else None
        inject.arm(cfg.faults, ctx.rank)
        stack.callback(inject.disarm)
        shares, times, report = run_steps(ctx, cfg, step, setup.memory_module, setup.opt,
                                          ctx.device, track=setup.track, start=start,
                                          after_step=_saver(ctx, setup, snapshots))
    ctx.tracer.step = -1
    losses = _global_losses(ctx, setup, shares)
    step_time = steady_step_time(times)
    timed = start + (1 if len(times) > 1 else 0)
    metrics = {"rank": ctx.rank, "coords": dict(mg.coords), "mesh": str(cfg.mesh.shape),
               "model": cfg.model_config.name, "n_params": setup.n_params,
               "rank_params": setup.rank_params, "stages": sorted(setup.stages),
               # parameters outside ZeRO's flat units (a tied copy between pipeline stages)
               "replicated_params": sum(p.numel() for p in setup.plain_params)
               if setup.sharded else setup.rank_params,
               "dp": cfg.parallel.dp, "pp": cfg.parallel.pp, "zero_stage": cfg.zero_stage,
               "micro_batch": cfg.micro, "accum_steps": cfg.accum_steps,
               "tokens_per_step": cfg.global_batch * tokens_per_sample(cfg),
               "step_time_s": step_time, "step_times": times, "checkpoint": cfg.checkpoint,
               # only the first step was timed (the last of 2 measures memory): the step time
               # and MFU then include the warm-up (first-call allocations, FLOP counting)
               "step_time_warmup": len(times) < 2,
               "precision": cfg.precision, "impl": cfg.impl,
               "memory_predicted": predicted_memory(setup),
               # labkit.plan's figures for this rank, with the reasons they differ in words
               "memory_planned": planned_state(setup),
               # Adam keeps a 4-byte step counter per parameter tensor (on the CPU)
               "optimizer_state_tensors": sum(len(g["params"]) for g in setup.opt.param_groups),
               "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None
                                      for m in setup.stages.values()
                                      for b in getattr(m, "layers", [])),
               # what this warm rank took from its cache instead of building or measuring
               "reused": list(setup.reused), "first_step": start,
               # labkit.faults: what was injected on this rank, and the replica fingerprint
               "faults_injected": [str(f) for f in cfg.faults if f.rank == ctx.rank]}
    if getattr(step, "sdc", None) is not None:
        metrics["sdc"] = step.sdc.summary()
    if snapshots:
        metrics["snapshot"] = snapshots
    if noise is not None:
        metrics["noise_scale"] = noise.metrics(ctx)
    if report is not None:
        metrics["memory"] = memory_metrics(report, setup)
    metrics.update(comm_metrics(ctx, setup, timed))
    if log is not None:
        out["routing"] = routing_summary(log, cfg.steps - start)
        if setup.mg.size("ep") > 1:
            ep = ep_predicted(ctx, setup, log, timed)
            metrics["comm_predicted_by_axis"]["ep"] = ep
            metrics["comm_bytes_predicted"] += sum(ep.values())
    if setup.cp_core is not None:
        metrics["cp"] = _cp_metrics(ctx, setup, timed, cfg.steps - start)
    if cfg.zero_stage == 3 and setup.sharded:
        metrics["overlap"] = overlap_fraction(ctx.tracer.events, timed, ctx.rank)
    metrics.update(flops_and_mfu(ctx, setup, step_time))
    if meter is not None:
        from .pipeline import p2p_latency

        # a timing of the message path, not of this run: once per unchanged config
        lat, cached = measured(ctx, cfg, "p2p_latency_s", lambda: p2p_latency(ctx, setup))
        if cached:
            metrics["reused"].append("p2p_latency_s")
        metrics.update(peak_activation_bytes=meter.peak_bytes, peak_inflight=meter.peak_count,
                       p2p_latency_s=lat)
    out.update(losses=losses, metrics=metrics)
    if cfg.return_state:
        out["state"] = _rank_state(setup)
    return out


def _resume(ctx, setup: RankSetup) -> tuple:
    """``(first step, snapshot report)``: with ``cfg.resume``, the state of the snapshot it
    names loaded into this composition (:mod:`labkit.snapshot`), else step 0."""
    cfg = setup.cfg
    if not cfg.resume:
        return 0, {}
    from ..snapshot import load
    from ..snapshot.folder import check_resume

    start, report = load(ctx, setup, check_resume(cfg))
    return start, {"loaded": report}


def _saver(ctx, setup: RankSetup, snapshots: dict):
    """``after_step(s)``: with ``cfg.save_dir``, a snapshot after every ``save_every``
    steps and after the last (:mod:`labkit.snapshot`)."""
    cfg = setup.cfg
    if not cfg.save_dir:
        return None
    from ..snapshot import save

    def after(s: int) -> None:
        done = s + 1
        if done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0):
            snapshots.setdefault("saved", []).append(save(ctx, setup, done))
    return after


def _cp_metrics(ctx, setup: RankSetup, step: int, n_steps: int) -> dict:
    """Context parallelism on this rank: the attention work its own counter saw per step
    (unmasked query-key pairs × batch rows × heads, by phase; every step does the same) beside
    the closed form, the K/V working set, and for the ring the fraction of send/recv time
    hidden under block compute in ``step`` (a timing)."""
    from ..parallel.context.measure import ring_overlap, work_closed_form

    cfg, mg = setup.cfg, setup.mg
    mc, p = cfg.model_config, cfg.parallel
    work = setup.cp_core.counter.to_dict()
    per_step = {ph: n // n_steps for ph, n in work["pairs"].items()}
    layers = sum(len(m.layers) for m in setup.stages.values())
    core = setup.cp_core  # a ViT's sequence is its patches, attended without a mask
    one = work_closed_form(cfg.cp_method, mg.index("cp"), p.cp, core.seq_len, cfg.cp_zigzag,
                           core.causal, cfg.micro, mc.n_heads // p.tp)
    return {"work": per_step, "work_formula": one * layers * cfg.accum_steps,
            "kv_working_set": work["kv_bytes"],
            "ring_overlap": ring_overlap(ctx.tracer.events, ctx.rank)
            if cfg.cp_method == "ring" else None}


def _global_losses(ctx, setup: RankSetup, shares: list) -> list:
    """Sum every rank's loss share into the global mean loss per step, on every rank.

    Only ranks that computed a loss contribute (the last pipeline stage; a tensor-parallel
    group counts once). One untraced all-reduce after training: bookkeeping, not traffic."""
    first_of_tp = setup.mg.index("tp") == 0  # every tp rank holds the same loss
    t = torch.tensor([float(x) if first_of_tp else 0.0 for x in shares], dtype=torch.float64)
    if ctx.world_size == 1:
        return t.tolist()
    enabled, ctx.tracer.enabled = ctx.tracer.enabled, False
    try:
        comm.all_reduce(t, "sum", ctx.group)
    finally:
        ctx.tracer.enabled = enabled
    return t.tolist()
