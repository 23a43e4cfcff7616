"""Activation memory per transformer block: measured, and C18's formula adjusted to this model.

**The lecture's formula** (Korthikanti et al. 2022, §4.1, Eq. 1; claim C18) counts the bytes a
GPT-3-style block saves for backward in fp16 with dropout: ``S·B·H·(34 + 5·A·S/H)`` — LayerNorm
inputs ``4SBH``, attention ``11SBH + 5AS²B`` (Q, K, V, softmax, its dropout mask and output,
the projection input, a dropout mask), MLP ``19SBH`` (input, GeLU input and output on ``4H``,
a dropout mask). Tensor parallelism divides what sits between the column and row matmuls
(``10SBH + 24SBH/T + 5AS²B/T``); sequence parallelism splits the rest (``34SBH/T + 5AS²B/T``);
selective recomputation of the attention core drops ``5AS²B`` (§5): ``34·S·B·H/T``.

**The same count for labkit's shapes** (:func:`megatron_block_terms`, by the block's four
parts; ``e`` bytes per activation, ``T`` = the tp degree, ``A_T = A/T`` query heads, ``K_T``
local K/V heads (``K/T``, or 1 when ``K < T``), ``F_T = F/T``, ``D`` the head size, per token
of the sequence attention sees, ``S/cp`` with context parallelism):

=============  ===============================================  ==========================
part           kept (elements per token)                        split by
=============  ===============================================  ==========================
``attn_norm``  its input ``H``                                  ``T`` with SP
``attn``       QKV input ``H``                                  ``T`` with SP
               Q ``A_T·D``; K, V ``K_T·D`` each (grouped-query  ``T``
               heads at their own width); the output, which is
               the projection's input, ``A_T·D``; flash
               attention's fp32 log-sum-exp ``A_T`` (4 bytes)
               — or, explicit softmax, its output ``A_T·S``
``mlp_norm``   its input ``H``                                  ``T`` with SP
``mlp``        input ``H``                                      ``T`` with SP
               SwiGLU's gate, up, silu and product ``4·F_T``    ``T``
=============  ===============================================  ==========================

For GPT-3's shapes (``F = 4H``, ``K = A``, explicit softmax) with its dropout masks
(``2·SBH`` + ``A·S²B``, 1 byte each) this is the lecture's ``34 + 5·A·S/H``: labkit has no
dropout, so the masks are not in labkit's count (``dropout=False`` in
:mod:`labkit.plan.activations`, which gives the same totals). Recomputing the attention core
keeps Q, K, V and the projection input only.

**What labkit keeps beyond it** (:func:`labkit_adjustments`, each term named): each RMSNorm's
fp32 ``1/rms`` (4 bytes per token; Megatron-LM's fused norms keep it too, the paper leaves it
out); under bf16 autocast over fp32 weights the residual stream, hence each norm's input, is
fp32 (4 bytes, not ``e``); sequence parallelism without ``regather`` keeps the gathered
``(S, H)`` inputs; the explicit ``"math"`` attention keeps its causal mask (``S²`` bytes) and,
below fp32, its fp32 softmax output beside the ``e``-byte copy. The block keeps nothing else:
:func:`labkit.models.norm.rms_norm` keeps the norm's input as given, one copy of each
matmul input (:func:`labkit.models.gpt.compute_dtype`), the K/V heads unrepeated, the
attention output once (:func:`labkit.models.gpt.heads`). With TP, SP (``regather``, what
the training job runs) and the core recomputed every term divides by ``T`` (when
``K ≥ T``): the adjusted ``34·S·B·H/T``.

The counting rule (:func:`measure_block_activations`): tensors saved for backward
(``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters, buffers and
autocast's casts of weights excluded; a part is charged for what is first saved while it
runs (so a block's input, saved by its first norm, is its own). Rotary tables indexed per
forward (sequence or context parallelism in a pipeline stage) are counted apart.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ...models.gpt import attention_core

__all__ = ["PARTS", "block_activation_formula", "block_activation_parts", "megatron_block_terms",
           "labkit_adjustments", "lecture_activation_bytes", "measure_block_activations",
           "recompute_attention_core"]

#: a block's children in the order they run; what each saves is charged to it
PARTS = ("attn_norm", "attn", "mlp_norm", "mlp")
ROTARY = "rotary tables"


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


def _shape(model_cfg, s: int, tp: int, sequence_parallel: bool, impl: str) -> tuple:
    if impl not in ("sdpa", "math"):
        raise ValueError(f"impl must be 'sdpa' or 'math', got {impl!r}")
    h, a, k, d, f = (model_cfg.d_model, model_cfg.n_heads, model_cfg.kv_heads,
                     model_cfg.head_dim, model_cfg.ffn_dim)
    if a % tp or f % tp or (k % tp and tp % k) or (sequence_parallel and s % tp):
        raise ValueError(f"heads={a}, kv_heads={k}, ffn={f}, seq={s} do not split over tp={tp}")
    return h, a // tp, max(k // tp, 1), d, f // tp


def megatron_block_terms(model_cfg, b: int, s: int, tp: int = 1, *,
                         sequence_parallel: bool = False, recompute: bool = False,
                         impl: str = "sdpa", bytes_per_elem: int = 2) -> dict:
    """Korthikanti et al. 2022's per-layer count (§4.1, §4.2.2, §5) for labkit's shapes and
    no dropout, by part: ``{part: bytes}`` over :data:`PARTS` (module docstring). ``b``
    sequences of ``s`` tokens (those attention sees on this rank: ``S/cp``); ``impl="sdpa"``
    is flash attention (log-sum-exp kept), ``"math"`` the explicit softmax (its output
    kept); ``recompute``: selective recomputation of the attention core.

    Raises:
        ValueError: ``impl`` unknown, or the shape does not split over ``tp``.
    """
    h, a_t, k_t, d, f_t = _shape(model_cfg, s, tp, sequence_parallel, impl)
    e, tokens = bytes_per_elem, b * s
    rep = tokens * h // (tp if sequence_parallel else 1)     # a norm's or a matmul's input
    attn = e * rep + e * tokens * (2 * a_t * d + 2 * k_t * d)
    if not recompute:
        attn += 4 * tokens * a_t if impl == "sdpa" else e * tokens * a_t * s
    return {"attn_norm": e * rep, "attn": attn, "mlp_norm": e * rep,
            "mlp": e * rep + e * tokens * 4 * f_t}


def labkit_adjustments(model_cfg, b: int, s: int, tp: int = 1, *,
                       sequence_parallel: bool = False, regather: bool = True,
                       recompute: bool = False, impl: str = "sdpa", bytes_per_elem: int = 2,
                       resid_bytes: int | None = None) -> dict:
    """What labkit's block keeps beyond :func:`megatron_block_terms`, by name:
    ``{term: {part: bytes}}`` (only the terms that are not zero here).

    ``resid_bytes``: bytes per element of the residual stream (default ``bytes_per_elem``;
    4 under bf16 autocast over fp32 weights, where the stream stays fp32). ``regather``:
    with SP, the column-parallel inputs are kept as the ``S/T`` shard (the training job's
    choice); otherwise gathered.
    """
    h, a_t, k_t, d, f_t = _shape(model_cfg, s, tp, sequence_parallel, impl)
    e, tokens = bytes_per_elem, b * s
    r = e if resid_bytes is None else resid_bytes
    norm_tokens = tokens // (tp if sequence_parallel else 1)
    out = {"1/rms per norm (fp32)": {"attn_norm": 4 * norm_tokens, "mlp_norm": 4 * norm_tokens}}
    if r != e:
        extra = (r - e) * norm_tokens * h
        out["fp32 residual stream (autocast): norm inputs"] = {"attn_norm": extra,
                                                               "mlp_norm": extra}
    if sequence_parallel and not regather and tp > 1:
        extra = e * (tokens - norm_tokens) * h
        out["gathered (S, H) matmul inputs (SP without regather)"] = {"attn": extra,
                                                                      "mlp": extra}
    if impl == "math" and not recompute:
        out["causal mask (bool, S² per layer)"] = {"attn": s * s}
        if e != 4:
            out["fp32 softmax output beside its copy"] = {"attn": 4 * tokens * a_t * s}
    return out


def block_activation_parts(model_cfg, b: int, s: int, tp: int = 1, *,
                           sequence_parallel: bool = False, regather: bool = True,
                           recompute: bool = False, impl: str = "sdpa",
                           bytes_per_elem: int = 2, resid_bytes: int | None = None) -> dict:
    """Bytes one block of labkit's GPT keeps for backward on one rank, by part:
    :func:`megatron_block_terms` plus :func:`labkit_adjustments` (same arguments).
    ``{part: bytes}`` over :data:`PARTS`."""
    parts = megatron_block_terms(model_cfg, b, s, tp, sequence_parallel=sequence_parallel,
                                 recompute=recompute, impl=impl, bytes_per_elem=bytes_per_elem)
    for term in labkit_adjustments(model_cfg, b, s, tp, sequence_parallel=sequence_parallel,
                                   regather=regather, recompute=recompute, impl=impl,
                                   bytes_per_elem=bytes_per_elem,
                                   resid_bytes=resid_bytes).values():
        for part, n in term.items():
            parts[part] += n
    return parts


def block_activation_formula(model_cfg, b: int, s: int, tp: int = 1, *,
                             sequence_parallel: bool = False, regather: bool = False,
                             recompute: bool = False, impl: str = "sdpa",
                             bytes_per_elem: int = 4) -> int:
    """Bytes one block of labkit's GPT saves for backward on one tp rank, all parts
    (:func:`block_activation_parts`; fp32 by default, the residual stream in the same
    dtype). ``b`` sequences of ``s`` tokens (the full sequence, also with sequence
    parallelism); ``recompute``: the attention core is recomputed in backward
    (:func:`recompute_attention_core`); ``impl``: ``"sdpa"`` or ``"math"``.

    Raises:
        ValueError: ``impl`` unknown, or the shape does not split over ``tp``.
    """
    return sum(block_activation_parts(model_cfg, b, s, tp, sequence_parallel=sequence_parallel,
                                      regather=regather, recompute=recompute, impl=impl,
                                      bytes_per_elem=bytes_per_elem).values())


def _from_weights(t: torch.Tensor) -> bool:
    """``t`` is a weight seen through casts, views or the tp ``f`` operator (autocast's
    bf16 copy of a parameter, a replicated K/V head's rows): its autograd history reaches a
    parameter's gradient accumulator through single-input nodes only."""
    node = t.grad_fn
    for _ in range(8):
        name = type(node).__name__ if node is not None else ""
        if name == "AccumulateGrad":
            return True
        nexts = [n for n, _ in node.next_functions if n is not None] if node is not None else []
        if not name.startswith(_WEIGHT_PATH) or len(nexts) != 1:
            return False
        node = nexts[0]
    return False


#: autograd nodes between a parameter and what a matmul reads of it
_WEIGHT_PATH = ("ToCopyBackward", "ViewBackward", "SliceBackward", "AliasBackward",
                "TBackward", "TransposeBackward", "IdentityFwdAllReduceBwdBackward",
                "SplitBackward", "SplitWithSizesBackward", "AsStridedBackward")


def measure_block_activations(model: nn.Module, idx: torch.Tensor, *, by_part: bool = False,
                              exclude: nn.Module | None = None) -> dict:
    """Run ``model(idx)`` forward and return the bytes saved for backward while each of
    ``model.layers`` ran: ``{block index: bytes}`` (plus ``None``: saved outside the blocks),
    or with ``by_part`` ``{block index: {part: bytes}}`` over :data:`PARTS` (and
    ``"rotary tables"``: fp32 ``(S, 1, D/2)`` rows indexed per forward; ``"other"``:
    saved by the block outside its four children). Each storage once; parameters, buffers
    (of ``model`` and of ``exclude``, e.g. ZeRO's flat units) and casts of weights excluded.
    Works on real and on fake tensors (storages are told apart by identity, not address).
    Run it under the autocast the model trains with. The graph is freed before returning."""
    owners = [model] + ([exclude] if exclude is not None else [])
    skip = {t.untyped_storage()._cdata for m in owners
            for t in list(m.parameters()) + list(m.buffers())}
    current: list = [None, None]
    seen: set = set()
    totals: dict = {}
    half = None
    blocks = [b for b in model.layers if hasattr(b, "attn")]
    if blocks:
        half = blocks[0].attn.head_dim // 2

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st._cdata
        if key in skip or key in seen or _from_weights(t):
            return t
        seen.add(key)
        part = current[1]
        if t.dtype == torch.float32 and t.dim() == 3 and t.shape[1] == 1 \
                and t.shape[2] == half:
            part = ROTARY
        if by_part:
            row = totals.setdefault(current[0], {})
            row[part] = row.get(part, 0) + st.nbytes()
        else:
            totals[current[0]] = totals.get(current[0], 0) + st.nbytes()
        return t

    def setter(i, part):
        return lambda *args: current.__setitem__(slice(None), [i, part])

    handles = []
    for i, block in enumerate(model.layers):
        handles.append(block.register_forward_pre_hook(setter(i, "other")))
        handles.append(block.register_forward_hook(setter(None, "other")))
        for name in PARTS:
            child = getattr(block, name, None)
            if child is not None:
                handles.append(child.register_forward_pre_hook(setter(i, name)))
                handles.append(child.register_forward_hook(setter(i, "other")))
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
