"""Jobs and crafted routings for the expert-parallel tests (importable by the ranks).

A *case* is one MoE layer (``E`` experts of a tiny width), ``P`` ranks with ``T`` tokens
each, and a routing pattern forced through the router weights and the inputs: feature 0 of
every token is 1 (so router column 0 acts as a per-expert bias) and feature 1 marks "hot"
tokens (router column 1 sends them to experts 0 and 1, both on rank 0).

* ``natural``: random router, no forcing.
* ``starved``: the last expert's bias is −30: it receives no token at all.
* ``skewed``: rank ``r``'s tokens are hot with fraction ``1 − r/(P−1)``: rank 0 sends every
  row to its own experts (nothing to other ranks), rank ``P−1`` routes naturally.
* ``collapsed``: every token is hot: all rows go to rank 0; the other ranks receive none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils.checkpoint

from labkit import comm
from labkit.config import ModelConfig
from labkit.models.moe import MoE, record_routing, set_aux_loss_scale

PATTERNS = ("natural", "starved", "skewed", "collapsed")


@dataclass(frozen=True)
class LayerCase:
    ep: int = 2
    top_k: int = 2
    pattern: str = "natural"
    capacity_factor: Optional[float] = None
    n_experts: int = 8
    tokens: int = 24
    d_model: int = 16
    d_ff: int = 24
    aux_loss_weight: float = 0.1
    seed: int = 0
    checkpoint: bool = False
    timeout_s: float = 60.0


def model_config(case: LayerCase) -> ModelConfig:
    return ModelConfig(n_layers=1, d_model=case.d_model, n_heads=2, d_ff=case.d_ff,
                       n_experts=case.n_experts, top_k=case.top_k,
                       capacity_factor=case.capacity_factor,
                       aux_loss_weight=case.aux_loss_weight)


def build_case(case: LayerCase) -> tuple:
    """``(layer, x (P, T, H), target (P, T, H))``: full weights, the same on every rank."""
    g = torch.Generator().manual_seed(case.seed)
    layer = MoE(model_config(case))
    p, t, h, e = case.ep, case.tokens, case.d_model, case.n_experts
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(e, h, generator=g) * 0.5)
        for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
        x = torch.randn(p, t, h, generator=g)
        target = torch.randn(p, t, h, generator=g)
        x[..., 0], x[..., 1] = 1.0, 0.0
        r = layer.router.weight
        r[:, 0], r[:, 1] = 0.0, 0.0
        if case.pattern == "starved":
            r[e - 1, 0] = -30.0
        elif case.pattern in ("skewed", "collapsed"):
            r[0, 1], r[1, 1] = 10.0, 9.0
            for rank in range(p):
                frac = 1.0 if case.pattern == "collapsed" else 1 - rank / max(p - 1, 1)
                x[rank, :round(frac * t), 1] = 8.0
        elif case.pattern != "natural":
            raise ValueError(f"unknown pattern {case.pattern!r}")
    return layer, x, target


def layer_step(ctx, case: LayerCase) -> dict:
    """One forward/backward of the case's layer, expert-parallel over ``ctx.group``.

    The objective is the one loss rule's: ``Σ (y·target) / (P·T)`` plus the aux loss at
    this rank's share ``1/P``; the router gradient is summed over the ranks (dense), the
    expert gradients are this rank's slice (no other rank holds them)."""
    from labkit.parallel.expert import apply_expert_parallel

    layer, x_all, target_all = build_case(case)
    info = apply_expert_parallel(layer, ctx.group)
    set_aux_loss_scale(layer, 1.0 / case.ep)
    x = x_all[ctx.rank].clone().requires_grad_(True)
    with record_routing(layer) as log:
        if case.checkpoint:  # backward recomputes the layer: dispatch and combine again
            y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        else:
            y = layer(x)
        loss = (y * target_all[ctx.rank]).sum() / (case.ep * case.tokens)
        loss.backward()
    assert len(log) == 1, f"{len(log)} routings recorded for one forward"
    router_grad = layer.router.weight.grad.clone()
    comm.all_reduce(router_grad, "sum", ctx.group)
    total = loss.detach().clone()
    comm.all_reduce(total, "sum", ctx.group)
    st = log[0]
    ex = layer.experts
    return {"y": y.detach(), "x_grad": x.grad, "router_grad": router_grad,
            "loss": total.item(), "first": info.first, "n_local": info.n_local,
            "expert_grads": {n: getattr(ex, n).grad.clone() for n in ("w1", "w3", "w2")},
            "counts": st.counts[0].tolist(), "kept": st.kept[0].tolist(),
            "dropped": st.dropped.tolist(), "aux": float(st.aux),
            "recv": layer.dispatcher.last_recv.tolist()}


A2A_SIZES = [[0, 3, 0, 1], [2, 0, 0, 0], [0, 0, 0, 0], [5, 1, 4, 0]]  # rows from rank i to j


def a2a_v(ctx, cfg=None) -> dict:
    """``comm.all_to_all_single`` with :data:`A2A_SIZES` on 4 ranks: row ``i`` of rank ``r``'s
    split for ``j`` holds ``100·r + i`` (three times); rank 2 sends and nothing at all."""
    sizes = A2A_SIZES[ctx.rank]
    rows = torch.cat([torch.arange(n, dtype=torch.float32) for n in sizes]) + 100 * ctx.rank
    x = rows[:, None].repeat(1, 3)
    recv = [A2A_SIZES[j][ctx.rank] for j in range(4)]
    out = torch.full((sum(recv), 3), -1.0)
    comm.all_to_all_single(out, x, recv, sizes, ctx.group)
    return {"rows": out[:, 0].long().tolist()}


def stage_batch(n_rows: int, seq: int = 16, d_model: int = 64) -> tuple:
    """Hidden states ``(n_rows, seq, H)`` entering the last stage, and byte targets."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(n_rows, seq, d_model, generator=g), torch.randint(0, 256, (n_rows, seq),
                                                                         generator=g)


def stage_step(ctx, cfg=None) -> dict:
    """The last of two pipeline stages of ``tiny-moe``, made expert-parallel in place; two rows
    per rank; dense gradients summed over the ranks; every gradient gathered to full names."""
    from labkit.config import PRESETS
    from labkit.models import build_model
    from labkit.parallel.expert import apply_expert_parallel, gather_full_state
    from labkit.parallel.expert.apply import expert_parameters
    from labkit.parallel.pipeline.stage import StageModule

    stage = StageModule(build_model(PRESETS["tiny-moe"], seed=0), 1, 2)
    info = apply_expert_parallel(stage, ctx.group)
    errors = []
    for again in (lambda: apply_expert_parallel(stage, ctx.group),):
        try:
            again()
        except ValueError as exc:
            errors.append(str(exc))
    set_aux_loss_scale(stage, 1.0 / ctx.world_size)
    h, y = stage_batch(2 * ctx.world_size)
    rows = slice(2 * ctx.rank, 2 * ctx.rank + 2)
    loss = StageModule.loss(stage(h[rows]), y[rows], "sum") / y.numel()
    loss.backward()
    experts = {id(p) for _, p in expert_parameters(stage)}
    for p in stage.parameters():
        if id(p) not in experts:
            comm.all_reduce(p.grad, "sum", ctx.group)
    return {"grads": gather_full_state(stage, ctx.group, grads=True),
            "params": gather_full_state(stage, ctx.group), "errors": errors,
            "names": [n for n, _ in expert_parameters(stage)], "n_local": info.n_local}
