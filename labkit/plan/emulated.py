"""The planner's communication model on an emulated cluster's measured links (issue 27).

:mod:`labkit.plan.network` prices a collective by where its group lies in a hierarchy of
:class:`~labkit.plan.hardware.Level` s: ``latency + comm_bytes / (bandwidth · η)``, with a
group that leaves a server getting ``min(NVLink, g · NIC)`` (``g`` of its members per
server). On emulated nodes (:mod:`labkit.nodes`) the same hierarchy exists with this
machine's numbers: the node's loopback inside, the tc-shaped link across, shared by the
node's ranks. :func:`emulated_spec` builds the :class:`ClusterSpec` from *measured* links,
and :func:`predict_comm` prices every communication call a run recorded (its trace: the
op, the group, the bytes) on it — so the planner's comm model meets a real network for
the first time: predicted seconds beside the seconds the calls took.
"""
from __future__ import annotations

from typing import Callable, Sequence

from labkit.plan.comm import busbw_factor, normalize_collective
from labkit.plan.hardware import GPU, ClusterSpec, Level
from labkit.plan.network import collective_time, place

__all__ = ["emulated_spec", "physical_order", "predict_comm"]


def emulated_spec(nodes: int, ranks_per_node: int, inside_bw: float, across_bw: float,
                  inside_hop_s: float, across_hop_s: float) -> ClusterSpec:
    """A two-level :class:`ClusterSpec` of ``nodes`` emulated nodes.

    Args:
        nodes, ranks_per_node: the emulated cluster's shape (ranks that talk at once).
        inside_bw: busbw of a pair of ranks inside a node, bytes/s (measured).
        across_bw: one node's link to the others, bytes/s per direction (measured busbw of
            a pair across); its ranks share it, so each gets ``across_bw / ranks_per_node``
            (the planner's per-GPU adapter).
        inside_hop_s, across_hop_s: seconds per ring step of a tiny message (measured).

    The GPU entry is a placeholder: :func:`~labkit.plan.network.place` and
    :func:`~labkit.plan.network.collective_time` read only the levels.
    """
    cpu = GPU("cpu rank (emulated node)", 1.0, 1.0, 1.0, 1.0, "placeholder: unused")
    return ClusterSpec("emulated", cpu, (
        Level("node", ranks_per_node, inside_bw, inside_hop_s),
        Level("network", nodes * ranks_per_node, across_bw / ranks_per_node, across_hop_s)),
        "labkit.nodes: measured busbw inside a node and across")


def physical_order(ranks: Sequence[int], node_of: Callable[[int], int]) -> dict:
    """``{rank: position}`` with the ranks of node 0 first, then node 1 …: the numbering
    the planner assumes (a server's GPUs adjacent), whatever the cluster's placement."""
    by_node: dict = {}
    for r in sorted(ranks):
        by_node.setdefault(node_of(r), []).append(r)
    pos, out = 0, {}
    for n in sorted(by_node):
        for r in by_node[n]:
            out[r], pos = pos, pos + 1
    return out


def _group(peers: Sequence[int], phys: dict) -> tuple:
    """``(size, stride)`` of a group in the physical order (uniform spacing; else the
    smallest gap, which places it no worse than it lies)."""
    p = sorted(phys[r] for r in peers)
    gaps = [b - a for a, b in zip(p, p[1:])] or [1]
    return len(p), min(gaps)


def predict_comm(events, spec: ClusterSpec, phys: dict, efficiency: float = 1.0) -> float:
    """Seconds the planner gives the communication ``events`` (one rank's
    :class:`~labkit.trace.Event` s of category comm/p2p) on ``spec``.

    Each call is priced on its own group: a collective of ``S`` bytes (recovered from the
    bytes the rank sent or received: ``sent = busbw_factor · S``), a send or receive as
    ``send_recv`` of its message. ``efficiency``: the planner's link efficiency; 1 when
    ``spec`` holds measured busbw (which already includes it).
    """
    total = 0.0
    for e in events:
        if e.cat not in ("comm", "p2p") or not e.op:
            continue
        moved = max(e.bytes_sent, e.bytes_recv)
        if e.cat == "p2p" or e.op in ("send", "recv", "isend", "irecv"):
            peers = tuple({e.rank, *e.peers})
            op, size = "send_recv", moved
        else:
            peers = tuple(e.peers) or (e.rank,)
            try:
                op = normalize_collective(e.op)
            except ValueError:
                continue
            f = busbw_factor(op, len(peers)) if len(peers) > 1 else 0.0
            size = moved / f if f else 0.0
        if len(peers) < 2 or size <= 0:
            continue
        total += collective_time(op, size, place(spec, _group(peers, phys)), efficiency)
    return total
