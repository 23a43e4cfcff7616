"""Causal (or encoder) self-attention with grouped-query K/V heads (Vaswani et al. 2017;
Ainslie et al. 2023), no biases: the module, the ``softmax(QKᵀ/√D + mask)V`` core that
tensor and context parallelism reuse or replace, and the helpers that keep one saved copy
of each activation (the input cast once for autocast, the heads as views).

Shapes use ``B`` batch, ``S`` sequence length, ``H`` = ``d_model``, ``A`` query heads,
``K`` key/value heads, ``D`` = ``head_dim``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..model_config import ModelConfig
from .rope import apply_rope


ATTENTION_IMPLS = ("sdpa", "math")


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype autocast would run its matmuls in (unchanged outside autocast).

    Autocast casts an activation anew for every matmul that reads it, and each matmul saves
    its own copy for backward: Q, K and V (or SwiGLU's gate and up) would keep three (two)
    copies of one input. Casting once before them leaves one (Megatron-LM's fused QKV keeps
    one input too; Korthikanti et al. 2022 §4.1 count it once). The values are the same."""
    dev = x.device.type
    # a device autocast does not know (meta) has no autocast to follow
    if x.is_floating_point() and torch.amp.is_autocast_available(dev) \
            and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


def heads(y: torch.Tensor, n: int, head_dim: int,
          rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """A projection's output ``(B, S, n·D)`` as heads ``(B, n, S, D)``, rotated by ``rope``
    (``(cos, sin)`` each ``(S, D/2)``) when given.

    The result is a transposed view of a ``(B, S, n, D)`` tensor: rotary runs before the
    transpose, so PyTorch's SDPA, which lays its output out like its query, returns the
    attention output as ``(B, S, A, D)`` in memory, and the output projection's input
    ``(B, S, A·D)`` is a view of the output SDPA keeps for backward, not a second copy
    (Korthikanti et al. 2022 §4.1 count the projection input once)."""
    b, s, _ = y.shape
    y = y.view(b, s, n, head_dim)
    if rope is not None:
        cos, sin = rope
        y = apply_rope(y, cos[:, None], sin[:, None])
    return y.transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query K/V heads and no biases.

    ``wq``: H→A·D, ``wk``/``wv``: H→K·D, ``wo``: A·D→H. Each group of ``A/K`` query heads
    shares one K/V head (Ainslie et al. 2023, §2); the K/V heads are never repeated in memory
    (:func:`attention_core`).

    Args:
        causal: mask future positions (decoder) or attend everywhere (ViT encoder).
        impl: ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"math"`` (explicit
            ``softmax(QKᵀ/√D + mask)V``, Vaswani et al. 2017 eq. 1) for teaching/parity.

    Raises:
        ValueError: unknown ``impl``.
    """

    def __init__(self, cfg: ModelConfig, causal: bool = True, impl: str = "sdpa",
                 device=None, dtype=None):
        super().__init__()
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.causal, self.impl = causal, impl
        kw = dict(bias=False, device=device, dtype=dtype)
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, **kw)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, **kw)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, **kw)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, **kw)
        #: ``core(q, k, v) -> out``: replaces :func:`attention_core` (context parallelism)
        self.core = None

    def forward(self, x: torch.Tensor,
                rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """``x`` ``(B, S, H)`` → ``(B, S, H)``; ``rope`` = ``(cos, sin)`` each ``(S, D/2)``.

        The attention itself is ``self.core(q, k, v)`` when set, else :func:`attention_core`:
        ``q`` ``(B, A, S, D)``, ``k``/``v`` ``(B, K, S, D)`` after rotary, before any
        grouped-query repeat; it returns ``(B, A, S, D)``.
        """
        b, s, _ = x.shape
        x = compute_dtype(x)
        q = heads(self.wq(x), self.n_heads, self.head_dim, rope)
        k = heads(self.wk(x), self.n_kv_heads, self.head_dim, rope)
        v = heads(self.wv(x), self.n_kv_heads, self.head_dim)
        if self.core is not None:  # context parallelism swaps in its own attention
            out = self.core(q, k, v)
        else:
            out = attention_core(q, k, v, self.causal, self.impl)
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   impl: str = "sdpa") -> torch.Tensor:
    """``softmax(QKᵀ/√D + mask)V`` (Vaswani et al. 2017, eq. 1), grouped-query aware.

    ``q`` ``(B, A, S, D)``; ``k``, ``v`` ``(B, K, S, D)`` with ``K`` dividing ``A``: each group
    of ``A/K`` consecutive query heads shares one K/V head (Ainslie et al. 2023, §2). The K/V
    heads are never repeated in memory: ``impl="sdpa"`` calls
    ``F.scaled_dot_product_attention`` with ``enable_gqa`` (its kernel reads each K/V head for
    its group; backward keeps ``q``, ``k``, ``v``, the output and the log-sum-exp, no
    probabilities), ``"math"`` the explicit formula with each group's queries stacked as
    ``(B, K, A/K·S, D)`` against their K/V head (it keeps the probabilities, ``A·S²``).
    Returns ``(B, A, S, D)``.
    """
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              enable_gqa=k.shape[1] != q.shape[1])
    b, a, s, d = q.shape
    n_kv, group = k.shape[1], a // k.shape[1]
    qg = q.reshape(b, n_kv, group * s, d)      # query head j·(A/K) + i reads K/V head j
    scores = ((qg @ k.transpose(-2, -1)) / math.sqrt(d)).view(b, n_kv, group, s, s)
    if causal:
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.float().softmax(dim=-1).type_as(q).view(b, n_kv, group * s, s)
    return (probs @ v).view(b, a, s, d)
