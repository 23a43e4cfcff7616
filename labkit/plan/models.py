"""Model shapes the planner reasons about, their parameter counts and FLOPs.

A :class:`PlanModel` describes one decoder-only transformer by the numbers the cost model
needs: layers ``L``, hidden size ``h``, heads ``a`` (and key/value heads for grouped-query
attention), MLP width ``f`` and kind, vocabulary ``V``, sequence length ``s``, and the
implementation facts that change memory and time (eager attention that stores the
``a·s²`` score matrix, or fused flash attention that does not; dropout; biases).

A mixture-of-experts model (``n_experts = E > 0``) replaces every block's MLP with a
bias-free router ``h×E`` and ``E`` experts of the MLP's shape, each token going to
``top_k = k`` of them (Shazeer et al. 2017; Fedus et al. 2022, Switch Transformer §2;
labkit's ``tiny-moe``): the model holds all ``E`` experts, a token computes through the
router and ``k`` experts only.

Presets:

* the lab's own models and the Llama 3 herd, converted from ``labkit.config.PRESETS``
  (SwiGLU MLP, RMSNorm, grouped-query attention, flash attention, no dropout, no biases);
* Llama 3.2 1B (Meta's model card), the "about 1B parameters" of the scaling recipe (C19);
* GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12,288, 96 heads of 128,
  context 2,048; the GPT-2 BPE vocabulary of 50,257 tokens);
* the ten GPT models of Narayanan et al. 2021, Table 1 (``megatron-1.7b`` … ``megatron-1t``):
  GELU MLP of ``4h``, learned positions, biases, dropout, vocabulary 51,200, sequence 2,048;
* the recent models of CS336 Lecture 7's table (claim C43), with their published shapes:
  ``olmo-7b``, ``deepseek-67b``, ``deepseek-v3`` (mixture of experts), ``qwen-14b``,
  ``qwen1.5-moe-a2.7b`` (mixture of experts), ``gemma2-27b``. What the planner's shape
  cannot say is folded in and stated in each ``source`` (shared experts as experts every
  token visits; DeepSeek-V3's multi-head latent attention as plain multi-head attention).

FLOPs follow the conventions of :mod:`labkit.measure.flops` (one multiply-add is 2 FLOP,
backward ≈ 2× forward): model FLOPs per token ``6·N_matmul + 12·L·a·d·s`` (Kaplan et al.
2020 §2.1; PaLM, Chowdhery et al. 2022, Appendix B), non-causal; ``N_matmul`` counts the
weights one token multiplies by (for a mixture of experts: the router and ``k`` experts,
Fedus et al. 2022 §2: "sparsely activated"). For the GPT models this
equals Narayanan et al.'s Eq. 3 without the recomputation pass:
``72·B·s·L·h²·(1 + s/(6h)) + 6·B·s·h·V`` per step; :func:`narayanan_flops` is Eq. 3 itself.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

from labkit.config import PRESETS, ModelConfig

__all__ = ["PlanModel", "PLAN_MODELS", "plan_model", "narayanan_flops"]


@dataclass(frozen=True)
class PlanModel:
    """A decoder-only transformer as the planner sees it (all sizes in elements).

    Attributes:
        name: preset name.
        n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, seq_len: ``L, h, a, k,
            f, V, s``.
        mlp: ``"swiglu"`` (three ``h×f`` matrices) or ``"gelu"`` (two).
        attention: ``"flash"`` (fused kernel: no ``s²`` tensor stored, Dao et al. 2022) or
            ``"eager"`` (scores, softmax and dropout materialised: Korthikanti et al. 2022's
            ``5·a·s²·b`` bytes per layer).
        dropout: dropout after attention, projection and MLP (Megatron's GPT); adds the
            1-byte masks of Korthikanti et al. 2022, §4.1.
        bias: linear layers carry biases (counted as parameters, not as matmul FLOPs).
        norm: ``"rmsnorm"`` (``h`` weights) or ``"layernorm"`` (``2h``).
        learned_positions: a ``s×h`` position table (GPT) instead of rotary (Llama).
        tie_embeddings: the output head shares the input embedding.
        n_experts: ``E`` experts per block in place of the MLP (0: dense).
        top_k: experts each token is sent to (``k``; only with ``n_experts``).
        dense_layers: with experts, how many of the first blocks have a dense MLP of
            ``dense_d_ff`` instead (DeepSeek-V3's first three); they count in
            :attr:`params` and the FLOPs. Memory and expert parallelism treat every block
            as a mixture-of-experts block: the fullest pipeline stage holds no dense one.
        dense_d_ff: the hidden width of those dense MLPs.
        shared_experts: of the ``top_k``, how many are shared experts every token computes
            on its own rank (folded in as experts always chosen): they are not dispatched.
        core_head_dim: the per-head width the attention core multiplies by, where it is
            not ``h/a`` (multi-head latent attention: the mean of the query-key and value
            head widths); 0 = ``h/a``. Only the core's FLOPs use it.
        node_limit: node-limited routing (DeepSeek-V3 §2.1.2): a token's routed experts lie
            on at most this many servers of its expert-parallel group (0: no limit).
        source: where the shape comes from.
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    seq_len: int
    mlp: str = "swiglu"
    attention: str = "flash"
    dropout: bool = False
    bias: bool = False
    norm: str = "rmsnorm"
    learned_positions: bool = False
    tie_embeddings: bool = False
    n_experts: int = 0
    top_k: int = 1
    dense_layers: int = 0
    dense_d_ff: int = 0
    shared_experts: int = 0
    node_limit: int = 0
    core_head_dim: int = 0
    source: str = ""

    def __post_init__(self):
        for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                  "seq_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PlanModel.{f} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"PlanModel.d_model={self.d_model} does not divide by "
                             f"n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"PlanModel.n_heads={self.n_heads} does not divide by "
                             f"n_kv_heads={self.n_kv_heads}")
        e, k = self.n_experts, self.top_k
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ValueError(f"PlanModel.n_experts must be an int >= 0, got {e!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (e and k > e):
            raise ValueError(f"PlanModel.top_k must be an int in 1..n_experts={e}, got {k!r}")
        d, f = self.dense_layers, self.dense_d_ff
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= self.n_layers:
            raise ValueError(f"PlanModel.dense_layers must be an int in 0..n_layers="
                             f"{self.n_layers}, got {d!r}")
        if d and (not e or isinstance(f, bool) or not isinstance(f, int) or f < 1):
            raise ValueError(f"PlanModel.dense_layers={d} needs experts (n_experts={e}) and "
                             f"a dense_d_ff >= 1, got dense_d_ff={f!r}")
        if not 0 <= self.shared_experts < k or self.node_limit < 0:
            raise ValueError(f"PlanModel.shared_experts must be in 0..top_k-1={k - 1} and "
                             f"node_limit >= 0, got {self.shared_experts!r}, "
                             f"{self.node_limit!r}")
        for f, ok in (("mlp", ("swiglu", "gelu")), ("attention", ("flash", "eager")),
                      ("norm", ("rmsnorm", "layernorm"))):
            if getattr(self, f) not in ok:
                raise ValueError(f"PlanModel.{f} must be one of {ok}, got {getattr(self, f)!r}")

    # ---------------------------------------------------------------- shapes
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def core_dim(self) -> int:
        """Per-head width of the attention core's two matmuls (``core_head_dim`` or
        ``h/a``)."""
        return self.core_head_dim or self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): ``n_kv_heads · head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    # ---------------------------------------------------------------- parameters
    @property
    def attention_params(self) -> int:
        """``Wq, Wo`` (h·h) and ``Wk, Wv`` (h·kv_dim) of one block."""
        h = self.d_model
        return 2 * h * h + 2 * h * self.kv_dim

    @property
    def expert_params(self) -> int:
        """One MLP (or one expert): ``mlp_matrices · h · f``."""
        return self.mlp_matrices * self.d_model * self.d_ff

    @property
    def router_params(self) -> int:
        """The router of one block, ``h·E`` (0 for a dense model)."""
        return self.d_model * self.n_experts

    @property
    def layer_expert_params(self) -> int:
        """All experts of one block, ``E · mlp_matrices · h · f`` (0 for a dense model):
        what expert parallelism splits over ``ep``."""
        return self.n_experts * self.expert_params

    @property
    def layer_matmul_params(self) -> int:
        """Matmul weights one token multiplies by in one block: attention, and the MLP —
        or, with experts, the router and ``k`` experts (Fedus et al. 2022 §2)."""
        if self.moe:
            return self.attention_params + self.router_params + self.top_k * self.expert_params
        return self.attention_params + self.expert_params

    @property
    def layer_params(self) -> int:
        """All weights of one block: attention, the MLP (or the router and all ``E``
        experts), biases, two norms."""
        h = self.d_model
        mlp = self.router_params + self.layer_expert_params if self.moe else self.expert_params
        n = self.attention_params + mlp + 2 * (h if self.norm == "rmsnorm" else 2 * h)
        if self.bias:
            n += h + 2 * self.kv_dim + h + (self.mlp_matrices - 1) * self.d_ff + h
        return n

    @property
    def embedding_params(self) -> int:
        """Token table (+ position table), plus the output head when untied."""
        h = self.d_model
        n = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return n + (self.seq_len * h if self.learned_positions else 0)

    @property
    def params(self) -> int:
        """Every parameter: blocks, embeddings, head, final norm."""
        final_norm = self.d_model * (1 if self.norm == "rmsnorm" else 2)
        return (self.n_layers * self.layer_params + self.embedding_params + final_norm
                - self.dense_layers * (self._moe_mlp_params - self._dense_mlp_params))

    @property
    def _moe_mlp_params(self) -> int:
        return self.router_params + self.layer_expert_params

    @property
    def _dense_mlp_params(self) -> int:
        """One dense block's MLP (:attr:`dense_layers`), biases left out as in the experts'."""
        return self.mlp_matrices * self.d_model * self.dense_d_ff

    @property
    def head_matmul_params(self) -> int:
        """The output projection ``h·V`` (a matmul even when tied)."""
        return self.d_model * self.vocab_size

    # ---------------------------------------------------------------- FLOPs
    def attention_flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token of the score and value matmuls: ``12·L·a·d·s``
        (``QKᵀ`` and ``P·V``, ``4·a·d·s`` forward, ×3 with backward; non-causal, PaLM
        Appendix B)."""
        s = self.seq_len if seq_len is None else seq_len
        return 12.0 * self.n_layers * self.n_heads * self.core_dim * s

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Model FLOPs of one training token (forward + backward, no recomputation):
        ``6·(L·N_layer + h·V) + 12·L·a·d·s``, ``N_layer`` the weights the token multiplies
        by (:attr:`layer_matmul_params`: with experts the router and ``k`` experts)."""
        moe_mlp = self.router_params + self.top_k * self.expert_params
        dense = 6.0 * (self.n_layers * self.layer_matmul_params + self.head_matmul_params
                       - self.dense_layers * (moe_mlp - self._dense_mlp_params))
        return dense + self.attention_flops_per_token(seq_len)

    def with_seq_len(self, seq_len: int) -> "PlanModel":
        return replace(self, seq_len=int(seq_len))


def narayanan_flops(model: PlanModel, batch: int, seq_len: int | None = None) -> float:
    """FLOPs per iteration as Narayanan et al. 2021 count them (§5.1, Eq. 3):
    ``96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h))`` — GEMMs only, with full activation
    recomputation (four forward-equivalents per layer), for GPT models with a ``4h`` MLP."""
    s = model.seq_len if seq_len is None else seq_len
    L, h, V = model.n_layers, model.d_model, model.vocab_size
    return 96.0 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def _from_config(cfg: ModelConfig) -> PlanModel:
    return PlanModel(name=cfg.name, n_layers=cfg.n_layers, d_model=cfg.d_model,
                     n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads, d_ff=cfg.ffn_dim,
                     vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, mlp="swiglu",
                     attention="flash", tie_embeddings=cfg.tie_embeddings,
                     n_experts=cfg.n_experts, top_k=cfg.top_k if cfg.n_experts else 1,
                     source="labkit.config.PRESETS" + (
                         " (Llama 3 herd, Dubey et al. 2024, Table 3)"
                         if cfg.name.startswith("llama3") else ""))


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, source: str) -> PlanModel:
    return PlanModel(name=name, n_layers=layers, d_model=hidden, n_heads=heads,
                     n_kv_heads=heads, d_ff=4 * hidden, vocab_size=vocab, seq_len=2048,
                     mlp="gelu", attention="eager", dropout=True, bias=True, norm="layernorm",
                     learned_positions=True, tie_embeddings=True, source=source)


