"""Llama-style decoder-only transformer (Touvron et al. 2023; Dubey et al. 2024).

Pieces: RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021,
RoFormer §3.4), SwiGLU feed-forward (Shazeer 2020), causal self-attention with optional
grouped-query attention (Ainslie et al. 2023), pre-norm residual blocks, no biases.
This module holds the feed-forward, the block and the model; attention
(:mod:`labkit.models.attention`), rotary tables (:mod:`labkit.models.rope`), the meta build
and initialisation (:mod:`labkit.models.weights`) and the analytic parameter count
(:mod:`labkit.models.count`) have their own modules, re-exported here.

Shapes use ``B`` batch, ``S`` sequence length, ``H`` = ``d_model``, ``A`` query heads,
``K`` key/value heads, ``D`` = ``head_dim``, ``V`` vocabulary, ``F`` = ``ffn_dim``.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model_config import ModelConfig
from .moe import MoE
from .norm import RMSNorm
# the pieces live in their own modules; every name stays importable from here (notebooks,
# tests, pickles and labkit.parallel name labkit.models.gpt)
from .attention import ATTENTION_IMPLS, Attention, attention_core, compute_dtype, heads
from .count import count_params
from .rope import apply_rope, rope_slice, rope_tables
from .weights import (INIT_STD, NotBuilt, _build_device, _kept_layers,  # noqa: F401
                      _target_device, init_weights)

__all__ = ["GPT", "Block", "NotBuilt", "Attention", "SwiGLU", "RMSNorm", "rope_tables",
           "apply_rope", "attention_core", "rope_slice", "count_params", "ATTENTION_IMPLS",
           "compute_dtype", "heads"]


class SwiGLU(nn.Module):
    """Gated feed-forward ``w2(silu(w1 x) * w3 x)`` (Shazeer 2020, eq. 6).

    ``w1`` (gate) and ``w3`` (up): H→F, ``w2`` (down): F→H, no biases. ``(B, S, H)`` in/out.
    """

    def __init__(self, d_model: int, ffn_dim: int, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.w1 = nn.Linear(d_model, ffn_dim, **kw)
        self.w3 = nn.Linear(d_model, ffn_dim, **kw)
        self.w2 = nn.Linear(ffn_dim, d_model, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = compute_dtype(x)  # one saved copy for w1 and w3 under autocast
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    ``(B, S, H)`` in/out. ``causal=False`` gives the encoder block that ``ViT`` uses.
    ``mlp`` is a :class:`SwiGLU`, or with ``cfg.n_experts > 0`` a mixture of experts
    (:class:`labkit.models.moe.MoE`).
    """

    def __init__(self, cfg: ModelConfig, causal: bool = True, attention: str = "sdpa",
                 device=None, dtype=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.attn = Attention(cfg, causal=causal, impl=attention, device=device, dtype=dtype)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        if cfg.n_experts:
            self.mlp = MoE(cfg, device=device, dtype=dtype)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Llama-style causal language model.

    Args:
        cfg: a ``ModelConfig`` with ``kind == "gpt"``.
        attention: ``"sdpa"`` or ``"math"`` (see ``Attention``); both agree to ~1e-6.
        device, dtype: where to build; ``device="meta"`` allocates nothing, for counting
            the Llama 3 presets. After ``to_empty``, call ``reset_parameters()``.
        layers: build only these blocks (indices into ``0 … n_layers−1``); every other
            slot of ``layers`` holds a :class:`NotBuilt` that refuses to run. Only where no
            weight has a value — under a ``FakeTensorMode`` or on ``meta`` — so a pipeline
            stage measured under fake tensors need not build the whole model; real weights
            always come from the whole model's seed.

    Raises:
        ValueError: invalid ``cfg`` (from ``cfg.validate()``), ``kind != "gpt"``, unknown
            ``attention``; ``layers`` outside ``0 … n_layers−1``, or given for real tensors.
    """

    def __init__(self, cfg: ModelConfig, attention: str = "sdpa", device=None, dtype=None,
                 layers: Optional[Iterable[int]] = None):
        super().__init__()
        cfg.validate()
        if cfg.kind != "gpt":
            raise ValueError(f"GPT needs ModelConfig.kind='gpt', got {cfg.kind!r}")
        self.cfg = cfg
        target = _target_device(device)
        device = _build_device(target)
        keep = _kept_layers(cfg.n_layers, layers, target)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, causal=True, attention=attention,
                                          device=device, dtype=dtype)
                                    if i in keep else NotBuilt(i)
                                    for i in range(cfg.n_layers))
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Block) and isinstance(layer.mlp, MoE):
                layer.mlp.layer_id = i  # routing records name their layer
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device,
                              dtype=dtype)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        # non-persistent: derived from cfg, so checkpoints stay pure parameters
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        #: global positions of this rank's tokens (int64 ``(S,)``), ``None`` = ``0 … S−1``
        self.positions: Optional[torch.Tensor] = None
        if device != target:
            self.to_empty(device=target)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw all weights from the current RNG and recompute the RoPE tables.

        Also re-ties the head, since ``to_empty`` (meta → real device) replaces each
        parameter separately and so unties them.
        """
        if self.cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        init_weights(self)
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta,
                               device=self.rope_cos.device)
        if not self.rope_cos.is_meta:  # meta tensors hold no values to fill
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor,
                targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids ``idx`` int64 ``(B, S)`` → logits ``(B, S, V)``, or with ``targets``
        int64 ``(B, S)`` the scalar mean cross-entropy (nats/token) over all ``B·S`` tokens.

        Raises:
            ValueError: ``idx`` not 2-D, ``S > cfg.seq_len``, or ``targets`` shape mismatch.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, S), got shape {tuple(idx.shape)}")
        s = idx.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"sequence length {s} exceeds cfg.seq_len={self.cfg.seq_len}")
        rope = rope_slice(self.rope_cos, self.rope_sin, s, self.positions)
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x, rope)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        if targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape "
                             f"{tuple(idx.shape)}")
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               targets.reshape(-1))
