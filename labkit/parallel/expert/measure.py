"""Expert-parallel numbers: load per expert, imbalance, and all-to-all bytes beside the formula.

Formula (exact, from the routed counts). Let ``C[j, e]`` be the choices rank ``j`` keeps
for expert ``e`` in one layer's forward, ``H`` the hidden size, ``b`` bytes per element, and
``L(r)`` the experts of rank ``r``. Then rank ``r`` sends

* dispatch: ``Σ_{e ∉ L(r)} C[r, e] · H · b`` (its rows for other ranks' experts),
* combine: ``Σ_{j ≠ r} Σ_{e ∈ L(r)} C[j, e] · H · b`` (the outputs of the rows it received),

and receives the other one of the two. Backward runs each all-to-all in reverse, so the
backward's sent bytes are the forward's received bytes. The count exchange sends
``(P−1)/P · E`` int64 per layer. With a balanced router ``C[j, e] = k·T/E``, and rank ``r``
sends ``(P−1)/P · k · T · H · b`` per all-to-all: the lectures' ``(N−1)/N · S``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional, Sequence

__all__ = ["a2a_bytes_formula", "a2a_bytes_from_trace", "a2a_bytes_expected", "imbalance",
           "tokens_per_expert", "expert_numel"]


def imbalance(counts: Sequence[float]) -> float:
    """``max / mean`` of per-expert loads (1.0 = perfectly balanced; ``E`` = all on one
    expert); 1.0 for an empty layer."""
    counts = [float(c) for c in counts]
    mean = sum(counts) / len(counts) if counts else 0.0
    return max(counts) / mean if mean > 0 else 1.0


def tokens_per_expert(per_rank: Sequence[Sequence[int]]) -> list:
    """Per-expert totals over ranks of a ``[rank][expert]`` table."""
    return [sum(col) for col in zip(*per_rank)] if per_rank else []


def a2a_bytes_formula(counts: Sequence[Sequence[int]], rank: int, d_model: int,
                      elem_bytes: int = 4, backward: bool = True) -> dict:
    """Bytes rank ``rank`` sends and receives in one MoE layer's step, from the kept counts.

    Args:
        counts: ``[P][E]`` kept choices per (sending rank, expert) of the ``ep`` group.
        rank: position in the ``ep`` group.
        d_model: ``H``; elem_bytes: ``b`` (4 for fp32).
        backward: include the backward's reverse all-to-alls.

    Returns:
        ``{"dispatch_sent", "dispatch_recv", "combine_sent", "combine_recv", "counts_sent",
        "sent", "recv"}`` in bytes; ``sent``/``recv`` total the layer's step.
    """
    p, e = len(counts), len(counts[0])
    n_local = e // p
    mine = range(rank * n_local, (rank + 1) * n_local)
    row = d_model * elem_bytes
    d_sent = sum(c for ex, c in enumerate(counts[rank]) if ex not in mine) * row
    d_recv = sum(counts[j][ex] for j in range(p) if j != rank for ex in mine) * row
    counts_sent = (p - 1) * n_local * 8
    passes = 2 if backward else 1
    return {"dispatch_sent": d_sent, "dispatch_recv": d_recv, "combine_sent": d_recv,
            "combine_recv": d_sent, "counts_sent": counts_sent,
            "sent": passes * (d_sent + d_recv) + counts_sent,
            "recv": passes * (d_sent + d_recv) + counts_sent}


def a2a_bytes_from_trace(events: Iterable, rank: Optional[int] = None,
                         step: Optional[int] = None) -> dict:
    """Sum the traced expert all-to-alls: ``{(layer, phase, pass): [sent, recv]}`` bytes,
    for events of ``rank`` (global) and ``step`` when given. Only all-to-alls with a
    ``phase`` tag (``counts``, ``dispatch``, ``combine``) count."""
    out: dict = defaultdict(lambda: [0.0, 0.0])
    for ev in events:
        if ev.op != "all_to_all" or "phase" not in ev.args:
            continue
        if (rank is not None and ev.rank != rank) or (step is not None and ev.step != step):
            continue
        key = (ev.args.get("layer"), ev.args["phase"], ev.args.get("pass", "forward"))
        out[key][0] += ev.bytes_sent
        out[key][1] += ev.bytes_recv
    return dict(out)


def expert_numel(model_config) -> int:
    """Expert parameters of the whole model, ``n_layers · E · 3 · H · F`` (gate, up and down
    matrices of every expert); expert parallelism leaves ``1/ep`` of them on each rank."""
    mc = model_config
    return mc.n_layers * mc.n_experts * 3 * mc.d_model * mc.ffn_dim


def a2a_bytes_expected(result, rank: int, step: int) -> dict:
    """What :func:`a2a_bytes_from_trace` should find for ``rank`` in ``step`` of a training
    run (``result`` of :func:`labkit.train.run` with a MoE model), from the
    kept counts every rank of its ``ep`` group returned in ``outputs[r]["routing"]``.

    The bytes are linear in the counts, so the step's summed counts give the sum over its
    forwards (microbatches) exactly; each forward also exchanges the counts once, and a
    checkpoint policy's recomputed forward repeats the count exchange, dispatch and combine
    (``pass="recompute"``). Elements are 2 bytes under ``precision="bf16"`` (the dispatcher
    moves rows at the autocast width), else 4. ``{}`` when ``ep`` is 1.

    Returns:
        ``{(layer, phase, pass): [sent, recv]}`` bytes, the keys of the trace's sums.

    Raises:
        ValueError: a pipeline run (``pp > 1``: a rank's routing lists hold only its own
            stage's layers).
    """
    cfg = result.config
    if cfg.parallel.pp > 1:
        raise ValueError(f"a2a_bytes_expected reads runs with pp=1, got pp={cfg.parallel.pp}")
    peers = cfg.mesh.group(rank, "ep")
    if len(peers) == 1:  # the experts are local: no all-to-all at all
        return {}
    me, elem, h = peers.index(rank), 2 if cfg.precision == "bf16" else 4, \
        cfg.model_config.d_model
    kept = [result.outputs[j]["routing"][step]["kept"] for j in peers]
    out = {}
    for layer in range(len(kept[0])):
        f = a2a_bytes_formula([k[layer] for k in kept], me, h, elem)
        d_sent, d_recv = f["dispatch_sent"], f["dispatch_recv"]
        counts = f["counts_sent"] * cfg.accum_steps
        passes = ("forward", "recompute") if cfg.checkpoint != "none" else ("forward",)
        for p in passes:
            out[(layer, "counts", p)] = [counts, counts]
            out[(layer, "dispatch", p)] = [d_sent, d_recv]
            out[(layer, "combine", p)] = [d_recv, d_sent]
        out[(layer, "dispatch", "backward")] = [d_recv, d_sent]
        out[(layer, "combine", "backward")] = [d_sent, d_recv]
    return out
