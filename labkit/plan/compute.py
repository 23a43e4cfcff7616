"""Time of one transformer layer on one GPU: a roofline over the layer's kernels.

Every kernel of a layer's forward pass is listed with its FLOPs and the HBM bytes it must
move; its time is the larger of the two limits (Williams et al. 2009, "Roofline"):

    t = max(FLOPs / (η_mm · peak), bytes / (η_mem · HBM bandwidth))

``η_mm`` is the GPU's maximum achievable matmul fraction, ``η_mem`` :data:`MEMORY_EFFICIENCY`
(:mod:`labkit.plan.runtime`). Kernels, for ``T`` local tokens, ``t``-way TP (``Tn`` is
``T·h``, divided by ``t`` with sequence parallelism):

* GEMMs ``(M, K, N)``: QKV ``(T, h, (h + 2kv)/t)``, output projection ``(T, h/t, h)``,
  MLP ``(T, h, f/t)`` ×1 (GELU) or ×2 (SwiGLU) and ``(T, f/t, h)``; bytes ``2(MK+KN+MN)``.
* attention, ``a/t`` heads over ``s_kv`` keys: eager (Megatron 2021) — the score GEMM and
  ``P·V`` as batched GEMMs, the fused scale–mask–softmax (read + write the scores) and the
  dropout (read, write, 1-byte mask); flash — one fused kernel, ``4·b·(a/t)·s_q·s_kv·d``
  FLOPs, reading Q, K, V and writing O only (Dao et al. 2022).
* mixture of experts (``E`` experts, top-``k``): the router GEMM ``(T, h, E)`` and the
  MLP GEMMs over the ``T·k`` routed rows with every expert's weights (whole on every tp
  rank, ``E/ep`` of them on the rank: balanced routing gives each rank ``T·k`` rows).
* memory-bound kernels: two norms (``4Tn`` bytes each), two residual adds (``6Tn``; with
  dropout fused in, ``7Tn``), the activation (GELU ``4T·f/t``, SwiGLU ``6T·f/t``), rotary
  on Q and K.

Backward: twice the forward for every kernel (a GEMM's input and weight gradients; a
memory-bound kernel reads the saved input and the incoming gradient and writes one), but
2.5× for flash attention, whose backward recomputes the scores (Dao et al. 2022 §3.1;
torch's FLOP formula for the flash backward). Recomputation repeats forward kernels: all
of them (``full``) or the attention core (``selective``, Korthikanti et al. 2022 §5).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.plan.runtime import MEMORY_EFFICIENCY

__all__ = ["Op", "layer_ops", "head_ops", "op_time", "ops_time", "ops_flops"]


@dataclass(frozen=True)
class Op:
    """One forward kernel: ``kind`` is ``"gemm"``, ``"attention"`` (the attention core)
    or ``"memory"``; ``core`` marks the attention-core kernels selective recomputation
    repeats."""

    name: str
    kind: str
    flops: float
    bytes: float
    core: bool = False


def _gemm(name: str, m: float, k: float, n: float, core: bool = False) -> Op:
    return Op(name, "gemm", 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n), core)


def layer_ops(model, b: int, s_local: int, s_kv: int, tp: int = 1, sp: bool = False,
              ep: int = 1) -> list[Op]:
    """The forward kernels of one layer for ``b`` sequences of ``s_local`` query tokens
    attending over ``s_kv`` keys, on one of ``tp`` ranks (and ``ep`` for the experts)."""
    h, f, d = model.d_model, model.d_ff, model.head_dim
    kv = max(model.kv_dim / tp, d)
    dc = model.core_dim  # the core's per-head width (MLA: wider than h/a)
    T = b * s_local
    tn = T * h / (tp if sp else 1)
    heads = model.n_heads / tp
    sc = b * heads * s_local * s_kv
    ops = [Op("norm1", "memory", 0.0, 4 * tn), _gemm("qkv", T, h, h / tp + 2 * kv)]
    if not model.learned_positions:
        ops.append(Op("rotary", "memory", 0.0, 2 * 2 * T * (h / tp + kv)))
    if model.attention == "eager":
        ops += [Op("scores", "gemm", 2 * sc * dc,
                   2 * (b * heads * (s_local + s_kv) * d + sc), core=True),
                Op("softmax", "memory", 0.0, 4 * sc, core=True)]
        if model.dropout:
            ops.append(Op("attn_dropout", "memory", 0.0, 5 * sc, core=True))
        ops.append(Op("pv", "gemm", 2 * sc * dc, 2 * (sc + b * heads * (s_local + s_kv) * d),
                      core=True))
    else:
        ops.append(Op("flash", "attention", 4 * sc * dc,
                      2 * (2 * T * h / tp + 2 * b * s_kv * kv), core=True))
    residual = 7 * tn if model.dropout else 6 * tn
    ops += [_gemm("proj", T, h / tp, h), Op("residual1", "memory", 0.0, residual),
            Op("norm2", "memory", 0.0, 4 * tn)]
    if getattr(model, "n_experts", 0):
        rows, local = T * model.top_k, model.n_experts / ep
        ops += [_gemm("router", T, h, model.n_experts)]
        width = f if model.mlp == "gelu" else 2 * f
        up, down = _gemm("experts_up", rows, h, width), _gemm("experts_down", rows, f, h)
        # every local expert's weights are read once, not once per row
        ops += [replace(up, bytes=up.bytes + 2 * (local - 1) * h * width),
                Op("expert_act", "memory", 0.0, (4 if model.mlp == "gelu" else 6) * rows * f),
                replace(down, bytes=down.bytes + 2 * (local - 1) * f * h)]
    elif model.mlp == "gelu":
        ops += [_gemm("fc1", T, h, f / tp), Op("gelu", "memory", 0.0, 4 * T * f / tp),
                _gemm("fc2", T, f / tp, h)]
    else:
        ops += [_gemm("w1_w3", T, h, 2 * f / tp), Op("swiglu", "memory", 0.0, 6 * T * f / tp),
                _gemm("w2", T, f / tp, h)]
    ops.append(Op("residual2", "memory", 0.0, residual))
    return ops


def head_ops(model, b: int, s_local: int, tp: int = 1, sp: bool = False) -> list[Op]:
    """The last stage's extra kernels: final norm, output projection to the vocabulary
    (split over ``tp``, Megatron's vocab-parallel head) and the cross-entropy over fp32
    logits (read 16-bit logits, write fp32 probabilities: ``6·T·V/t`` bytes)."""
    T = b * s_local
    h, V = model.d_model, model.vocab_size
    return [Op("final_norm", "memory", 0.0, 4 * T * h / (tp if sp else 1)),
            _gemm("head", T, h, V / tp),
            Op("cross_entropy", "memory", 0.0, 6 * T * V / tp)]


def op_time(op: Op, gpu, memory_efficiency: float = MEMORY_EFFICIENCY,
            backward: bool = False) -> float:
    """Roofline seconds of ``op`` (its backward when ``backward``) on ``gpu``."""
    mult = (2.5 if op.kind == "attention" else 2.0) if backward else 1.0
    compute = op.flops / (gpu.matmul_efficiency * gpu.peak_flops)
    memory = op.bytes / (memory_efficiency * gpu.hbm_bandwidth)
    return mult * max(compute, memory)


def ops_time(ops: list[Op], gpu, backward: bool = False, core_only: bool = False) -> float:
    """Sum of :func:`op_time` over ``ops`` (only the attention core if ``core_only``)."""
    return sum(op_time(o, gpu, backward=backward) for o in ops if o.core or not core_only)


def ops_flops(ops: list[Op], core_only: bool = False) -> float:
    """Forward FLOPs of ``ops``."""
    return sum(o.flops for o in ops if o.core or not core_only)
