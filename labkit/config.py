"""Frozen run configuration: model shape, parallel degrees, training knobs.

Every config is a frozen dataclass (picklable, hashable) so it can cross into rank
processes and be compared between runs. ``RunConfig.validate(world_size)`` raises
``ValueError`` naming the field and the numbers *before* any process is touched.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Optional

__all__ = ["ModelConfig", "ParallelConfig", "RunConfig", "PRESETS", "preset"]


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
        top_k: experts each token is sent to (1 = Switch, 2 = GShard/Mixtral); their router
            probabilities are renormalised over the chosen ``top_k``.
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


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of each parallelism. Their product is the number of ranks a job uses."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def validate(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class RunConfig:
    """One training job: what to train, how to split it, and what to measure.

    Attributes:
        model: a preset name or a ``ModelConfig``.
        parallel: the degrees; ``dp`` ranks each take ``global_batch / dp`` samples.
        global_batch: samples per optimizer step over all ranks.
        micro_batch: samples per forward/backward on one rank; ``global_batch / (dp ·
            micro_batch)`` microbatches are accumulated before the gradient sync.
        dp_mode: ``"ddp"`` (bucketed all-reduce from backward hooks) or ``"naive"``
            (all-reduce every gradient after backward) or ``"torch"`` (torch DDP).
        bucket_mb: DDP bucket capacity in MiB (PyTorch's default is 25).
        find_unused: all-reduce zeros for parameters that got no gradient instead of
            raising (torch DDP's ``find_unused_parameters``).
        measure_memory: track memory by category on the last step.
        count_flops: count matmul FLOPs with torch's FLOP counter (one extra step).
        timeout_s: seconds before a hung job is cancelled.
        return_state: rank 0 returns the final parameters (for parity checks).
        checkpoint: activation-checkpointing policy for the transformer blocks: ``"none"``,
            ``"full"``, ``"every"`` (segments of ``checkpoint_every`` blocks) or
            ``"selective"`` (:mod:`labkit.parallel.checkpoint_policy`).
        checkpoint_every: blocks per segment for ``checkpoint="every"``.
    """

    model: ModelConfig | str = "tiny"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    steps: int = 3
    global_batch: int = 8
    micro_batch: Optional[int] = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    dataset: str = "text"
    dp_mode: str = "ddp"
    bucket_mb: float = 25.0
    find_unused: bool = False
    measure_memory: bool = True
    count_flops: bool = True
    timeout_s: float = 120.0
    return_state: bool = False
    checkpoint: str = "none"
    checkpoint_every: int = 1

    @property
    def model_config(self) -> ModelConfig:
        return preset(self.model) if isinstance(self.model, str) else self.model

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.parallel.dp

    @property
    def micro(self) -> int:
        return self.micro_batch or self.local_batch

    @property
    def accum_steps(self) -> int:
        return self.local_batch // self.micro

    def replace(self, **changes) -> "RunConfig":
        """Copy with ``changes``; ``dp=`` etc. are routed into ``parallel``."""
        par = {k: changes.pop(k) for k in list(changes) if k in _PARALLEL_FIELDS}
        if par:
            changes["parallel"] = replace(changes.get("parallel", self.parallel), **par)
        return replace(self, **changes)

    def validate(self, world_size: Optional[int] = None) -> "RunConfig":
        """Check that this job can run on ``world_size`` ranks; return ``self``.

        Raises:
            ValueError: naming the field and the numbers, e.g. dp not dividing the ranks,
                a global batch not divisible by ``dp · micro_batch``, an unknown preset.
        """
        mc = self.model_config
        mc.validate()
        if isinstance(self.model, str) and self.model in COUNT_ONLY:
            raise ValueError(f"model preset {self.model!r} is for planning and counting only "
                             "(labkit.plan); train 'tiny', 'small' or 'gpt2-124m'")
        self.parallel.validate()
        p = self.parallel
        others = {k: getattr(p, k) for k in ("tp", "pp", "cp", "ep") if getattr(p, k) != 1}
        if others:
            raise ValueError(
                f"{', '.join(f'{k}={v}' for k, v in others.items())}: the training job runs "
                "data parallelism only (dp, ZeRO through labkit.parallel.zero_jobs); N-D "
                "composition is not available yet, and pipelines use "
                "labkit.parallel.pipeline (labkit run --pp)")
        if world_size is not None:
            if p.world_size > world_size:
                raise ValueError(f"parallel degrees need {p.world_size} ranks "
                                 f"(dp={p.dp} x tp={p.tp} x pp={p.pp} x cp={p.cp}) but the "
                                 f"cluster has world_size={world_size}")
            if world_size % p.dp:
                raise ValueError(f"dp={p.dp} does not divide the cluster's "
                                 f"world_size={world_size}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.global_batch % p.dp:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by dp={p.dp}: "
                             "every data-parallel rank needs the same number of samples")
        if self.global_batch % (p.dp * self.micro):
            raise ValueError(f"global_batch={self.global_batch} is not divisible by "
                             f"dp x micro_batch = {p.dp} x {self.micro} = {p.dp * self.micro}")
        if self.dp_mode not in ("ddp", "naive", "torch"):
            raise ValueError(f"dp_mode must be 'ddp', 'naive' or 'torch', got {self.dp_mode!r}")
        if not (isinstance(self.bucket_mb, (int, float)) and math.isfinite(self.bucket_mb)
                and self.bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a finite number > 0, got {self.bucket_mb!r}")
        if self.dataset not in ("text", "digits"):
            raise ValueError(f"dataset must be 'text' or 'digits', got {self.dataset!r}")
        if (self.dataset == "digits") != (mc.kind == "vit"):
            raise ValueError(f"dataset={self.dataset!r} does not fit model kind {mc.kind!r} "
                             "(text goes with gpt, digits with vit)")
        if self.checkpoint not in CHECKPOINT_POLICIES:
            raise ValueError(f"unknown checkpoint policy {self.checkpoint!r}; known: "
                             f"{', '.join(CHECKPOINT_POLICIES)}")
        if self.checkpoint == "every" and not 1 <= self.checkpoint_every <= mc.n_layers:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must satisfy 1 <= C <= "
                             f"n_layers={mc.n_layers}")
        check_optimizer_and_timeout(self)
        return self


def check_optimizer_and_timeout(cfg) -> None:
    """The fields every training config shares: ``lr`` > 0, ``weight_decay`` >= 0 (both
    finite), ``seed`` >= 0 and ``timeout_s`` > 0.

    Raises:
        ValueError: naming the field and the value.
    """
    if not (isinstance(cfg.lr, (int, float)) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {cfg.lr!r}")
    if not (isinstance(cfg.weight_decay, (int, float)) and math.isfinite(cfg.weight_decay)
            and cfg.weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {cfg.weight_decay!r}")
    if not isinstance(cfg.seed, int) or cfg.seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {cfg.seed!r}")
    if cfg.timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {cfg.timeout_s}")


#: mirrors labkit.parallel.checkpoint_policy.POLICIES (kept here so config needs no torch)
CHECKPOINT_POLICIES = ("none", "full", "every", "selective")
_PARALLEL_FIELDS = {f.name for f in dataclasses.fields(ParallelConfig)}
