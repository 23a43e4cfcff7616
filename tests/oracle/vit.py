"""A Vision Transformer written from the paper as plain functions over a ``{name: tensor}``
dict, for checking labkit's ViT (and its tensor/sequence/context-parallel runs) against.

Nothing here comes from ``labkit.models`` or ``labkit.parallel``. Parameter names follow
labkit's so its initial weights load by name. From Dosovitskiy et al. 2021 §3.1, eq. 1–4:

* patches: the image ``(B, C, H, W)`` cut into non-overlapping ``p×p`` patches with
  ``Tensor.unfold``, each flattened in (channel, row, column) order and multiplied by the
  projection ``(D, C·p·p)`` plus its bias — a linear map, not a convolution call;
* ``pool="cls"``: a learned class token prepended; ``"mean"``: none, and the classifier reads
  the mean of the final-normalised patch tokens (Appendix D.3, global average pooling);
* learned position embeddings added; pre-norm blocks ``x + attn(norm(x))``,
  ``x + mlp(norm(x))``; attention over **all** tokens, no mask and no rotary;
* RMSNorm, SwiGLU and grouped-query heads from :mod:`oracle.model` (labkit's blocks are
  Llama-style, see its docstring); a linear head with bias; mean cross-entropy.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.flop_counter import FlopCounterMode

from .model import rms_norm, swiglu

__all__ = ["vit_forward", "vit_initial_params", "vit_reference_run", "vit_reference_flops"]


def patches(images, p):
    """``(B, C, H, W)`` → ``(B, (H/p)·(W/p), C·p·p)``, row-major over the patch grid."""
    b, c, h, w = images.shape
    x = images.unfold(2, p, p).unfold(3, p, p)                    # (B, C, H/p, W/p, p, p)
    return x.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)


def bidirectional_attention(x, prm, pre, mc, meter=None):
    """Unmasked grouped-query self-attention of ``x`` ``(B, S, H)`` → ``(B, S, H)``;
    ``meter("attention_core")`` (a context manager) around ``QKᵀ`` and ``·V``."""
    b, s, _ = x.shape
    a, kv, d = mc.n_heads, mc.kv_heads, mc.d_model // mc.n_heads
    q = (x @ prm[pre + "wq.weight"].t()).view(b, s, a, d).transpose(1, 2)
    k = (x @ prm[pre + "wk.weight"].t()).view(b, s, kv, d).transpose(1, 2)
    v = (x @ prm[pre + "wv.weight"].t()).view(b, s, kv, d).transpose(1, 2)
    head_of = torch.arange(a) // (a // kv)
    k, v = k[:, head_of], v[:, head_of]
    with (meter or (lambda name: nullcontext()))("attention_core"):
        probs = (q @ k.transpose(-1, -2) / math.sqrt(d)).float().softmax(-1).to(q.dtype)
        out = probs @ v
    return out.transpose(1, 2).reshape(b, s, a * d) @ prm[pre + "wo.weight"].t()


def vit_forward(prm, mc, images, labels, meter=None, segment=None):
    """Mean cross-entropy (nats per image) of ``images`` ``(B, C, H, W)`` against ``labels``
    int64 ``(B,)``. ``meter``: see :func:`bidirectional_attention`; ``segment``: blocks per
    ``torch.utils.checkpoint`` segment (non-reentrant), ``None`` for none."""
    w = prm["patch_emb.weight"]                                   # (D, C, p, p)
    x = patches(images.float(), mc.patch_size) @ w.reshape(w.shape[0], -1).t() \
        + prm["patch_emb.bias"]
    if mc.pool == "cls":
        x = torch.cat((prm["cls_token"].expand(x.shape[0], -1, -1), x), dim=1)
    x = x + prm["pos_emb"]

    def run(x, first, last):
        for i in range(first, last):
            pre = f"layers.{i}."
            x = x + bidirectional_attention(
                rms_norm(x, prm[pre + "attn_norm.weight"], mc.norm_eps), prm, pre + "attn.",
                mc, meter)
            h = rms_norm(x, prm[pre + "mlp_norm.weight"], mc.norm_eps)
            x = x + swiglu(h, *(prm[pre + f"mlp.{n}.weight"] for n in ("w1", "w3", "w2")))
        return x

    step = segment or mc.n_layers
    for first in range(0, mc.n_layers, step):
        last = min(first + step, mc.n_layers)
        x = torch.utils.checkpoint.checkpoint(run, x, first, last, use_reentrant=False) \
            if segment else run(x, first, last)
    if mc.pool == "cls":
        feat = rms_norm(x[:, 0], prm["norm.weight"], mc.norm_eps)
    else:
        feat = rms_norm(x, prm["norm.weight"], mc.norm_eps).mean(1)
    logits = feat @ prm["head.weight"].t() + prm["head.bias"]
    return F.cross_entropy(logits.float(), labels)


def vit_initial_params(cfg) -> dict:
    """``{name: fp32 leaf requiring grad}`` from labkit's seeded initial ViT weights."""
    from labkit.models import build_model

    model = build_model(cfg.model_config, seed=cfg.seed)
    return {n: t.detach().float().clone().requires_grad_(True)
            for n, t in model.state_dict().items()}