_NARAYANAN = "Narayanan et al. 2021, Table 1 (vocabulary 51,200, sequence 2,048, §5.1)"

#: Every model the planner knows by name.
PLAN_MODELS: dict[str, PlanModel] = {
    name: _from_config(cfg) for name, cfg in PRESETS.items() if cfg.kind == "gpt"}
PLAN_MODELS["llama3.2-1b"] = PlanModel(
    name="llama3.2-1b", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ff=8192,
    vocab_size=128256, seq_len=8192, tie_embeddings=True,
    source="Meta Llama 3.2 1B (model card / config: 16 layers, 2,048 hidden, 32 heads, "
           "8 KV heads, FFN 8,192, vocabulary 128,256, tied embeddings)")
PLAN_MODELS["gpt3-175b"] = _gpt("gpt3-175b", 96, 12288, 96, 50257,
                                "Brown et al. 2020, Table 2.1 (GPT-3 175B); GPT-2 BPE vocabulary")
for _name, _heads, _hidden, _layers in (
        ("1.7b", 24, 2304, 24), ("3.6b", 32, 3072, 30), ("7.5b", 32, 4096, 36),
        ("18b", 48, 6144, 40), ("39b", 64, 8192, 48), ("76b", 80, 10240, 60),
        ("146b", 96, 12288, 80), ("310b", 128, 16384, 96), ("530b", 128, 20480, 105),
        ("1t", 160, 25600, 128)):
    PLAN_MODELS[f"megatron-{_name}"] = _gpt(f"megatron-{_name}", _layers, _hidden, _heads,
                                            51200, _NARAYANAN)


