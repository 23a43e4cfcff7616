"""The single-process reference a parallel run is compared against (:func:`reference`): the
same model from the same seed, trained on the same global batches in one process, fp32, no
communication — and :func:`token_groups`, which groups its tokens as the ranks' forwards do
so a mixture of experts balances and caps them alike.
"""
from __future__ import annotations

import torch

from ..models import build_model
from ..models.data import make_batch


def token_groups(cfg) -> torch.Tensor:
    """Which forward of the parallel run sees each token of a global batch: int64
    ``(global_batch, S)``, one id per (data rank, microbatch, context rank). A
    mixture-of-experts layer's load-balancing loss and capacity are computed per group, so
    the single-process reference groups tokens exactly as the ranks do."""
    from ..parallel.context.layout import chunk_ids, n_chunks

    mc, p = cfg.model_config, cfg.parallel
    b, s = cfg.global_batch, mc.seq_len
    row = torch.arange(b)
    micro_id = (row % cfg.local_batch) // cfg.micro + (row // cfg.local_batch) * cfg.accum_steps
    owner = torch.zeros(s, dtype=torch.long)
    if p.cp > 1:
        chunk = s // n_chunks(p.cp, cfg.cp_zigzag)
        for r in range(p.cp):
            for c in chunk_ids(r, p.cp, cfg.cp_zigzag):
                owner[c * chunk:(c + 1) * chunk] = r
    return micro_id[:, None] * p.cp + owner[None, :]


def reference(cfg, device: str = "cpu") -> dict:
    """Single-process training on the same global batches: ``{"losses", "state",
    "grads"}`` — ``state`` the final parameters and ``grads`` the first step's gradients,
    by name (every name of the model, a tied head under both names).

    No communication, no wrapper, no checkpointing, fp32: the ground truth.
    """
    mc = cfg.model_config
    model = build_model(mc, device=device, seed=cfg.seed)
    if mc.n_experts:
        from ..models.moe import set_token_groups

        set_token_groups(model, token_groups(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            eps=cfg.adam_eps)
    losses, grads = [], {}
    for s in range(cfg.steps):
        x, y = make_batch(cfg, s)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        if s == 0:
            grads = {n: p.grad.detach().float().cpu().clone()
                     for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    state = {n: p.detach().float().cpu().clone()
             for n, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "state": state, "grads": grads}
