"""A small Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Follows §3.1 (eq. 1–4): non-overlapping patches linearly projected (a strided Conv2d is
exactly that projection), a learned class token prepended, learned 1-D position
embeddings added, pre-norm encoder blocks, and a linear head on the final class token.
The blocks are labkit's Llama-style ``Block`` with non-causal attention, so the norms are
RMSNorm and the MLP is SwiGLU rather than the paper's LayerNorm and GELU MLP.

``cfg.pool = "mean"`` drops the class token and classifies the mean of the normalised patch
tokens (global average pooling, the paper's Appendix D.3): the sequence is then the ``P``
patches alone, which is what splits evenly over context-parallel ranks. Two hooks let
:mod:`labkit.parallel.vision` split the tokens without changing the module's parameters:
``shard_tokens(x)`` cuts the ``(B, S, H)`` embedded sequence to this rank's tokens and
``reduce_pool(s)`` completes the per-rank token sum ``(B, H)``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from .gpt import ATTENTION_IMPLS, Block, RMSNorm, _target_device, init_weights

__all__ = ["ViT"]


class ViT(nn.Module):
    """Image classifier for ``cfg.kind == "vit"``.

    With ``P = (image_size / patch_size)²`` patches the encoder sees ``P + 1`` tokens
    (``P`` with ``cfg.pool = "mean"``).

    Attributes:
        patch_emb: Conv2d ``channels → d_model``, kernel = stride = ``patch_size``.
        cls_token: ``(1, 1, d_model)`` (``None`` with ``pool="mean"``); pos_emb:
            ``(1, n_tokens, d_model)``, ``n_tokens`` = ``P + 1`` (``P`` mean-pooled).
        layers: ``nn.ModuleList`` of non-causal ``Block``; norm: final RMSNorm;
        head: Linear ``d_model → n_classes`` (with bias).

    Raises:
        ValueError: invalid ``cfg``, ``kind != "vit"``, or unknown ``attention``.
    """

    def __init__(self, cfg: ModelConfig, attention: str = "sdpa", device=None, dtype=None):
        super().__init__()
        cfg.validate()
        if cfg.kind != "vit":
            raise ValueError(f"ViT needs ModelConfig.kind='vit', got {cfg.kind!r}")
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
        self.cfg = cfg
        self.n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.pool = cfg.pool
        #: tokens the encoder sees: the patches, plus the class token unless mean-pooled
        self.n_tokens = self.n_patches + (cfg.pool == "cls")
        #: parallel hooks (None = single process): see the module docstring
        self.shard_tokens = None
        self.reduce_pool = None
        target = _target_device(device)
        kw = dict(device="meta", dtype=dtype)  # materialised below, see _target_device
        self.patch_emb = nn.Conv2d(cfg.channels, cfg.d_model, cfg.patch_size,
                                   stride=cfg.patch_size, **kw)
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.d_model, **kw)) \
            if cfg.pool == "cls" else None
        self.pos_emb = nn.Parameter(torch.empty(1, self.n_tokens, cfg.d_model, **kw))
        self.layers = nn.ModuleList(Block(cfg, causal=False, attention=attention, **kw)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, **kw)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes, **kw)
        if target.type != "meta":
            self.to_empty(device=target)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw all weights from the current RNG: normal(0, 0.02) and zero biases,
        except LeCun-normal ``std = 1/sqrt(C·p²)`` for the patch projection."""
        init_weights(self)
        # the projection's fan-in is only C·p² (4 for digits), so std 0.02 would make patch
        # features ~50x smaller than unit scale: the image signal drowns under the class
        # token and the loss sits at ln(10) for tens of steps. LeCun-normal (as big_vision's
        # ViT) keeps patch features O(1).
        fan_in = self.patch_emb.in_channels * self.cfg.patch_size ** 2
        nn.init.normal_(self.patch_emb.weight, 0.0, fan_in ** -0.5)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, 0.0, 0.02)
        nn.init.normal_(self.pos_emb, 0.0, 0.02)

    def forward(self, images: torch.Tensor,
                targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``images`` float ``(B, C, H, W)`` → logits ``(B, n_classes)``, or with
        ``targets`` int64 ``(B,)`` the scalar mean cross-entropy (nats/sample).

        Raises:
            ValueError: ``images`` not ``(B, channels, image_size, image_size)``.
        """
        c, size = self.cfg.channels, self.cfg.image_size
        if images.dim() != 4 or tuple(images.shape[1:]) != (c, size, size):
            raise ValueError(f"images must be (B, {c}, {size}, {size}), got "
                             f"{tuple(images.shape)}")
        # contiguous: a transposed (B, P, H) view would keep the residual stream in that
        # layout, and every matmul would then save its own contiguous copy of its input
        x = self.patch_emb(images).flatten(2).transpose(1, 2).contiguous()   # (B, P, H)
        if self.cls_token is not None:
            # × 1.0 gives the class token a gradient of its own: cat's backward hands each
            # input a view of the (B, P+1, H) gradient, and with one image the expand is a
            # no-op, so the token's .grad would be that view and keep the whole gradient
            # (P+1 times its size) alive as model state
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1) * 1.0, x), dim=1)
        x = x + self.pos_emb
        if self.shard_tokens is not None:
            x = self.shard_tokens(x)                                 # (B, S_local, H)
        for layer in self.layers:
            x = layer(x)  # no rope: positions come from pos_emb
        if self.cls_token is not None:
            logits = self.head(self.norm(x[:, 0]))
        else:
            pooled = self.norm(x).sum(1)                             # (B, H), this rank's tokens
            if self.reduce_pool is not None:
                pooled = self.reduce_pool(pooled)
            logits = self.head(pooled / self.n_patches)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float(), targets)
