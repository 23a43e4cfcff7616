"""Train and count with the independent model of :mod:`oracle.model`, one process, fp32.

Inputs only come from labkit: the initial weights (``labkit.models.build_model``, read as
a state dict by name) and the global batch of each step (``labkit.models.data.make_batch``).
The rest — token groups, forward, loss, gradients, AdamW, FLOPs — is computed here.

Token groups. A mixture-of-experts layer computes its load-balancing loss and capacity per
group of tokens that one forward of the parallel job sees: one (data rank, microbatch,
context rank). Data rank ``d`` owns rows ``[d·B/dp, (d+1)·B/dp)``, its microbatch ``m``
rows ``[m·b, (m+1)·b)`` of those; context rank ``r`` owns chunk ``r`` of ``cp`` contiguous
chunks of each sequence, or chunks ``r`` and ``2cp−1−r`` of ``2cp`` (zigzag). Each group's
aux loss enters the objective weighted by its share of the global batch's tokens.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.models import build_model
from labkit.models.data import make_batch

from .model import forward

__all__ = ["initial_params", "token_groups", "reference_run", "reference_flops"]


def initial_params(cfg) -> dict:
    """``{name: fp32 leaf tensor requiring grad}`` from labkit's seeded initial weights; a
    tied head is the same tensor as ``tok_emb.weight``."""
    model = build_model(cfg.model_config, seed=cfg.seed)
    state = {n: t.detach().float().clone() for n, t in model.state_dict().items()
             if not n.startswith("rope_")}
    p = {n: t.requires_grad_(True) for n, t in state.items()}
    if cfg.model_config.tie_embeddings:
        p["head.weight"] = p["tok_emb.weight"]
    return p


def token_groups(cfg) -> tuple:
    """``(ids int64 (global_batch, S), G)``: the forward that sees each token (module doc)."""
    p, s = cfg.parallel, cfg.model_config.seq_len
    local, micro = cfg.global_batch // p.dp, cfg.micro
    row = torch.arange(cfg.global_batch)
    fwd = (row // local) * (local // micro) + (row % local) // micro
    n_chunks = 2 * p.cp if (p.cp > 1 and cfg.cp_zigzag) else p.cp
    chunk = torch.arange(s) // (s // n_chunks)
    owner = torch.minimum(chunk, n_chunks - 1 - chunk) if n_chunks == 2 * p.cp else chunk
    ids = fwd[:, None] * p.cp + owner[None, :]
    return ids, cfg.global_batch // micro * p.cp


def _unique(p: dict) -> list:
    seen, out = set(), []
    for t in p.values():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def reference_run(cfg, steps: int | None = None, bf16: bool = False,
                  bf16_weights: bool = False) -> dict:
    """Train ``cfg`` for ``steps`` (default ``cfg.steps``) on the global batches.

    Returns ``{"losses": [LM loss], "objectives": [LM + weighted aux], "aux": [[per MoE
    layer]] (unweighted, Σ_g (T_g/T) aux_g), "counts"/"kept": [[per layer (E,) totals]],
    "grads": {name: first-step gradient before the optimizer}, "state": {name: after
    training}}`` — every name of the model, a tied head under both names. ``bf16``: the
    forward under bf16 autocast over the fp32 weights (to measure what bf16 alone changes);
    ``bf16_weights`` also rounds the initial weights to bf16, as ZeRO's bf16 flat units hold
    them (the regime in which a capacity's drop decisions flip differently).
    """
    mc = cfg.model_config
    p = initial_params(cfg)
    if bf16_weights:
        with torch.no_grad():
            for t in _unique(p):
                t.copy_(t.bfloat16().float())
    opt = torch.optim.AdamW(_unique(p), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            eps=cfg.adam_eps)
    groups, n_groups = token_groups(cfg)
    out = {"losses": [], "objectives": [], "aux": [], "counts": [], "kept": [], "grads": {}}
    for step in range(cfg.steps if steps is None else steps):
        x, y = make_batch(cfg, step)
        record: list = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            obj, lm, aux = forward(p, mc, x, y, groups, n_groups, record=record)
        opt.zero_grad(set_to_none=True)
        obj.backward()
        if step == 0:
            out["grads"] = {n: t.grad.detach().clone() for n, t in p.items()}
        opt.step()
        out["losses"].append(lm.item())
        out["objectives"].append(obj.item())
        out["aux"].append(aux.tolist())
        out["counts"].append([c.sum(0).tolist() for c, _ in record])
        out["kept"].append([k.sum(0).tolist() for _, k in record])
    out["state"] = {n: t.detach().clone() for n, t in p.items()}
    return out


def reference_flops(cfg, replica: int = 0) -> dict:
    """torch's ``FlopCounterMode`` on one optimizer step of data replica ``replica``: its
    local batch (rows ``[d·B/dp, (d+1)·B/dp)`` of step 0, grouped as the ranks group them)
    through forward and backward.

    Returns ``{"model": FLOPs, "recompute": what activation checkpointing under
    ``cfg.checkpoint`` runs again}``. ``"full"``/``"every"``: the count with each segment of
    blocks (1, or ``checkpoint_every``; segments never span pipeline stages, which the
    matrix keeps to one layer or one segment) under torch's non-reentrant checkpoint, less
    the plain count — torch stops recomputing once the tensors backward needs are back, so
    a segment's last output-only matmul is not run again. ``"selective"``: the attention
    core's forward (``QKᵀ`` and ``·V``), which the policy recomputes while keeping every
    other matmul output. Attention is counted dense (every query-key pair), as torch's
    counters count it.
    """
    # model FLOPs of an MoE are its nominal work: every token's k choices, dropped by a
    # capacity or not (6·N_active per token, as MoE MFU is reported), so the count does not
    # depend on which rows a replica routed
    mc, dp = dataclasses.replace(cfg.model_config, capacity_factor=None), cfg.parallel.dp
    p = initial_params(cfg)
    x, y = make_batch(cfg, 0)
    groups, n_groups = token_groups(cfg)
    rows = slice(replica * cfg.global_batch // dp, (replica + 1) * cfg.global_batch // dp)
    x, y, groups = x[rows], y[rows], groups[rows]

    def count(**kw) -> int:
        with FlopCounterMode(display=False) as c:
            forward(p, mc, x, y, groups, n_groups, **kw)[0].backward()
        return c.get_total_flops()

    total, recompute = count(), 0
    if cfg.checkpoint in ("full", "every"):
        recompute = count(segment=cfg.checkpoint_every if cfg.checkpoint == "every" else 1) \
            - total
    elif cfg.checkpoint == "selective":
        counters: list = []

        def meter(name):
            if name != "attention_core":
                return _Null()
            counters.append(FlopCounterMode(display=False))
            return counters[-1]
        with torch.no_grad():
            forward(p, mc, x, y, groups, n_groups, meter=meter)
        recompute = sum(c.get_total_flops() for c in counters)
    return {"model": total, "recompute": recompute}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
