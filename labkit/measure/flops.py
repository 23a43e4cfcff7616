"""Counting floating-point operations: measured with torch's counter, and analytic.

Two views of the same quantity, so a notebook can put them side by side (claim C21):

* :func:`count_flops` runs a callable under ``torch.utils.flop_counter.FlopCounterMode`` and
  returns the FLOPs of every matmul-like aten op it dispatched (mm, addmm, bmm, convolution,
  attention). Element-wise ops (norms, activations, residual adds, softmax) count zero, which
  is exactly the lecture's convention for model FLOPs.
* :func:`transformer_flops_per_token` / :func:`flops_per_token` give the textbook count:
  ``6·N`` per token for forward + backward (2 per multiply-add, backward ≈ 2× forward;
  Kaplan et al. 2020, §2.1) plus the attention-score term ``12·L·A·Q·T`` (PaLM, Chowdhery et
  al. 2022, Appendix B; the same two matmuls as Chinchilla, Hoffmann et al. 2022, Appendix F).

One FLOP here is one floating-point add or multiply, so an ``(m,k)@(k,n)`` matmul is
``2·m·k·n`` FLOP.

**CPU attention.** On CPU, ``F.scaled_dot_product_attention`` dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``..._backward``); torch 2.13 has no
FLOP formula for those, so the counter silently reports 0 for attention. Importing this module
registers formulas for both (once per process; skipped if a later torch ships its own):

* forward: the two matmuls ``QKᵀ`` and ``P·V``, ``2·B·H·S_q·S_k·D`` each (torch's
  ``sdpa_flop_count``, which also handles grouped-query attention);
* backward: exactly 2× the forward (``dP``, ``dV``, ``dQ``, ``dK``), i.e. *model* FLOPs.

Torch's own CUDA formulas for the flash/efficient kernels count the backward as 2.5× forward
(they add the recomputation of ``QKᵀ``), so on CUDA attention-backward counts are 25 % higher
than these: that extra is hardware FLOPs, not model FLOPs (seen on an H200 with torch 2.11,
where SDPA ran as ``aten._scaled_dot_product_cudnn_attention``: backward = 2.5× forward). Neither formula discounts
``is_causal=True`` (torch's convention); compare a causal model's count with
``transformer_flops_per_token(cfg, causal=False)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import flop_counter as _fc

from labkit.config import ModelConfig

__all__ = ["FlopCount", "count_flops", "transformer_flops_per_token", "flops_per_token",
           "matmul_params", "sdpa_cpu_flops"]

_aten = torch.ops.aten


def sdpa_cpu_flops(query_shape, key_shape, value_shape, backward: bool = False) -> int:
    """Model FLOPs of one attention call from shapes ``(B, H, S, D)``.

    Forward: ``QKᵀ`` + ``P·V`` = ``2·B·H·S_q·S_k·D_qk + 2·B·H·S_q·S_k·D_v``. Backward: 2× that.
    Key/value may have fewer heads than the query (GQA); FLOPs follow the query heads.

    Raises:
        AssertionError: (from torch) if the shapes are incompatible.
    """
    fwd = _fc.sdpa_flop_count(tuple(query_shape), tuple(key_shape), tuple(value_shape))
    return 2 * fwd if backward else fwd


def _cpu_flash_fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_cpu_flops(query_shape, key_shape, value_shape)


def _cpu_flash_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                   **kwargs) -> int:
    return sdpa_cpu_flops(query_shape, key_shape, value_shape, backward=True)


def _register_cpu_attention_formulas() -> None:
    """Register the CPU flash-attention formulas once (idempotent, safe on re-import)."""
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward",
                           _cpu_flash_bwd)):
        packet = getattr(_aten, name, None)
        if packet is None or packet in _fc.flop_registry:
            continue  # op absent in this torch, or already has a formula (ours or torch's)
        _fc.register_flop_formula(packet)(formula)


_register_cpu_attention_formulas()


@dataclass(frozen=True)
class FlopCount:
    """FLOPs counted while a callable ran.

    Attributes:
        total: all counted FLOPs (float-op count, not a rate).
        by_op: FLOPs per aten op packet name, e.g. ``{"aten.mm": 1024, ...}``.
        by_module: FLOPs per module name and op (``"Global"`` holds everything), as
            ``FlopCounterMode.get_flop_counts`` reports it, with op names as strings.
        result: what the callable returned.
    """

    total: int
    by_op: dict[str, int]
    by_module: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    result: Any = field(default=None, repr=False, compare=False)


def count_flops(fn: Callable[..., Any], *args, **kwargs) -> FlopCount:
    """Run ``fn(*args, **kwargs)`` under torch's FLOP counter and return what it counted.

    Put the backward inside ``fn`` to count it too, e.g.
    ``count_flops(lambda: model(x, y).backward())``. Ops without a registered formula
    (element-wise ops, copies) count 0.

    Returns:
        :class:`FlopCount` with ``total``, ``by_op``, ``by_module`` and ``result``.

    Raises:
        Whatever ``fn`` raises; the counter is exited cleanly first.
    """
    mode = _fc.FlopCounterMode(display=False)
    with mode:
        result = fn(*args, **kwargs)
    counts = mode.get_flop_counts()
    by_module = {mod: {str(op): int(n) for op, n in ops.items()} for mod, ops in counts.items()}
    by_op = dict(by_module.get("Global", {}))
    return FlopCount(total=int(mode.get_total_flops()), by_op=by_op, by_module=by_module,
                     result=result)


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul for every token, for labkit's models.

    Per block: ``Wq``, ``Wo`` (``H·H`` each), ``Wk``, ``Wv`` (``H·kv_heads·head_dim`` each, GQA)
    and the three SwiGLU matrices (``3·H·ffn_dim``). Plus, for ``kind="gpt"``, the output head
    ``H·vocab`` (a matmul even when tied to the embedding); for ``kind="vit"``, the patch
    embedding ``channels·patch²·H`` and the classifier ``H·n_classes`` spread over the
    ``seq_len`` tokens of an image. Embedding lookups, norms and biases are not matmuls and
    are excluded (Kaplan et al. 2020 §2.1 likewise counts non-embedding parameters).

    Raises:
        ValueError: if ``cfg`` fails :meth:`ModelConfig.validate`.
    """
    cfg.validate()
    h, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    per_block = 2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_dim
    n = cfg.n_layers * per_block
    if cfg.kind == "vit":
        n += cfg.channels * cfg.patch_size ** 2 * h + (h * cfg.n_classes) // cfg.seq_len
    else:
        n += h * cfg.vocab_size
    return n


