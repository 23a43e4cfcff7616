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

__all__ = ["a2a_bytes_formula", "a2a_bytes_from_trace", "imbalance", "tokens_per_expert"]


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
