"""Activation memory per transformer block: measured, and C18's formula adjusted to this model.

**The lecture's formula** (Korthikanti et al. 2022, §4.1, Eq. 1; claim C18) counts the bytes a
GPT-3-style block saves for backward in fp16 with dropout: ``S·B·H·(34 + 5·A·S/H)`` — LayerNorm
inputs ``4SBH``, attention ``11SBH + 5AS²B`` (Q, K, V, softmax, its dropout mask and output,
the projection input, a dropout mask), MLP ``19SBH`` (input, GeLU input and output on ``4H``,
a dropout mask). Tensor parallelism divides what sits between the column and row matmuls
(``10SBH + 24SBH/T + 5AS²B/T``); sequence parallelism splits the rest (``34SBH/T + 5AS²B/T``);
selective recomputation of the attention core drops ``5AS²B`` (§5): ``34·S·B·H/T``.

**Adjusted to labkit's GPT** (fp32, so 4 bytes per element; RMSNorm; SwiGLU of width ``F``;
no dropout; rotary; grouped-query K/V repeated to ``A`` heads before attention; SDPA's
flash kernel, or the explicit ``"math"`` attention). Elements saved per token of one block on
one rank, with ``T`` the tp degree, ``A_T = A/T`` query heads, ``K_T`` local K/V heads
(``K/T``, or 1 when ``K < T``), ``F_T = F/T``, ``D`` the head size:

=========================  ==============================  ==================================
what                       saved (elements per token)      split by
=========================  ==============================  ==================================
two RMSNorms               ``2·(2H + 1)``: input,          ``T`` with sequence parallelism
                           normalised input, ``1/rms``
Q/K/V and MLP inputs       ``2H`` (the norms' outputs)     ``T`` with SP and ``regather``
attention (SDPA)           ``4·A_T·D + A_T``: rotated Q,   ``T``
                           repeated K and V, output,
                           log-sum-exp
attention (math)           ``3·A_T·D + A_T·S`` (+ the      ``T``
                           causal mask, ``S²`` bytes)
attention, recomputed      ``A_T·D + 2·K_T·D``: the        ``T``
                           core's inputs only
output projection input    ``A_T·D`` (0 with SDPA and      ``T``
                           ``A_T = 1``: then it is a view
                           of the saved output)
SwiGLU                     ``4·F_T``: gate, up, silu,      ``T``
                           their product
=========================  ==============================  ==================================

So the block's fp32 bytes are ``4·S·B·(6H + 2 + 5·A·D + A + 4F)`` without parallelism (SDPA),
this model's ``34`` being ``4·(6H + 2 + 5AD + A + 4F)/H`` (≈ 86.7 at ``F = 8H/3``,
``AD = H``), and with TP, SP (``regather``) and attention recomputation every term is divided
by ``T`` (when ``K ≥ T``): the adjusted ``34·S·B·H/T``. The counting rule is the one
:class:`labkit.parallel.pipeline.stage.ActivationMeter` uses: tensors saved for backward
(``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters and buffers
excluded; a block is charged for what is saved while its forward runs (so its input, saved
by its first norm, is its own).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ...models.gpt import attention_core

__all__ = ["block_activation_formula", "lecture_activation_bytes", "measure_block_activations",
           "recompute_attention_core"]


def lecture_activation_bytes(s: int, b: int, h: int, a: int, tp: int = 1, *,
                             sequence_parallel: bool = False, recompute: bool = False) -> float:
    """C18 as the lecture states it (fp16 bytes, GPT-3 block): ``S·B·H·(34 + 5·A·S/H)``;
    with TP ``10SBH + 24SBH/T + 5AS²B/T``; with SP ``34SBH/T + 5AS²B/T``; recomputing the
    attention core drops the ``5AS²B`` term (Korthikanti et al. 2022, Table 2)."""
    sbh = s * b * h
    attn = 0.0 if recompute else 5 * a * s * s * b / tp
    if sequence_parallel:
        return 34 * sbh / tp + attn
    return 10 * sbh + 24 * sbh / tp + attn


def block_activation_formula(model_cfg, b: int, s: int, tp: int = 1, *,
                             sequence_parallel: bool = False, regather: bool = False,
                             recompute: bool = False, impl: str = "sdpa",
                             bytes_per_elem: int = 4) -> int:
    """Bytes one block of labkit's GPT saves for backward on one tp rank (see the module
    docstring for each term). ``b`` sequences of ``s`` tokens (the full sequence, also with
    sequence parallelism); ``recompute``: the attention core is recomputed in backward
    (:func:`recompute_attention_core`); ``impl``: ``"sdpa"`` or ``"math"``.

    Raises:
        ValueError: ``impl`` unknown, or the shape does not split over ``tp``.
    """
    if impl not in ("sdpa", "math"):
        raise ValueError(f"impl must be 'sdpa' or 'math', got {impl!r}")
    h, a, k, d, f = (model_cfg.d_model, model_cfg.n_heads, model_cfg.kv_heads,
                     model_cfg.head_dim, model_cfg.ffn_dim)
    if a % tp or f % tp or (k % tp and tp % k) or (sequence_parallel and s % tp):
        raise ValueError(f"heads={a}, kv_heads={k}, ffn={f}, seq={s} do not split over tp={tp}")
    a_t, k_t, f_t = a // tp, max(k // tp, 1), f // tp
    tokens = b * s
    sp = tp if sequence_parallel else 1
    elems = tokens * 2 * (2 * h + 1) // sp                        # two RMSNorms
    elems += tokens * 2 * h // (tp if sequence_parallel and regather else 1)
    mask_bytes = 0
    if recompute:
        elems += tokens * (a_t * d + 2 * k_t * d)
    elif impl == "sdpa":
        elems += tokens * (4 * a_t * d + a_t)
    else:
        elems += tokens * (3 * a_t * d + a_t * s)
        mask_bytes = s * s
    # wo input: a copy of the attention output (B, A_T, S, D) → (B, S, A_T·D), except that
    # with one local head the reshape is a view of the storage SDPA already saved
    if not (a_t == 1 and impl == "sdpa" and not recompute):
        elems += tokens * a_t * d
    elems += tokens * 4 * f_t                                     # SwiGLU
    return elems * bytes_per_elem + mask_bytes


def measure_block_activations(model: nn.Module, idx: torch.Tensor) -> dict:
    """Run ``model(idx)`` forward and return ``{block index: bytes}`` saved for backward
    while each of ``model.layers`` ran (plus ``None``: saved outside the blocks), each
    storage once, parameters and buffers excluded. The graph is freed before returning."""
    exclude = {t.untyped_storage().data_ptr()
               for t in list(model.parameters()) + list(model.buffers())}
    current: list = [None]
    seen: set = set()
    totals: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in exclude and ptr not in seen:
            seen.add(ptr)
            totals[current[0]] = totals.get(current[0], 0) + st.nbytes()
        return t

    handles = []
    for i, block in enumerate(model.layers):
        handles.append(block.register_forward_pre_hook(
            lambda m, inp, i=i: current.__setitem__(0, i)))
        handles.append(block.register_forward_hook(
            lambda m, inp, out: current.__setitem__(0, None)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(idx)
        del out
    finally:
        for hd in handles:
            hd.remove()
    return totals


class _RecomputeCore(torch.autograd.Function):
    """Keep only ``q, k, v`` and recompute the attention core in backward (Korthikanti et al.
    2022, §5, "selective activation recomputation": QKᵀ, softmax and attention over V)."""

    @staticmethod
    def forward(ctx, q, k, v, fn):
        ctx.fn = fn
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            return fn(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = ctx.fn(q, k, v)
        inputs = [t for t in (q, k, v) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, inputs, grad))
        return tuple(next(grads) if t.requires_grad else None for t in (q, k, v)) + (None,)


class _Core:
    def __init__(self, attn: nn.Module, inner):
        self.causal, self.impl, self.inner = attn.causal, attn.impl, inner

    def _run(self, q, k, v):
        if self.inner is not None:
            return self.inner(q, k, v)
        return attention_core(q, k, v, self.causal, self.impl)

    def __call__(self, q, k, v):
        if not torch.is_grad_enabled():
            return self._run(q, k, v)
        return _RecomputeCore.apply(q, k, v, self._run)


@contextmanager
def recompute_attention_core(model: nn.Module) -> Iterator[nn.Module]:
    """Within the ``with``, every block's attention core (``attn.core`` or the default
    :func:`labkit.models.gpt.attention_core`) saves only its inputs and is recomputed in
    backward. Restores the previous cores on exit."""
    saved = [(b.attn, b.attn.core) for b in model.layers]
    for attn, core in saved:
        attn.core = _Core(attn, core)
    try:
        yield model
    finally:
        for attn, core in saved:
            attn.core = core