def vit_reference_run(cfg, bf16: bool = False, bf16_weights: bool = False) -> dict:
    """Train ``cfg`` (a ViT on digits) for ``cfg.steps`` in one process with AdamW.

    Returns ``{"losses": [...], "grads": {name: first-step gradient before the optimizer},
    "state": {name: after training}}``. ``bf16``: the forward under bf16 autocast over the
    fp32 weights; ``bf16_weights``: the initial weights rounded to bf16 as well (as ZeRO's
    bf16 flat units hold them) — the yardsticks of a bf16 run (:mod:`oracle.check`)."""
    from labkit.models.data import make_batch

    p = vit_initial_params(cfg)
    if bf16_weights:
        with torch.no_grad():
            for t in p.values():
                t.copy_(t.bfloat16().float())
    opt = torch.optim.AdamW(list(p.values()), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            eps=cfg.adam_eps)
    out = {"losses": [], "grads": {}}
    for step in range(cfg.steps):
        x, y = make_batch(cfg, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = vit_forward(p, cfg.model_config, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            out["grads"] = {n: t.grad.detach().clone() for n, t in p.items()}
        opt.step()
        out["losses"].append(loss.item())
    out["state"] = {n: t.detach().clone() for n, t in p.items()}
    return out


def vit_reference_flops(cfg, replica: int = 0) -> dict:
    """torch's ``FlopCounterMode`` on one optimizer step of data replica ``replica`` (rows
    ``[d·B/dp, (d+1)·B/dp)`` of step 0) through forward and backward, as
    :func:`oracle.run.reference_flops` counts the GPT: ``{"model": FLOPs, "recompute": what
    activation checkpointing under ``cfg.checkpoint`` runs again}`` — ``"full"``/``"every"``
    the count under non-reentrant checkpoint segments of 1 or ``checkpoint_every`` blocks
    less the plain count; ``"selective"`` the attention core's forward (``QKᵀ``, ``·V``)."""
    from labkit.models.data import make_batch

    mc, dp = cfg.model_config, cfg.parallel.dp
    p = vit_initial_params(cfg)
    x, y = make_batch(cfg, 0)
    rows = slice(replica * cfg.global_batch // dp, (replica + 1) * cfg.global_batch // dp)
    x, y = x[rows], y[rows]

    def count(**kw) -> int:
        with FlopCounterMode(display=False) as c:
            vit_forward(p, mc, x, y, **kw).backward()
        return c.get_total_flops()

    total, recompute = count(), 0
    if cfg.checkpoint in ("full", "every"):
        recompute = count(segment=cfg.checkpoint_every if cfg.checkpoint == "every" else 1) \
            - total
    elif cfg.checkpoint == "selective":
        counters: list = []

        def meter(name):
            counters.append(FlopCounterMode(display=False))
            return counters[-1]
        with torch.no_grad():
            vit_forward(p, mc, x, y, meter=meter)
        recompute = sum(c.get_total_flops() for c in counters)
    return {"model": total, "recompute": recompute}
