"""Jobs for ZeRO / FSDP / HSDP: train, measure memory and traffic beside the formulas.

``zero_train(ctx, cfg)`` (run it with ``cluster.run(zero_train, ZeroConfig(...))``) trains
the same model on the same global batches as :func:`labkit.train.run` and
:func:`labkit.train.reference`, with ZeRO stage 0 (labkit DP), 1, 2 or 3, HSDP, or PyTorch
FSDP2 (``impl="torch"``), and reports per rank (bytes, seconds):

* ``losses`` (this rank's rows; the mean over ranks is the global loss) and, with
  ``run.return_state``, rank 0's full fp32 parameters (``state``);
* ``memory``: torch's MemTracker by category (:mod:`labkit.measure.memory`): ``peak`` (at
  the highest total), ``model_state`` (each of parameters / gradients / optimizer at its
  largest over the step's marks, i.e. the persistent state between phases), and the
  ``working_set`` named: gathered units and in-flight unit gradients (counted by the
  wrapper), bucket buffers; ``memory_predicted`` from :func:`labkit.plan.model_state_bytes`
  with the stage and the shard count ``K`` (fp32: 4/4/8 bytes per parameter);
* ``comm_bytes_by_op`` of one steady step from the trace, beside ``comm_bytes_predicted``
  (the lecture's 2Ψ / 2Ψ / 3Ψ × (K−1)/K × element size, :func:`labkit.plan.dp_step_comm_bytes`)
  and ``comm_predicted_by_op`` (the same per collective, minus the root's backward
  all-gather that ``keep_last`` saves, plus HSDP's all-reduce across replicas; stages 2–3
  reduce-scatter, and stage 3 gathers, once per microbatch, so those scale with it);
* ``overlap``: the fraction of all-gather time hidden under compute (stage 3);
* step time, FLOPs and MFU as :mod:`labkit.train` computes them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..models import build_model
from ..plan.comm import comm_bytes, dp_step_comm_bytes
from ..plan.memory import model_state_bytes
from ..trace import region
from ..train._old import flat_params, flops_and_mfu, local_batch, run_steps, steady_step_time
from .dp import DataParallel, unique_parameters
from .zero import FullyShardedDataParallel, hsdp_groups
from .zero import ZeroDataParallel
from .zero_config import ZeroConfig

__all__ = ["zero_train", "zero_gradients", "overlap_fraction", "comm_by_op"]


def overlap_fraction(events, step: int, rank=None) -> dict:
    """Fraction of all-gather time hidden under compute in ``step``, from trace events.

    An all-gather's span runs from issue to the return of its ``wait``; the ``"wait"``
    events are the time the compute thread sat blocked on one. Hidden = span − wait.
    Returns ``{"forward", "backward", "total"}`` (``None`` where nothing was gathered).
    """
    out = {}
    for phase in ("forward", "backward", None):
        ag = sum(e.duration for e in events if e.op == "all_gather" and e.step == step
                 and (rank is None or e.rank == rank)
                 and e.args.get("phase") in ((phase,) if phase else ("forward", "backward")))
        wait = sum(e.duration for e in events if e.cat == "wait" and e.step == step
                   and (rank is None or e.rank == rank)
                   and (phase is None or e.args.get("phase") == phase))
        out[phase or "total"] = (min(1.0, max(0.0, 1.0 - wait / ag)) if ag > 0 else None)
    return out


def comm_by_op(events, step: int, rank=None) -> dict:
    """Bytes sent per collective in ``step`` (``{op: bytes}``)."""
    out: dict = {}
    for e in events:
        if e.cat == "comm" and e.step == step and (rank is None or e.rank == rank):
            out[e.op] = out.get(e.op, 0.0) + e.bytes_sent
    return out


def zero_train(ctx, cfg: ZeroConfig) -> dict:
    """Train ``cfg`` on this rank; returns ``{"losses", "metrics"[, "state"]}``."""
    cfg.validate(ctx.world_size)
    run, stage, rank, device = cfg.run, cfg.zero_stage, ctx.rank, ctx.device
    mc = run.model_config
    model = build_model(mc, device=device, seed=run.seed)
    n_params = sum(p.numel() for _, p in unique_parameters(model))
    shard_group, repl_group = hsdp_groups(ctx.group, cfg.hsdp_replicas, ctx.cache)
    track, wrapped = [], None
    if cfg.impl == "torch":
        model = _torch_fsdp(ctx, cfg, model, shard_group, repl_group)
        opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay)
        fwd, mem_model = model, model
    elif stage == 0:
        wrapped = DataParallel(model, ctx.group, "ddp", run.bucket_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay)
        fwd, mem_model = wrapped, model
    else:
        kw = dict(mixed_precision=cfg.mixed_precision)
        if stage == 3:
            wrapped = FullyShardedDataParallel(model, shard_group, repl_group,
                                               prefetch=cfg.prefetch, keep_last=cfg.keep_last,
                                               **kw)
            track += wrapped.gathered_buffers()
        else:
            wrapped = ZeroDataParallel(model, shard_group, repl_group, stage=stage, **kw)
        if cfg.mixed_precision:
            track += [u.master for u in wrapped.units]
        opt = wrapped.optimizer(run.lr, run.weight_decay)
        fwd, mem_model = wrapped, wrapped
    micro, accum = run.micro, run.accum_steps

    def step(s: int, mark) -> float:
        x, y = local_batch(run, s, rank, device)
        total = 0.0
        for m in range(accum):
            if wrapped is not None:
                wrapped.require_sync = m == accum - 1
            with region("forward", micro=m):
                loss = fwd(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]) / accum
            mark(f"forward {m}")
            with region("backward", micro=m):
                loss.backward()
            total += loss.item()
        if wrapped is not None:
            with region("grad_sync"):
                wrapped.finish_gradient_sync()
        mark("backward")
        with region("optimizer"):
            opt.step()
        if stage > 0 and wrapped is not None:
            with region("param_sync"):
                wrapped.after_step()
        mark("optimizer")
        if stage > 0 and wrapped is not None:
            wrapped.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
        return total

    losses, times, report = run_steps(ctx, run, step, mem_model, opt, device, track=track)
    timed_step = 1 if len(times) > 1 else 0
    k = cfg.shards if stage > 0 else run.parallel.dp
    elem = 2 if cfg.mixed_precision else 4
    metrics = {"rank": rank, "dp": run.parallel.dp, "zero_stage": stage, "impl": cfg.impl,
               "shards": k, "replicas": cfg.hsdp_replicas if stage > 0 else 1,
               "prefetch": cfg.prefetch, "keep_last": cfg.keep_last,
               "mixed_precision": cfg.mixed_precision, "model": mc.name, "n_params": n_params,
               "step_time_s": steady_step_time(times), "step_times": times,
               "memory_predicted": {c: int(v) for c, v in model_state_bytes(
                   n_params, k, stage, mixed_precision=cfg.mixed_precision).items()}}
    if cfg.impl == "labkit":
        metrics.update(_comm_metrics(ctx, cfg, wrapped, n_params, k, elem, timed_step))
    if report is not None:
        metrics["memory"] = _memory_metrics(report, cfg, wrapped)
    metrics.update(flops_and_mfu(ctx, run, mem_model, metrics["step_time_s"], accum))
    out = {"losses": losses, "metrics": metrics}
    if run.return_state:
        ctx.tracer.step = -1
        state = _full_state(model, wrapped, cfg)
        if rank == 0:
            out["state"] = state
    return out


def _full_state(model, wrapped, cfg: ZeroConfig) -> torch.Tensor:
    if cfg.impl == "torch":
        return torch.cat([p.full_tensor().detach().reshape(-1).float().cpu()
                          for _, p in unique_parameters(model)])
    if cfg.zero_stage == 0:
        return flat_params(model)
    return wrapped.full_state()


def _comm_metrics(ctx, cfg, wrapped, n_params, k, elem, timed_step) -> dict:
    stage, m = cfg.zero_stage, cfg.hsdp_replicas if cfg.zero_stage > 0 else 1
    measured = comm_by_op(ctx.tracer.events, timed_step, ctx.rank)
    formula = dp_step_comm_bytes(n_params, k, elem, stage)
    by_op, saved, padding = {}, 0.0, 0
    if stage == 0:
        by_op["all_reduce"] = formula
    else:
        padded = sum(u.padded for u in wrapped.units)
        padding = padded - n_params
        size = padded * elem
        # stages 2-3 reduce-scatter (and stage 3 gathers) once per microbatch
        micro = cfg.run.accum_steps if stage >= 2 else 1
        by_op["reduce_scatter"] = comm_bytes("reduce_scatter", size, k) * micro
        by_op["all_gather"] = comm_bytes("all_gather", size, k) * (2 * micro if stage == 3
                                                                     else 1)
        if stage == 3 and cfg.keep_last and wrapped.root is not None:
            saved = comm_bytes("all_gather", wrapped.root.padded * elem, k) * micro
            by_op["all_gather"] -= saved
        if m > 1:
            by_op["all_reduce"] = comm_bytes("all_reduce", size / k, m)
    out = {"comm_bytes_by_op": measured,
           "comm_bytes_per_step": sum(measured.values()),
           "comm_bytes_predicted": formula,
           "comm_predicted_by_op": {op: float(v) for op, v in by_op.items() if v or op in measured},
           "comm_saved_keep_last": saved, "padding_elems": padding}
    if stage == 3:
        out["overlap"] = overlap_fraction(ctx.tracer.events, timed_step, ctx.rank)
    return out


def _memory_metrics(report, cfg: ZeroConfig, wrapped) -> dict:
    """Model state at the step's marks (persistent state), the peak, and the named working
    set. Mixed precision: the fp32 master shards are tracked as "other" by MemTracker (they
    are optimizer parameters, not module parameters) and moved to "optimizer" here."""
    master = wrapped.shard_bytes["master"] if (wrapped is not None and cfg.zero_stage) else 0
    bucket = getattr(wrapped, "bucket_bytes", 0) if cfg.zero_stage == 0 else 0

    def fix(snap: dict) -> dict:
        snap = dict(snap)
        if master:
            snap["other"] -= master
            snap["optimizer"] += master
        snap["other"] += bucket
        return snap

    peak = fix(report.peak)
    marks = [fix(v) for _, v in report.timeline]
    model_state = {c: max(s.get(c, 0) for s in marks)
                   for c in ("parameters", "gradients", "optimizer")}
    working = {"bucket_buffers": bucket}
    if wrapped is not None and cfg.zero_stage > 0:
        working["inflight_unit_grads"] = wrapped.max_inflight_grad_bytes
        if cfg.zero_stage == 3:
            working["gathered_units"] = wrapped.max_gathered_bytes
            working["gathered_units_predicted"] = _gathered_predicted(wrapped, cfg.prefetch)
    return {"peak": peak, "peak_total": sum(peak.values()), "model_state": model_state,
            "working_set": working, "timeline": [[lbl, fix(v)] for lbl, v in report.timeline]}


def _gathered_predicted(wrapped, prefetch: bool) -> int:
    """Root unit + the current block + (with prefetch) the next block, bytes."""
    el = wrapped._elem
    blocks = sorted((u.padded for u in wrapped.units if u is not wrapped.root), reverse=True)
    root = wrapped.root.padded if wrapped.root is not None else 0
    return int(el * (root + sum(blocks[:2 if prefetch else 1])))


def _torch_fsdp(ctx, cfg: ZeroConfig, model: nn.Module, shard_group, repl_group):
    """PyTorch FSDP2: ``fully_shard`` every block, then the root, on a 1-D mesh (FSDP) or a
    2-D (replicate, shard) mesh (HSDP) built from the same process groups."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ranks = comm.group_ranks(ctx.group)
    key = ("fsdp2-mesh", ranks, cfg.hsdp_replicas)
    if key not in ctx.cache:
        dev = ctx.device.type
        if repl_group is None:
            ctx.cache[key] = DeviceMesh.from_group(shard_group, dev, mesh_dim_names=("shard",))
        else:
            mesh = torch.tensor(ranks).view(cfg.hsdp_replicas, cfg.shards)
            ctx.cache[key] = DeviceMesh.from_group([repl_group, shard_group], dev, mesh=mesh,
                                                   mesh_dim_names=("replicate", "shard"))
    kw = {"mesh": ctx.cache[key]}
    if cfg.mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.bfloat16)
    for block in getattr(model, "layers", []):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def zero_gradients(ctx, stage: int) -> dict:
    """The world-size-factor check: ``nn.Linear(3, 1)``, one different row per rank, mean
    loss; returns the gathered mean gradient ``{"weight", "bias"}`` after the sync."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    if stage == 3:
        model = FullyShardedDataParallel(lin, ctx.group)
    else:
        model = ZeroDataParallel(lin, ctx.group, stage=stage)
    rows = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 5.0, 0.5]])
    model(rows[ctx.rank:ctx.rank + 1]).pow(2).mean().backward()
    model.finish_gradient_sync()
    assert dist.get_world_size(ctx.group) == 2, "zero_gradients is a world-2 check"
    return model.full_grads()
