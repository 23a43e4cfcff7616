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

import torch
import torch.nn.functional as F

from .model import rms_norm, swiglu

__all__ = ["vit_forward", "vit_initial_params", "vit_reference_run"]


def patches(images, p):
    """``(B, C, H, W)`` → ``(B, (H/p)·(W/p), C·p·p)``, row-major over the patch grid."""
    b, c, h, w = images.shape
    x = images.unfold(2, p, p).unfold(3, p, p)                    # (B, C, H/p, W/p, p, p)
    return x.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)


def bidirectional_attention(x, prm, pre, mc):
    """Unmasked grouped-query self-attention of ``x`` ``(B, S, H)`` → ``(B, S, H)``."""
    b, s, _ = x.shape
    a, kv, d = mc.n_heads, mc.kv_heads, mc.d_model // mc.n_heads
    q = (x @ prm[pre + "wq.weight"].t()).view(b, s, a, d).transpose(1, 2)
    k = (x @ prm[pre + "wk.weight"].t()).view(b, s, kv, d).transpose(1, 2)
    v = (x @ prm[pre + "wv.weight"].t()).view(b, s, kv, d).transpose(1, 2)
    head_of = torch.arange(a) // (a // kv)
    k, v = k[:, head_of], v[:, head_of]
    probs = (q @ k.transpose(-1, -2) / math.sqrt(d)).float().softmax(-1).to(q.dtype)
    return (probs @ v).transpose(1, 2).reshape(b, s, a * d) @ prm[pre + "wo.weight"].t()


def vit_forward(prm, mc, images, labels):
    """Mean cross-entropy (nats per image) of ``images`` ``(B, C, H, W)`` against ``labels``
    int64 ``(B,)``."""
    w = prm["patch_emb.weight"]                                   # (D, C, p, p)
    x = patches(images.float(), mc.patch_size) @ w.reshape(w.shape[0], -1).t() \
        + prm["patch_emb.bias"]
    if mc.pool == "cls":
        x = torch.cat((prm["cls_token"].expand(x.shape[0], -1, -1), x), dim=1)
    x = x + prm["pos_emb"]
    for i in range(mc.n_layers):
        pre = f"layers.{i}."
        x = x + bidirectional_attention(rms_norm(x, prm[pre + "attn_norm.weight"], mc.norm_eps),
                                        prm, pre + "attn.", mc)
        h = rms_norm(x, prm[pre + "mlp_norm.weight"], mc.norm_eps)
        x = x + swiglu(h, *(prm[pre + f"mlp.{n}.weight"] for n in ("w1", "w3", "w2")))
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


def vit_reference_run(cfg) -> dict:
    """Train ``cfg`` (a ViT on digits) for ``cfg.steps`` in one process with AdamW.

    Returns ``{"losses": [...], "grads": {name: first-step gradient before the optimizer},
    "state": {name: after training}}``."""
    from labkit.models.data import make_batch

    p = vit_initial_params(cfg)
    opt = torch.optim.AdamW(list(p.values()), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            eps=cfg.adam_eps)
    out = {"losses": [], "grads": {}}
    for step in range(cfg.steps):
        x, y = make_batch(cfg, step)
        loss = vit_forward(p, cfg.model_config, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            out["grads"] = {n: t.grad.detach().clone() for n, t in p.items()}
        opt.step()
        out["losses"].append(loss.item())
    out["state"] = {n: t.detach().clone() for n, t in p.items()}
    return out
