"""Jobs for tests/test_independent_counts.py (importable by the ranks)."""
from __future__ import annotations

import torch

from labkit.mesh import Mesh

VOCAB, TOKENS = 37, 24  # 37 divides by neither 2 nor 4: the vocabulary is padded


def ce_inputs(data_rank: int, scale: float = 3.0) -> tuple:
    """Logits ``(TOKENS, VOCAB)`` and targets of data rank ``data_rank`` (a quarter ignored)."""
    g = torch.Generator().manual_seed(100 + data_rank)
    logits = torch.randn(TOKENS, VOCAB, generator=g) * scale
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    targets[::4] = -100
    return logits, targets


def ce_on_tp_subgroups(ctx, spec: dict) -> dict:
    """dp=2 × tp=2 on 4 ranks: each tp pair shards its data rank's logits over the
    vocabulary (padding columns hold 1e4) and computes the vocab-parallel cross-entropy on
    its own tp group. Returns the loss, this rank's logit-shard gradient, its first column
    and its data rank."""
    from labkit.parallel.tensor import vocab_parallel_cross_entropy
    from labkit.parallel.tensor.vocab import padded_vocab

    mg = ctx.mesh_groups(Mesh(dp_shard=2, tp=2))
    t, d = mg.index("tp"), mg.index("dp_shard")
    logits, targets = ce_inputs(d)
    vp = padded_vocab(VOCAB, 2)
    full = torch.full((TOKENS, vp), 1e4)
    full[:, :VOCAB] = logits
    per = vp // 2
    local = full[:, t * per:(t + 1) * per].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, mg.group("tp"), vocab_start=t * per,
                                        vocab_size=VOCAB, label_smoothing=spec["smoothing"])
    loss.backward()
    return {"loss": loss.detach(), "grad": local.grad, "start": t * per, "data_rank": d,
            "tp_ranks": mg.ranks("tp")}


def bf16_combine(ctx, spec: dict) -> dict:
    """One MoE layer (tests/jobs_expert.py's case, top-2, 2 ranks) under bf16 autocast: this
    rank's tokens through the single-process combine (all experts, fp32 sum) and then
    through the expert-parallel dispatcher. Returns both outputs (fp32)."""
    from jobs_expert import LayerCase, build_case

    from labkit.parallel.expert import apply_expert_parallel

    case = LayerCase(ep=ctx.world_size, top_k=2, tokens=spec.get("tokens", 64))
    layer, x_all, _ = build_case(case)
    x = x_all[ctx.rank]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        dense = layer(x)
        apply_expert_parallel(layer, ctx.group)
        ep = layer(x)
    return {"dense": dense.float(), "ep": ep.float(), "dtype": str(ep.dtype)}