def flops_per_token(n_params: float, *, n_layers: int = 0, n_heads: int = 0,
                    head_dim: int = 0, seq_len: int = 0, causal: bool = False,
                    backward: bool = True) -> dict[str, float]:
    """Training (or inference) FLOPs per token from an explicit parameter count ``N``.

    ``dense = 6·N`` (forward ``2·N`` + backward ``4·N``) and
    ``attention = 12·L·A·Q·T`` (PaLM, Chowdhery et al. 2022, Appendix B): the ``QKᵀ`` and
    ``P·V`` matmuls, ``4·A·Q·T`` FLOP per token per layer forward, ×3 with backward.
    ``causal=True`` halves the attention term (only the lower triangle is needed).
    ``backward=False`` gives forward-only FLOPs (``2·N`` and ``4·L·A·Q·T``).
    Leave the attention arguments at 0 to get the plain ``6·N`` rule.

    Example: GPT-2 small, ``N=124e6, L=12, A=12, Q=64, T=1024`` → dense 744e6,
    attention 113.2e6 (56.6e6 causal) FLOP per token.

    Returns:
        ``{"dense": ..., "attention": ..., "total": ...}`` in FLOP per token.

    Raises:
        ValueError: for negative arguments.
    """
    for name, v in (("n_params", n_params), ("n_layers", n_layers), ("n_heads", n_heads),
                    ("head_dim", head_dim), ("seq_len", seq_len)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    mult = 3 if backward else 1  # backward ≈ 2× forward
    dense = 2.0 * mult * n_params
    attention = 4.0 * mult * n_layers * n_heads * head_dim * seq_len
    if causal:
        attention /= 2
    return {"dense": dense, "attention": attention, "total": dense + attention}


def transformer_flops_per_token(cfg: ModelConfig, causal: bool = False,
                                backward: bool = True) -> dict[str, float]:
    """FLOPs per token of one training step of a labkit model, from its config.

    ``dense = 6·N`` with ``N = matmul_params(cfg)``; ``attention = 12·L·A·Q·T`` with
    ``A = n_heads`` (query heads), ``Q = head_dim``, ``T = seq_len``; halved when ``causal``.
    Multiply by tokens per step (``global_batch · seq_len``) for FLOPs per step. See
    :func:`flops_per_token` for the sources.

    Raises:
        ValueError: if ``cfg`` is invalid.
    """
    return flops_per_token(matmul_params(cfg), n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                           head_dim=cfg.head_dim, seq_len=cfg.seq_len, causal=causal,
                           backward=backward)
