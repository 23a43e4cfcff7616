"""Activation memory per GPU: Korthikanti et al. 2022's per-layer count, times what the
pipeline schedule keeps in flight (claims C17, C18).

**Per layer** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4), 16-bit activations, ``T = b·s`` tokens of a microbatch, written
here for any width so that GQA and SwiGLU fit; for GPT (``f = 4h``, ``k = a``, eager
attention, dropout) it is exactly their ``s·b·h·(34 + 5·a·s/h)``:

=====================  ====================================  ======================
part                   bytes                                 with ``t``-way TP
=====================  ====================================  ======================
norm inputs            ``2 · 2Th``                           replicated (÷t with SP)
QKV and MLP inputs     ``2Th + 2Th``                         replicated (÷t with SP)
dropout masks          ``Th + Th`` (1 byte each)             replicated (÷t with SP)
Q, K, V                ``2Tq + 4T·kv``                       ÷t
projection input       ``2Tq``                               ÷t
MLP inside             GELU ``4Tf``; SwiGLU ``8Tf``          ÷t
attention scores       eager ``5·a·s·T`` (2 softmax +        ÷t
                       1 mask + 2 dropout); flash: the
                       fp32 log-sum-exp ``4·a·T``
=====================  ====================================  ======================

GPT: ``10Th`` replicated + ``24Th/t`` + ``5as²b/t`` → ``sbh(10 + 24/t + 5as/(ht))``;
with sequence parallelism everything divides by ``t`` (``34·sbh/t`` without the scores).
**Selective** recomputation drops the attention-score part; **full** keeps only each
layer's input ``2Th`` (÷t with SP) and rebuilds one layer at a time in the backward.
Context parallelism shortens the local sequence to ``s/cp`` (scores: ``s/cp × s``).

**In flight** on pipeline rank ``i`` of ``p`` with ``m`` microbatches: GPipe all ``m``;
1F1B ``min(p − i, m)`` (Narayanan et al. 2021 §2.2.1); interleaved with ``V`` chunks
``min(m·V, 2(p − i − 1) + (V − 1)·p + 1)`` chunk-microbatches of ``L/(pV)`` layers —
rank 0 holds ``L·(1 + (p−1)/(pV))`` layers' worth (Korthikanti et al. 2022 §4.2.3).
Without a pipeline, microbatches run one after another: one in flight.
The last rank also keeps the output layer's fp32 logits ``4·T·V/t`` (ibid. §4.3).
"""
from __future__ import annotations

__all__ = ["layer_activation_bytes", "in_flight", "activation_bytes_per_rank"]


def _kv_local(model, tp: int) -> float:
    """K (or V) width on one TP rank: split when kv heads ≥ tp, else one head each."""
    return max(model.kv_dim / tp, model.head_dim)


def layer_activation_bytes(model, b: int, s_local: int, s_kv: int, tp: int = 1,
                           sp: bool = False) -> dict[str, float]:
    """Bytes one layer keeps for its backward for a microbatch of ``b`` sequences, without
    recomputation, on one of ``tp`` ranks.

    Args:
        model: a :class:`~labkit.plan.models.PlanModel`.
        b: sequences in the microbatch.
        s_local: query tokens of each sequence on this rank (``s/cp``).
        s_kv: key tokens each query attends over (``s``).
        tp: tensor-parallel degree ``t``.
        sp: sequence parallelism (shards the replicated part over ``t``).

    Returns:
        ``{"replicated", "split", "scores", "input", "total"}`` in bytes; ``input`` is the
        layer's input ``2Th`` (÷t with SP), what full recomputation keeps.
    """
    h, q, f = model.d_model, model.d_model, model.d_ff
    T = b * s_local
    rep = 2 * 2 * T * h + 2 * T * h + 2 * T * h + (2 * T * h if model.dropout else 0)
    if sp:
        rep /= tp
    kv = _kv_local(model, tp)
    inner = 4 * T * f if model.mlp == "gelu" else 8 * T * f
    split = 2 * T * q / tp + 4 * T * kv + 2 * T * q / tp + inner / tp
    heads = model.n_heads / tp
    if model.attention == "eager":
        scores = (5 if model.dropout else 2) * heads * T * s_kv
    else:
        scores = 4 * heads * T
    inp = 2 * T * h / (tp if sp else 1)
    return {"replicated": rep, "split": split, "scores": scores, "input": inp,
            "total": rep + split + scores}


def in_flight(schedule: str, pp: int, microbatches: int, rank: int = 0,
              virtual_stages: int = 1) -> float:
    """Microbatches whose activations pipeline rank ``rank`` holds at its peak, in units
    of the rank's whole stage (an interleaved chunk counts ``1/V``)."""
    m, p, v = microbatches, pp, virtual_stages
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v
    return float(min(p - rank, m))


def activation_bytes_per_rank(model, layout, layers_per_rank: list[int]) -> dict:
    """Peak activation bytes of each pipeline rank and the largest.

    Returns:
        ``{"per_rank": [...], "peak": bytes, "peak_rank": i, "in_flight": [...],
        "layer": layer_activation_bytes(...), "per_layer_kept": bytes}``.
    """
    s = layout.seq_len or model.seq_len
    t, sp = layout.tp, layout.sp
    lay = layer_activation_bytes(model, layout.microbatch, s // layout.cp, s, t, sp)
    kept = {"none": lay["total"], "selective": lay["total"] - lay["scores"],
            "full": lay["input"]}[layout.checkpoint]
    # full recomputation rebuilds one layer at a time: its whole activation set on top
    working = lay["total"] if layout.checkpoint == "full" else 0.0
    T = layout.microbatch * s // layout.cp
    head = 4 * T * model.vocab_size / t + 2 * T * model.d_model / (t if sp else 1)
    out, flights = [], []
    p = layout.pp
    for i in range(p):
        n = in_flight(layout.schedule, p, layout.microbatches, i, layout.virtual_stages)
        flights.append(n)
        b = kept * layers_per_rank[i] * n + working
        if i == p - 1:
            b += head
        out.append(b)
    peak = max(range(p), key=lambda i: out[i])
    return {"per_rank": out, "peak": out[peak], "peak_rank": peak, "in_flight": flights,
            "layer": lay, "per_layer_kept": kept}