def _recent(name: str, **kw) -> PlanModel:
    PLAN_MODELS[name] = PlanModel(name=name, **kw)
    return PLAN_MODELS[name]


_recent("olmo-7b", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008,
        vocab_size=50304, seq_len=2048, norm="layernorm",
        source="Groeneveld et al. 2024 (OLMo), Table 1: 32 layers, d_model 4,096, 32 heads, "
               "SwiGLU of 22,016 (two halves of 11,008), RoPE, non-parametric layer norm "
               "(counted here as a weighted one), no biases, untied, vocabulary 50,280 "
               "padded to 50,304, sequence 2,048")
_recent("deepseek-67b", n_layers=95, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=22016,
        vocab_size=102400, seq_len=4096,
        source="DeepSeek-AI 2024 (DeepSeek LLM), Table 2: 95 layers, d_model 8,192, 64 heads, "
               "8 KV heads (GQA), context 4,096; FFN 22,016 and vocabulary 102,400 from the "
               "released config")
_recent("deepseek-v3", n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128, d_ff=2048,
        vocab_size=129280, seq_len=4096, n_experts=256, top_k=9, shared_experts=1,
        node_limit=4, core_head_dim=160, dense_layers=3, dense_d_ff=18432,
        source="DeepSeek-AI 2024 (DeepSeek-V3 Technical Report) §4.2: 61 layers, hidden 7,168, "
               "128 heads, 1 shared + 256 routed experts of hidden 2,048, 8 routed per token, "
               "the first three layers dense (FFN 18,432, from the released config), "
               "vocabulary 129,280 (untied head), sequence 4,096; 671B parameters, 37B "
               "active, the multi-token-prediction module's 14B not included. Folded in: the "
               "shared expert as a ninth expert every token visits (its FLOPs exact, its 44M "
               "parameters per layer, 2.6B in all, left out), multi-head latent attention's "
               "projections as multi-head attention's (1.1B more parameters; its core "
               "multiplies by 128 heads of 192 query-key and 128 value widths: core_head_dim "
               "160, §2.1.1): 669.6B counted; node-limited routing to at most 4 nodes "
               "(§2.1.2)")
