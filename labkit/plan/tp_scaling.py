"""Tensor-parallel throughput against the node boundary (claim C27), a small analytic model.

Each transformer block costs ``72·B·S·H²`` matmul FLOPs per training step for a GPT-3-style
block (``24·B·S·H²`` forward, backward twice that; Narayanan et al. 2021, §5.1), split evenly
over ``T`` tp ranks, and four all-reduces of ``B·S·H`` elements (two forward, two backward;
Shoeybi et al. 2019, §3), each moving ``2(T−1)/T·B·S·H·e`` bytes per rank in a ring. A ring
runs at its slowest link: the intra-node link while ``T ≤ gpus_per_node``, the per-GPU share
of the network once the group crosses nodes. With no overlap of communication and compute,
the per-GPU throughput relative to perfect scaling is

    efficiency(T) = t_compute(T) / (t_compute(T) + t_comm(T)),   t_compute(T) = t_compute(1)/T.

Communication per rank stays ~constant in ``T`` while compute per rank shrinks as ``1/T``, so
the efficiency falls slowly inside a node and steeply once the bandwidth drops by the
node/network ratio (~18× for 900 GB/s NVLink vs 50 GB/s per-GPU InfiniBand): the lecture's
~10–12% loss up to 8 ranks and 42–65% across nodes (CS336 lecture 7, from Hugging Face's
scaling tutorial), a shape rather than those exact figures, which depend on model and overlap.

Across servers this model puts the whole ring on one GPU's network adapter: a bound (a group
with one member per server gets exactly that), not what NCCL does for a group with 8
members per server, which runs one ring per adapter. The full planner
(:func:`labkit.plan.rules.tp_scaling`) does that and lands beside the measurement (0.61 at TP
16 where this model says 0.2; notebook 13 §2).
"""
from __future__ import annotations

__all__ = ["tp_efficiency", "tp_scaling_curve"]


def tp_efficiency(tp: int, *, hidden: int, seq: int, batch: int = 1,
                  gpus_per_node: int = 8, node_bw: float = 900e9,
                  cross_node_bw: float = 50e9, peak_flops: float = 989e12,
                  mfu: float = 0.5, bytes_per_elem: int = 2, overlap: float = 0.0) -> dict:
    """Per-layer step time and efficiency of ``tp``-way tensor parallelism.

    Args:
        tp: ranks in the tp group (≥ 1).
        hidden, seq, batch: ``H``, ``S``, ``B`` of the step.
        gpus_per_node: ranks sharing the fast link.
        node_bw, cross_node_bw: bytes/s per GPU on the intra-node link and across nodes.
        peak_flops, mfu: FLOP/s per GPU and the fraction of it matmuls reach.
        bytes_per_elem: activation precision (2 for bf16).
        overlap: fraction of communication hidden under compute (0–1).

    Returns:
        ``{"compute_s", "comm_s", "efficiency", "drop", "link_bw"}``: seconds per layer per
        step on one rank, ``efficiency`` ∈ (0, 1], ``drop = 1 − efficiency``, the bandwidth
        used (bytes/s).

    Raises:
        ValueError: non-positive sizes, bandwidths or peak, ``mfu`` or ``overlap`` outside
            their ranges.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    for name, v in (("hidden", hidden), ("seq", seq), ("batch", batch),
                    ("gpus_per_node", gpus_per_node), ("node_bw", node_bw),
                    ("cross_node_bw", cross_node_bw), ("peak_flops", peak_flops),
                    ("bytes_per_elem", bytes_per_elem)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    compute = 72 * batch * seq * hidden ** 2 / (tp * peak_flops * mfu)
    bw = node_bw if tp <= gpus_per_node else cross_node_bw
    comm_bytes = 4 * 2 * (tp - 1) / tp * batch * seq * hidden * bytes_per_elem
    comm = comm_bytes / bw * (1 - overlap)
    eff = compute / (compute + comm)
    return {"compute_s": compute, "comm_s": comm, "efficiency": eff, "drop": 1 - eff,
            "link_bw": bw}


def tp_scaling_curve(tps=(1, 2, 4, 8, 16, 32), **kw) -> list:
    """:func:`tp_efficiency` for each degree in ``tps``: ``[{"tp", ...}, ...]``."""
    return [{"tp": t, **tp_efficiency(t, **kw)} for t in tps]
