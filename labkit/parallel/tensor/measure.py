"""Tensor parallelism measured beside the lectures' formulas: bytes and model-state memory.

**Bytes per block** (claims C24–C26). Each transformer block has two tp regions (attention,
MLP), each entered by a column-parallel matmul and left by a row-parallel one. Without
sequence parallelism (Shoeybi et al. 2019, §3) the forward pass all-reduces each region's
``(B, S, H)`` output once (``g``) and backward all-reduces each region's input gradient once
(``f``): per block and pass two all-reduces of ``B·S·H`` elements, each moving
``2(T−1)/T · B·S·H·e`` bytes per rank (ring; ``e`` bytes per element), so a block costs
``8(T−1)/T · B·S·H·e`` bytes per step — the lecture's ``8·B·S·H`` per layer (C25, C33).
Nothing is communicated between a region's column and row matmul (C24). With sequence
parallelism (Korthikanti et al. 2022, §4.2.2) each all-reduce becomes an all-gather plus a
reduce-scatter of ``(T−1)/T · B·S·H·e`` each: the same bytes (C26). With ``regather`` backward
adds one all-gather per region. Outside the activations, backward also all-reduces the
gradients of weights every tp rank holds whole: the two norm weights (``H`` each) with
sequence parallelism, ``wk``/``wv`` (``K·D·H`` each) when ``K < T``.

**Model state** (parameters, gradients, AdamW's two moments, all fp32): split weights are
divided by ``T``; norm weights (and replicated K/V) are whole on every rank; the vocabulary is
padded to a multiple of ``T``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

__all__ = ["block_bytes_formula", "block_weight_grad_bytes", "tp_bytes_by_layer",
           "tp_state_bytes_formula", "measured_state_bytes", "tp_vs_pp_bytes"]

_ACT_SITES = ("attn_in", "attn_out", "mlp_in", "mlp_out")


def block_bytes_formula(b: int, s: int, h: int, tp: int, *, sequence_parallel: bool = False,
                        regather: bool = False, bytes_per_elem: int = 4) -> dict:
    """Activation bytes one rank sends per block per step: ``{"forward", "backward",
    "step"}`` (bytes; algorithmic ring counts, see :mod:`labkit.comm`).

    ``b·s`` tokens of width ``h`` (the *global* sequence ``s``, also with sequence
    parallelism). Without SP: 2 all-reduces per pass, ``2·2(T−1)/T·b·s·h·e``. With SP:
    2 all-gathers + 2 reduce-scatters per pass, the same; ``regather`` adds 2 all-gathers in
    backward. Degree 1 sends nothing.
    """
    unit = (tp - 1) / tp * b * s * h * bytes_per_elem   # one all-gather / reduce-scatter
    fwd = bwd = 4 * unit                                 # = two all-reduces of 2·unit
    if sequence_parallel and regather:
        bwd += 2 * unit
    return {"forward": fwd, "backward": bwd, "step": fwd + bwd}


def block_weight_grad_bytes(h: int, kv_dim: int, tp: int, kv_heads: int, *,
                            sequence_parallel: bool = False, bytes_per_elem: int = 4) -> float:
    """Bytes one rank sends per block per step all-reducing the gradients of weights held
    whole on every tp rank: the two RMSNorm weights with SP (``2·h``), ``wk`` and ``wv``
    (``2·kv_dim·h``, ``kv_dim = K·D``) when ``kv_heads < tp``."""
    elems = (2 * h if sequence_parallel else 0) + (2 * kv_dim * h if kv_heads < tp else 0)
    return 2 * (tp - 1) / tp * elems * bytes_per_elem


def tp_bytes_by_layer(events: Iterable, rank: int, step=None) -> dict:
    """Sum ``rank``'s tp trace events by block: ``{layer: {"forward", "backward",
    "weight_grads", "sequence"}}``, bytes sent. ``"forward"``/``"backward"`` count the four
    activation sites (``attn_in``, ``attn_out``, ``mlp_in``, ``mlp_out``); ``"weight_grads"``
    the whole-weight gradient all-reduces; ``"sequence"`` lists ``(phase, site, op)`` of the
    block's events in order (to see that nothing runs between a column and a row matmul).
    Events outside blocks (embedding, head, loss) are under the key ``None``."""
    out: dict = defaultdict(lambda: {"forward": 0.0, "backward": 0.0, "weight_grads": 0.0,
                                     "sequence": []})
    for e in events:
        if e.rank != rank or e.axis != "tp" or (step is not None and e.step != step):
            continue
        a = e.args
        if a.get("site") == "gather":
            continue
        row = out[a.get("layer")]
        row["sequence"].append((a.get("phase"), a.get("site"), e.op))
        if a.get("site") in _ACT_SITES:
            row[a["phase"]] += e.bytes_sent
        else:
            row["weight_grads"] += e.bytes_sent
    return dict(out)


def tp_state_bytes_formula(model_cfg, tp: int, *, n_layers: int | None = None,
                           embedding: bool = True, head: bool = True,
                           bytes_per_elem: int = 4, optimizer_states: int = 2) -> dict:
    """Model-state bytes on one tp rank: ``{"params", "grads", "optimizer", "total",
    "full_params"}`` (bytes). ``optimizer_states`` fp32 values per parameter (AdamW: 2; its
    step counters, one scalar tensor per parameter, are not counted).

    Per block: ``wq``, ``wo`` ``A·D·H/T`` each; ``wk``, ``wv`` ``K·D·H/T`` each (``K·D·H``
    when ``K < T``); ``w1``, ``w3``, ``w2`` ``F·H/T`` each; two norms ``H`` (whole). Plus the
    final norm ``H`` and the vocabulary table(s) ``V'/T·H`` (one when tied), ``V'`` the
    vocabulary padded to a multiple of ``T``. ``full_params`` is the unsplit model's bytes.
    """
    from .vocab import padded_vocab

    h, a, k, d, f = (model_cfg.d_model, model_cfg.n_heads, model_cfg.kv_heads,
                     model_cfg.head_dim, model_cfg.ffn_dim)
    L = model_cfg.n_layers if n_layers is None else n_layers
    kv = 2 * k * d * h // (tp if k >= tp else 1)
    block = 2 * a * d * h // tp + kv + 3 * f * h // tp + 2 * h
    tables = 1 if (model_cfg.tie_embeddings and embedding and head) else embedding + head
    vocab = tables * padded_vocab(model_cfg.vocab_size, tp) // tp * h
    final_norm = h if head else 0
    elems = L * block + final_norm + vocab
    full = (L * (2 * a * d * h + 2 * k * d * h + 3 * f * h + 2 * h) + final_norm
            + tables * model_cfg.vocab_size * h)
    p = elems * bytes_per_elem
    return {"params": p, "grads": p, "optimizer": optimizer_states * p,
            "total": (2 + optimizer_states) * p, "full_params": full * bytes_per_elem}


def measured_state_bytes(model: torch.nn.Module, optimizer=None) -> dict:
    """Bytes of ``model``'s parameters and gradients and of ``optimizer``'s tensor state
    with more than one element (AdamW's moments; not its scalar step counters), each
    storage counted once: ``{"params", "grads", "optimizer", "total"}``."""
    def total(tensors) -> int:
        seen, n = set(), 0
        for t in tensors:
            if t is None:
                continue
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                n += t.untyped_storage().nbytes()
        return n

    params = list(model.parameters())
    opt = []
    if optimizer is not None:
        opt = [v for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1]
    out = {"params": total(params), "grads": total(p.grad for p in params),
           "optimizer": total(opt)}
    out["total"] = sum(out.values())
    return out


def tp_vs_pp_bytes(b: int, s: int, h: int, n_layers: int, degree: int, *,
                   microbatches: int = 1, bytes_per_elem: int = 4) -> dict:
    """Bytes one rank sends per training step when ``degree`` ranks split the same model by
    tensor parallelism or by pipeline parallelism (claim C33), for a step of ``b``
    sequences of ``s`` tokens, width ``h``.

    * TP: every rank takes part in every block: ``n_layers · 8(T−1)/T · b·s·h·e``.
    * PP: a stage boundary carries one ``(b/m, s, h)`` activation forward and one gradient
      back per microbatch, so an inner stage sends ``2·b·s·h·e`` per step (``m``
      microbatches of ``b/m`` sequences); the first and last stages send half of that.

    Returns ``{"tp", "pp_inner", "pp_edge", "ratio"}`` (bytes; ``ratio = tp / pp_inner``,
    ``= 4·L·(T−1)/T``).
    """
    if b % microbatches:
        raise ValueError(f"batch {b} does not split into {microbatches} microbatches")
    tp = n_layers * block_bytes_formula(b, s, h, degree, bytes_per_elem=bytes_per_elem)["step"]
    mb = b // microbatches
    pp_inner = 2 * microbatches * mb * s * h * bytes_per_elem if degree > 1 else 0
    return {"tp": tp, "pp_inner": pp_inner, "pp_edge": pp_inner / 2,
            "ratio": tp / pp_inner if pp_inner else float("nan")}
