"""Llama-style decoder-only transformer (Touvron et al. 2023; Dubey et al. 2024).

Pieces: RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021,
RoFormer §3.4), SwiGLU feed-forward (Shazeer 2020), causal self-attention with optional
grouped-query attention (Ainslie et al. 2023), pre-norm residual blocks, no biases.

Shapes use ``B`` batch, ``S`` sequence length, ``H`` = ``d_model``, ``A`` query heads,
``K`` key/value heads, ``D`` = ``head_dim``, ``V`` vocabulary, ``F`` = ``ffn_dim``.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from .moe import Experts, MoE
from .norm import RMSNorm

__all__ = ["GPT", "Block", "NotBuilt", "Attention", "SwiGLU", "RMSNorm", "rope_tables",
           "apply_rope", "attention_core", "rope_slice", "count_params", "ATTENTION_IMPLS",
           "compute_dtype", "heads"]

ATTENTION_IMPLS = ("sdpa", "math")
INIT_STD = 0.02  # GPT-2 / Llama reference initialisation


def rope_tables(seq_len: int, head_dim: int, theta: float = 10000.0,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos/sin tables (RoFormer §3.4.2), each float32 ``(seq_len, head_dim // 2)``.

    Frequency ``i`` is ``theta ** (-2i / head_dim)``; position ``m`` rotates pair ``i`` by
    ``m · freq_i`` radians.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                         / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rope_slice(cos: torch.Tensor, sin: torch.Tensor, s: int,
               positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the rotary tables attention uses: the first ``s``, or the rows
    ``positions`` (int64 ``(n,)``, the positions of the tokens attention sees on this rank)
    when they are not ``0 … s−1``: context parallelism's zigzag split, or sequence
    parallelism, where the residual stream holds ``s = n/tp`` tokens but attention all of
    them."""
    if positions is None:
        return cos[:s], sin[:s]
    return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, heads, S, D)`` by position; ``cos``/``sin`` are ``(S, D // 2)``.

    Uses the half-split pairing (dimension ``i`` with ``i + D/2``), as in the GPT-NeoX and
    Hugging Face Llama code; it is a fixed permutation of RoFormer's interleaved pairs, so
    relative-position behaviour is identical.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


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


def _target_device(device) -> torch.device:
    """Where a model should end up: ``device``, else the ambient default device.

    Models build their layers on ``meta`` and then ``to_empty`` onto this device before
    ``reset_parameters``: PyTorch's per-layer default inits never run, so the weights are a
    pure function of the RNG state at ``reset_parameters`` (a meta build followed by
    ``to_empty`` + ``reset_parameters`` gives the same weights), and nothing is drawn twice.
    """
    return torch.device(device) if device is not None else torch.get_default_device()


def _build_device(target: torch.device) -> torch.device:
    """Where layers are first built: ``meta`` (see :func:`_target_device`), or ``target``
    itself under a ``FakeTensorMode``, which allocates nothing anyway and cannot move its
    fake parameters with ``to_empty`` (it keeps weak references to them, so
    ``torch.utils.swap_tensors`` refuses; torch 2.13)."""
    from torch._guards import detect_fake_mode

    return target if detect_fake_mode() is not None else torch.device("meta")


class NotBuilt(nn.Module):
    """The slot of block ``index`` in a GPT built with ``layers=`` that leave it out: no
    parameters, and it refuses to run."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"block {self.index} was not built (GPT(layers=...) builds part "
                           "of a model for measuring one pipeline stage)")


def _kept_layers(n_layers: int, layers: Optional[Iterable[int]], target: torch.device
                 ) -> range | frozenset:
    if layers is None:
        return range(n_layers)
    from torch._guards import detect_fake_mode

    keep = frozenset(layers)
    bad = sorted(i for i in keep if isinstance(i, bool) or not isinstance(i, int)
                 or not 0 <= i < n_layers)
    if bad:
        raise ValueError(f"layers must be in 0..{n_layers - 1} (n_layers {n_layers}), got "
                         f"{bad}")
    if detect_fake_mode() is None and target.type != "meta":
        raise ValueError(f"layers={sorted(keep)} builds part of a model, which only fake or "
                         f"meta tensors may do: real weights come from the whole model's "
                         f"seed (device {target})")
    return keep


def init_weights(module: nn.Module, std: float = INIT_STD) -> None:
    """Normal(0, ``std``) for every Linear/Embedding weight, zero biases, ones for norms.

    Visits modules in registration order so the result is a pure function of the RNG state.
    A tied weight is visited twice; the second draw simply overwrites the first.
    """
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (RMSNorm, nn.LayerNorm)):
            nn.init.ones_(m.weight)
        elif isinstance(m, Experts):
            m.reset_parameters(std)


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
