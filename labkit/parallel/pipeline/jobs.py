"""Pipeline-parallel jobs for :meth:`labkit.Cluster.run`, and the single-process reference.

* :func:`pipeline_train` — labkit's executor running ``cfg.schedule``;
* :func:`torch_pipeline_train` — the same stages under ``torch.distributed.pipelining``
  (``ScheduleGPipe`` / ``Schedule1F1B``), the reference for parity and speed;
* :func:`reference` — one process, whole model, same global batches: the ground truth.

One optimizer step = ``accum_steps`` pipeline flushes of ``M`` microbatches each; every
microbatch loss (a mean over its tokens) is scaled by ``1/(M·accum_steps)``, so the
gradient is that of the mean loss over the whole global batch, with no other factor.

Each rank returns ``{"losses", "metrics"[, "grads"][, "state"]}``; ``losses`` (the
global-batch mean loss per step) are reported by rank 0, which receives them from the
rank of the last stage.
"""
from __future__ import annotations

import statistics

import torch

from ... import comm
from ...models import build_model
from ...models.data import text_batch
from .config import PipelineConfig
from .executor import PipelineExecutor
from .stage import ActivationMeter, TiedEmbedding, WeightGradStore, build_stages

__all__ = ["pipeline_train", "torch_pipeline_train", "reference"]


def _named_params(stages: dict) -> dict:
    """``{full GPT name: parameter}`` over this rank's stages, each parameter once."""
    out, seen = {}, set()
    for s in sorted(stages):
        for name, p in stages[s].named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[stages[s].full_name(name)] = p
    return out


def _batch(cfg: PipelineConfig, step: int):
    x, y = text_batch(step, cfg.global_batch, cfg.model_config.seq_len, cfg.seed)
    return x.contiguous(), y.contiguous()  # torch's pipelining checks input strides


def p2p_latency(ctx, shape: tuple, dtype=torch.float32, rounds: int = 16) -> float:
    """One-way time (seconds) of one boundary tensor between ranks 0 and 1: half the fastest
    of ``rounds`` round trips of a blocking ping-pong through labkit.comm (untraced): the
    message's own time, without interference from other work on the machine (which the
    executor's hop time, measured in the run, does include). 0.0 with one rank.

    Every rank of ``ctx.group`` must call it: barriers on both sides keep the other ranks
    from computing (or packing their results) while it runs, which on a machine with fewer
    cores than ranks would time the core sharing instead of the message."""
    if ctx.world_size < 2:
        return 0.0
    t = torch.zeros(shape, dtype=dtype, device=ctx.device)
    enabled, ctx.tracer.enabled = ctx.tracer.enabled, False
    rtts = []
    comm.barrier(ctx.group)
    try:
        for _ in range(rounds):
            if ctx.rank == 0:
                t0 = ctx.tracer.now()
                comm.send(t, 1, ctx.group)
                comm.recv(t, 1, ctx.group)
                rtts.append(ctx.tracer.now() - t0)
            elif ctx.rank == 1:
                comm.recv(t, 0, ctx.group)
                comm.send(t, 0, ctx.group)
        comm.barrier(ctx.group)
    finally:
        ctx.tracer.enabled = enabled
    return min(rtts[1:]) / 2 if rtts else 0.0


def _train(ctx, cfg: PipelineConfig, stages: dict, flush_fn, loss_rank: int) -> dict:
    """The loop both implementations share: data, flushes, tied-gradient sync, AdamW."""
    sched = cfg.build_schedule()
    params = _named_params(stages)
    opt = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    tie = TiedEmbedding(cfg.model_config, sched, ctx.rank, stages, ctx.group)
    a, per_flush = cfg.accum_steps, cfg.global_batch // cfg.accum_steps
    losses, times, out = [], [], {}
    for step in range(cfg.steps):
        ctx.tracer.step = step
        x, y = _batch(cfg, step)
        x, y = x.to(ctx.device), y.to(ctx.device)
        comm.barrier(ctx.group)  # every rank starts the step together: comparable times
        t0 = ctx.tracer.now()
        loss = 0.0
        for f in range(a):
            sl = slice(f * per_flush, (f + 1) * per_flush)
            loss += flush_fn(x[sl], y[sl], 1.0 / (cfg.microbatches * a), f)
        tie.sync()
        if step == 0 and cfg.return_grads:
            out["grads"] = {n: p.grad.detach().clone() for n, p in params.items()
                            if p.grad is not None}
        with torch.no_grad():
            opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(ctx.tracer.now() - t0)
        losses.append(loss)
    # the rank of the last stage knows the losses; rank 0 reports them (outside any step)
    ctx.tracer.step = -1
    buf = torch.tensor(losses, dtype=torch.float64)
    if loss_rank != 0 and ctx.rank == loss_rank:
        comm.send(buf, 0, ctx.group, axis="pp")
    elif loss_rank != 0 and ctx.rank == 0:
        comm.recv(buf, loss_rank, ctx.group, axis="pp")
    out["losses"] = buf.tolist() if ctx.rank in (0, loss_rank) else []
    if cfg.return_state:
        out["state"] = {n: p.detach().clone() for n, p in params.items()}
    steady = times[1:] or times
    out["metrics"] = {"rank": ctx.rank, "stages": sorted(stages), "schedule": cfg.schedule,
                      "impl": cfg.impl, "pp": cfg.pp, "microbatches": cfg.microbatches,
                      "virtual_stages": cfg.stages_per_rank, "step_times": times,
                      "step_time_s": statistics.median(steady),
                      "n_params": sum(p.numel() for p in params.values())}
    return out


