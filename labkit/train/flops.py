"""Model FLOPs of one step on this rank: its share of the replica's work, counted and analytic.

One *replica* (the ranks that share one data-parallel index) splits a step's work three
ways: pipeline stages (each rank runs its own stages), tensor parallelism (``tp`` ranks each
run ``1/tp`` of every block's heads and SwiGLU columns, and ``1/tp`` of the vocabulary in the
head) and context parallelism (``cp`` ranks each run ``1/cp`` of the sequence's tokens
against all keys). A rank's model FLOPs are its share, so that the shares of the
``tp · cp · pp`` ranks of a replica add up to torch's ``FlopCounterMode`` count of the whole
model on the replica's batch — whatever the layout, a rank reports the work it took over,
not the replica's (before, each tp rank reported the whole replica's, and MFU doubled with
``tp=2``).

* :func:`rank_flops` counts this rank's stages on a fresh *unsharded* copy, one microbatch's
  forward and backward under ``FlopCounterMode`` (:func:`labkit.measure.flops.count_flops`,
  which also counts CPU attention), × microbatches per step, and takes this rank's part of
  the ``tp · cp`` ranks that hold the same stages (:func:`share`). A stage after the first
  takes a ``(b, S, H)`` activation that requires grad, so its backward includes the input
  gradient, as in the pipeline, and the stages' counts add up to the whole model's.
* :func:`rank_flops_analytic` is the same quantity from the config: per token and block
  ``2·(H·A·D + 2·H·K·D + A·D·H)`` for the projections, ``4·A·D·S`` for ``QKᵀ`` and ``P·V``
  over all ``S`` keys (dense: the counter and SDPA do not skip the masked half), SwiGLU
  ``6·H·F`` — or, with experts, ``top_k · 6·H·F`` plus the router's ``2·H·E`` — and the head's
  ``2·H·V`` on the last stage; backward is twice the forward (Kaplan et al. 2020, §2.1;
  attention as in Chowdhery et al. 2022, Appendix B, unmasked).

The split over ``tp · cp`` is an equal share of the stages' count. Tensor parallelism splits
every matmul of a dense block and the head; norms, embedding lookups and the loss are no
matmuls. What tp ranks *repeat* — an MoE layer stays whole on every tp rank, K/V projections
when ``kv_heads < tp``, padding rows of a vocabulary that does not divide by ``tp`` — is not
model work, so it is in neither count. With capacity-limited routing both counts are the
nominal work, every token's ``top_k`` choices whether dropped or not (MoE MFU is reported on
active parameters per token).
"""
from __future__ import annotations

import dataclasses

import torch

from ..measure.flops import count_flops
from ..models import build_model
from ..models.data import make_batch

__all__ = ["rank_flops", "rank_flops_analytic", "stage_flops_analytic", "share",
           "split_index"]


