"""The analytic parameter count of labkit's models (:class:`labkit.models.gpt.GPT`,
:class:`labkit.models.vit.ViT`), with or without the embeddings (Kaplan et al. 2020, §2.1).
"""
from __future__ import annotations

from ..model_config import ModelConfig


def count_params(cfg: ModelConfig, include_embeddings: bool = True) -> int:
    """Analytic parameter count of ``GPT(cfg)`` (or ``ViT(cfg)`` for ``kind="vit"``).

    Equals ``sum(p.numel() for p in model.parameters())``, a tied head counted once; a
    mixture-of-experts model counts all ``n_experts`` experts and the routers.
    ``include_embeddings=False`` drops the token embedding and an untied output head
    (GPT), or the patch projection, class token and position table (ViT): the
    "non-embedding" count of Kaplan et al. 2020, §2.1.
    """
    h, hd = cfg.d_model, cfg.head_dim
    attn = h * cfg.n_heads * hd * 2 + h * cfg.kv_heads * hd * 2  # wq, wo; wk, wv
    mlp = 3 * h * cfg.ffn_dim * max(cfg.n_experts, 1) + h * cfg.n_experts  # experts, router
    block = attn + mlp + 2 * h                                   # two norms
    body = cfg.n_layers * block + h                              # + final norm
    if cfg.kind == "vit":
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        cls = cfg.pool == "cls"  # a class token, and its position (none when mean-pooled)
        embed = cfg.channels * cfg.patch_size ** 2 * h + h + cls * h + (n_patches + cls) * h
        return body + h * cfg.n_classes + cfg.n_classes + (embed if include_embeddings else 0)
    embed = cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2)
    return body + (embed if include_embeddings else 0)
