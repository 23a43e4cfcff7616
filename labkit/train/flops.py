"""Model FLOPs of one microbatch through this rank's part of the model, counted by torch.

:func:`rank_flops` builds a fresh copy of the rank's stages (the same stage ids, the same
checkpoint policy when hardware FLOPs are asked for) and runs one microbatch's forward and
backward under torch's ``FlopCounterMode`` (:func:`labkit.measure.flops.count_flops`, which
also counts CPU attention). A stage after the first takes a ``(b, S, H)`` activation that
requires grad, so its backward includes the input gradient, as in the pipeline. The count
is cached per shape in ``ctx.cache``, so a slider re-run of the same shape counts nothing.
With context parallelism a rank does ``1/cp`` of the sequence's work: the full-sequence count
divided by ``cp`` (exact for the matmuls; for attention the model-FLOP convention counts
every query-key pair, as SDPA's formula does).
"""
from __future__ import annotations

import torch

from ..measure.flops import count_flops
from ..models import build_model
from ..models.data import make_batch

__all__ = ["rank_flops"]


def rank_flops(ctx, setup, recompute: bool) -> int:
    """FLOPs of one microbatch's forward + backward through this rank's stages; with
    ``recompute`` the checkpoint policy's recomputation is included (hardware FLOPs)."""
    cfg = setup.cfg
    mc = cfg.model_config
    stage_ids = tuple(sorted(setup.stages))
    policy = cfg.checkpoint if recompute else "none"
    key = ("rank-flops", mc, cfg.micro, stage_ids, cfg.n_stages, policy, cfg.checkpoint_every,
           str(ctx.device))
    if key not in ctx.cache:
        ctx.cache[key] = _count(cfg, stage_ids, policy, ctx.device)
    # context parallelism splits every sequence: each rank computes 1/cp of the tokens'
    # matmuls and of the query-key pairs (model FLOPs, counted as if unmasked)
    return ctx.cache[key] // cfg.parallel.cp


def _count(cfg, stage_ids: tuple, policy: str, device) -> int:
    from ..parallel.pipeline.stage import StageModule

    mc = cfg.model_config
    model = build_model(mc, device=device, seed=cfg.seed)
    x, y = make_batch(cfg.replace(global_batch=cfg.micro, parallel=type(cfg.parallel)()), 0)
    x, y = x.to(device), y.to(device)
    if mc.kind == "vit":
        return count_flops(lambda: model(x, y).backward()).total
    stages = [StageModule(model, s, cfg.n_stages) for s in stage_ids]
    if policy != "none":
        from ..parallel.checkpoint.policy import apply_checkpoint_policy

        for m in stages:
            apply_checkpoint_policy(m, policy, cfg.checkpoint_every)

    def fwd_bwd():
        for m in stages:
            inp = x if m.is_first else torch.zeros(cfg.micro, mc.seq_len, mc.d_model,
                                                   device=device, requires_grad=True)
            out = m(inp)
            (m.loss(out, y) if m.is_last else out.sum()).backward()

    return count_flops(fwd_bwd).total