_recent("qwen-14b", n_layers=40, d_model=5120, n_heads=40, n_kv_heads=40, d_ff=13696,
        vocab_size=152064, seq_len=2048,
        source="Bai et al. 2023 (Qwen Technical Report), Table 1: 14B: hidden 5,120, 40 heads, "
               "40 layers, sequence 2,048; SwiGLU of 13,696 (8/3 of hidden, rounded), "
               "vocabulary 151,851 padded to 152,064, untied")
_recent("qwen1.5-moe-a2.7b", n_layers=24, d_model=2048, n_heads=16, n_kv_heads=16,
        d_ff=1408, vocab_size=151936, seq_len=8192, n_experts=64, top_k=8, shared_experts=4,
        source="Qwen team 2024, Qwen1.5-MoE-A2.7B (release notes and config): 24 layers, "
               "hidden 2,048, 16 heads, 60 routed experts of 1,408 with 4 per token and a "
               "shared expert of 5,632 (= 4 × 1,408) every token uses, folded in as 4 more "
               "experts always chosen: 64 experts, 8 per token; 14.3B parameters, 2.7B active")
_recent("gemma2-27b", n_layers=46, d_model=4608, n_heads=32, n_kv_heads=16, d_ff=36864,
        vocab_size=256128, seq_len=8192, tie_embeddings=True,
        source="Gemma Team 2024 (Gemma 2), Table 1: 27B: d_model 4,608, 46 layers, 32 heads, "
               "16 KV heads, GeGLU of 73,728 (two branches of 36,864), vocabulary 256,128, "
               "context 8,192, tied embeddings; head size 128 taken as d_model/heads = 144")


def plan_model(model: Union[str, PlanModel, ModelConfig], seq_len: int | None = None
               ) -> PlanModel:
    """A :class:`PlanModel` from a preset name, a ``ModelConfig`` or a ``PlanModel``;
    ``seq_len`` overrides the preset's sequence length.

    Raises:
        ValueError: an unknown name (listing the known ones), a ViT config, or a bad shape.
    """
    if isinstance(model, PlanModel):
        m = model
    elif isinstance(model, ModelConfig):
        if model.kind != "gpt":
            raise ValueError(f"the planner models decoder-only GPTs; {model.name!r} is a "
                             f"{model.kind!r}")
        model.validate()
        m = _from_config(model)
    else:
        try:
            m = PLAN_MODELS[str(model)]
        except KeyError:
            raise ValueError(f"unknown model {model!r}; known: "
                             f"{', '.join(sorted(PLAN_MODELS))}") from None
    if seq_len is not None:
        if isinstance(seq_len, bool) or int(seq_len) != seq_len or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        m = m.with_seq_len(int(seq_len))
    return m
