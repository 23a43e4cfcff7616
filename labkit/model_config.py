"""The model's shape (:class:`ModelConfig`) and the named shapes labkit knows
(:data:`PRESETS`: the lab's tiny models, GPT-2 small, the Llama 3 herd for planning).

Imported from :mod:`labkit.config` as well, where :class:`~labkit.config.RunConfig` holds a
``ModelConfig`` (or a preset's name) as its ``model``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["ModelConfig", "PRESETS", "preset", "COUNT_ONLY"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (or, with ``kind="vit"``, a small ViT).

    Attributes:
        n_layers: transformer blocks ``L``.
        d_model: hidden size ``H`` (the lectures' channel dimension).
        n_heads: attention heads ``A``; ``d_model`` must divide by it.
        n_kv_heads: key/value heads for grouped-query attention (GQA, Ainslie et al. 2023);
            ``None`` means ``n_heads`` (plain multi-head attention).
        d_ff: SwiGLU hidden size; ``None`` takes Llama's rounding of ``8/3·d_model``.
        vocab_size: tokens; 256 for labkit's byte-level text.
        seq_len: context length ``S`` used for training and FLOP counting.
        tie_embeddings: share the input embedding and the output head.
        rope_theta: rotary base (Su et al. 2021, RoFormer §3.4).
        kind: ``"gpt"`` or ``"vit"``.
        image_size, patch_size, n_classes, channels: ViT only.
        n_experts: mixture-of-experts: each block's MLP becomes ``n_experts`` SwiGLU experts
            of hidden size ``ffn_dim`` and a router (Shazeer et al. 2017; Fedus et al. 2022,
            Switch Transformer); ``0`` keeps the dense MLP.
        top_k: experts each token is sent to (1 = Switch, 2 = GShard/Mixtral). Top-1 scales
            the expert output by its router probability (Switch Transformer §2.1); top-k ≥ 2
            renormalises the chosen probabilities to sum to 1 (Mixtral, Jiang et al. 2024
            §2.1).
        capacity_factor: each token group may send at most
            ``ceil(capacity_factor · top_k · tokens / n_experts)`` tokens to one expert; the
            rest are dropped (their residual passes through). ``None``: nothing is dropped.
        aux_loss_weight: weight of the load-balancing loss (Switch Transformer eq. 4).
    """

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    d_ff: Optional[int] = None
    vocab_size: int = 256
    seq_len: int = 64
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    kind: str = "gpt"
    image_size: int = 8
    patch_size: int = 2
    n_classes: int = 10
    channels: int = 1
    name: str = "custom"
    n_experts: int = 0
    top_k: int = 1
    capacity_factor: Optional[float] = None
    aux_loss_weight: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        hidden = int(2 * (4 * self.d_model) / 3)
        return 32 * ((hidden + 31) // 32)  # Llama rounds up to a multiple

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field if the shape cannot be built."""
        for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kind not in ("gpt", "vit"):
            raise ValueError(f"ModelConfig.kind must be 'gpt' or 'vit', got {self.kind!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.d_model={self.d_model} does not divide by n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} does not divide by n_kv_heads={self.kv_heads}")
        if self.kind == "vit" and self.image_size % self.patch_size:
            raise ValueError(f"ModelConfig.image_size={self.image_size} does not divide by "
                             f"patch_size={self.patch_size}")
        n, k, cf, w = self.n_experts, self.top_k, self.capacity_factor, self.aux_loss_weight
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"ModelConfig.n_experts must be an int >= 0 (0 = dense MLP), "
                             f"got {n!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"ModelConfig.top_k must be an int >= 1, got {k!r}")
        if n and k > n:
            raise ValueError(f"ModelConfig.top_k={k} exceeds n_experts={n}: a token cannot go "
                             f"to more experts than there are")
        if cf is not None and not (isinstance(cf, (int, float)) and not isinstance(cf, bool)
                                   and math.isfinite(cf) and cf > 0):
            raise ValueError(f"ModelConfig.capacity_factor must be None or a finite number > 0, "
                             f"got {cf!r}")
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                and w >= 0):
            raise ValueError(f"ModelConfig.aux_loss_weight must be a finite number >= 0, got {w!r}")


PRESETS: dict[str, ModelConfig] = {
    # a few ms per step on one CPU core: the default for notebooks and tests
    "tiny": ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64, name="tiny"),
    "small": ModelConfig(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, seq_len=128,
                         name="small"),
    # GPT-2 small shape (Radford et al. 2019), built here in the Llama style
    "gpt2-124m": ModelConfig(n_layers=12, d_model=768, n_heads=12, vocab_size=50257,
                             seq_len=1024, d_ff=3072, name="gpt2-124m"),
    # Llama 3 herd (Dubey et al. 2024, Table 3): for planning and counting only
    "llama3-8b": ModelConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                             vocab_size=128256, seq_len=8192, tie_embeddings=False,
                             rope_theta=500000.0, name="llama3-8b"),
    "llama3-70b": ModelConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                              vocab_size=128256, seq_len=8192, tie_embeddings=False,
                              rope_theta=500000.0, name="llama3-70b"),
    "llama3-405b": ModelConfig(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8,
                               d_ff=53248, vocab_size=128256, seq_len=8192,
                               tie_embeddings=False, rope_theta=500000.0, name="llama3-405b"),
    # "tiny" with each MLP replaced by 4 SwiGLU experts, two per token
    "tiny-moe": ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64, n_experts=4, top_k=2,
                            aux_loss_weight=0.01, name="tiny-moe"),
    # a small ViT for scikit-learn's 8x8 digits
    "vit-digits": ModelConfig(kind="vit", n_layers=2, d_model=64, n_heads=4, image_size=8,
                              patch_size=2, n_classes=10, channels=1, seq_len=16,
                              vocab_size=10, name="vit-digits"),
}

#: presets too large to build on one machine: planning and FLOP counting only
COUNT_ONLY = frozenset({"llama3-8b", "llama3-70b", "llama3-405b"})


def preset(name: str) -> ModelConfig:
    """Return the named ``ModelConfig``; ``ValueError`` lists the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: "
                         f"{', '.join(sorted(PRESETS))}") from None