def pipeline_train(ctx, cfg: PipelineConfig) -> dict:
    """Train with labkit's pipeline executor on ranks ``0 … pp−1``.

    With ``cfg.impl == "torch"`` it runs :func:`torch_pipeline_train` instead. Metrics
    also hold ``peak_activation_bytes`` and ``peak_inflight`` (stage-microbatches)
    measured on this rank with saved-tensor hooks, and ``p2p_latency_s`` (rank 0; ``None``
    on the others): the one-way time of one boundary tensor (:func:`p2p_latency`, after training), which
    :func:`~.bubble.measure_bubble` can add to every hop of its prediction.
    """
    cfg.validate(ctx.world_size)
    if cfg.impl == "torch":
        return torch_pipeline_train(ctx, cfg)
    sched = cfg.build_schedule()
    mc = cfg.model_config
    store = WeightGradStore() if sched.split_backward else None
    stages = build_stages(mc, sched.stages_of(ctx.rank), sched.n_stages, cfg.seed, ctx.device,
                          split_backward=sched.split_backward, store=store)
    meter = ActivationMeter(list(stages.values()), enabled=cfg.measure_memory)
    dtype = next(iter(stages.values())).rope_cos.dtype
    ex = PipelineExecutor(sched, stages, ctx.rank, ctx.group, (cfg.micro, mc.seq_len, mc.d_model),
                          dtype, ctx.device, store, meter)
    out = _train(ctx, cfg, stages, lambda x, y, scale, f: ex.run(x, y, scale, f),
                 sched.stage_rank(sched.n_stages - 1))
    lat = p2p_latency(ctx, (cfg.micro, mc.seq_len, mc.d_model), dtype)  # every rank calls
    out["metrics"].update(peak_activation_bytes=meter.peak_bytes,
                          peak_inflight=meter.peak_count,
                          p2p_latency_s=lat if ctx.rank == 0 else None)
    return out


def torch_pipeline_train(ctx, cfg: PipelineConfig) -> dict:
    """The same stages, data and optimizer under ``torch.distributed.pipelining``
    (``ScheduleGPipe`` or ``Schedule1F1B``, one stage per rank). Its point-to-point traffic
    bypasses labkit.comm: it is a reference, not part of labkit."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    cfg = cfg.validate(ctx.world_size).replace(impl="torch")
    if cfg.stages_per_rank != 1:
        raise ValueError("torch_pipeline_train runs one stage per rank")
    mc = cfg.model_config
    stages = build_stages(mc, [ctx.rank], cfg.pp, cfg.seed, ctx.device)
    mod = stages[ctx.rank]
    pstage = PipelineStage(mod, ctx.rank, cfg.pp, ctx.device, group=ctx.group)
    cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
    schedule = cls(pstage, n_microbatches=cfg.microbatches, loss_fn=mod.loss, scale_grads=True)

    def flush(x, y, scale, f):
        # torch divides the summed microbatch gradients by M itself (scale_grads=True)
        if cfg.accum_steps != 1:
            raise ValueError("torch_pipeline_train supports accum_steps=1")
        if mod.is_first and mod.is_last:
            raise ValueError("torch_pipeline_train needs pp >= 2")
        if mod.is_first:
            schedule.step(x)
            return 0.0
        if mod.is_last:
            mb_losses: list = []
            schedule.step(target=y, losses=mb_losses)
            return float(torch.stack([t.detach() for t in mb_losses]).mean())
        schedule.step()
        return 0.0

    return _train(ctx, cfg, stages, flush, cfg.pp - 1)


def reference(cfg: PipelineConfig, device: str = "cpu") -> dict:
    """Single process, whole model, same global batches: ``{"losses", "grads", "state"}``.

    ``grads`` are the first step's, by parameter name (a tied head appears once, as
    ``tok_emb.weight``); ``state`` the final parameters.
    """
    cfg.validate()
    model = build_model(cfg.model_config, device=device, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses, grads = [], {}
    for step in range(cfg.steps):
        x, y = _batch(cfg, step)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "state": {n: p.detach().clone() for n, p in model.named_parameters()}}