def share(total: int, parts: int, index: int) -> int:
    """Part ``index`` of ``total`` split into ``parts`` integers that add up to ``total``
    exactly: ``total // parts``, plus one for the first ``total % parts`` parts.

    Raises:
        ValueError: ``parts < 1`` or ``index`` outside ``0 … parts−1``.
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"need parts >= 1 and 0 <= index < parts, got parts={parts}, "
                         f"index={index}")
    q, r = divmod(int(total), parts)
    return q + (1 if index < r else 0)


def split_index(setup) -> tuple[int, int]:
    """``(this rank's index, number of ranks)`` among the ``tp · cp`` ranks that hold the same
    pipeline stages of one replica."""
    p = setup.cfg.parallel
    tp_i = setup.mg.index("tp") if p.tp > 1 else 0
    cp_i = setup.mg.index("cp") if p.cp > 1 else 0
    return tp_i * p.cp + cp_i, p.tp * p.cp


def rank_flops(ctx, setup, recompute: bool) -> int:
    """This rank's FLOPs of one step (FLOP): its share of the forward + backward of its stages
    over all microbatches; with ``recompute`` the checkpoint policy's recomputed forward is
    included (hardware FLOPs). The whole stages' count is cached per shape in ``ctx.cache``."""
    cfg = setup.cfg
    mc = cfg.model_config
    stage_ids = tuple(sorted(setup.stages))
    policy = cfg.checkpoint if recompute else "none"
    key = ("rank-flops", mc, cfg.micro, stage_ids, cfg.n_stages, policy, cfg.checkpoint_every,
           str(ctx.device))
    if key not in ctx.cache:
        ctx.cache[key] = _count(cfg, stage_ids, policy, ctx.device)
    index, parts = split_index(setup)
    return share(ctx.cache[key] * cfg.accum_steps, parts, index)


def stage_flops_analytic(mc, layers: int, last: bool, tokens: int) -> int:
    """Model FLOPs (forward + backward) of ``layers`` blocks, plus the head when ``last``, for
    ``tokens`` tokens of sequences of ``mc.seq_len`` (dense attention over every key).

    Raises:
        ValueError: for a ViT (``mc.kind != "gpt"``).
    """
    if mc.kind != "gpt":
        raise ValueError(f"stage_flops_analytic covers GPT models, got kind={mc.kind!r}")
    h, a, k, d, s = mc.d_model, mc.n_heads, mc.kv_heads, mc.head_dim, mc.seq_len
    proj = 2 * (h * a * d + 2 * h * k * d + a * d * h)
    scores = 4 * a * d * s                          # QKᵀ and P·V, every key
    mlp = 6 * h * mc.ffn_dim
    if mc.n_experts:
        mlp = mc.top_k * mlp + 2 * h * mc.n_experts  # top-k experts + the router
    forward = layers * (proj + scores + mlp) + (2 * h * mc.vocab_size if last else 0)
    return 3 * forward * tokens                     # backward = 2 × forward


def rank_flops_analytic(setup):
    """This rank's model FLOPs of one step from the config (the share :func:`rank_flops`
    counts); ``None`` for a ViT."""
    cfg = setup.cfg
    mc = cfg.model_config
    if mc.kind != "gpt":
        return None
    from ..parallel.pipeline.split import layer_ranges

    ranges = layer_ranges(mc.n_layers, cfg.n_stages)
    layers = sum(len(ranges[s]) for s in setup.stages)
    last = (cfg.n_stages - 1) in setup.stages
    total = stage_flops_analytic(mc, layers, last, cfg.micro * mc.seq_len) * cfg.accum_steps
    index, parts = split_index(setup)
    return share(total, parts, index)


def _count(cfg, stage_ids: tuple, policy: str, device) -> int:
    from ..parallel.pipeline.stage import StageModule

    # an MoE's model FLOPs are its nominal work, every token's k choices whether a capacity
    # drops them or not: the count then does not depend on which rows this rank routed
    mc = dataclasses.replace(cfg.model_config, capacity_factor=None)
    model = build_model(mc, device=device, seed=cfg.seed)
    x, y = make_batch(cfg.replace(global_batch=cfg.micro, parallel=type(cfg.parallel)()), 0)
    x, y = x.to(device), y.to(device)
    # the ViT is one stage (no pipeline): its blocks are checkpointed like a stage's, or its
    # hardware FLOPs would leave out the recomputation the job runs (labkit.train.build)
    stages = [model] if mc.kind == "vit" else \
        [StageModule(model, s, cfg.n_stages) for s in stage_ids]
    if policy != "none":
        from ..parallel.checkpoint.policy import apply_checkpoint_policy

        for m in stages:
            apply_checkpoint_policy(m, policy, cfg.checkpoint_every)
    if mc.kind == "vit":
        return count_flops(lambda: model(x, y).backward()).total

    def fwd_bwd():
        for m in stages:
            inp = x if m.is_first else torch.zeros(cfg.micro, mc.seq_len, mc.d_model,
                                                   device=device, requires_grad=True)
            out = m(inp)
            (m.loss(out, y) if m.is_last else out.sum()).backward()

    return count_flops(fwd_bwd).total
