"""How many transfers shared a node's link while a call crossed it, read from a run's trace.

The planner prices a group that leaves a node as if every rank of that node were crossing
at the same moment: a node of ``per`` ranks whose group has ``g`` members there gets
``g / per`` of the node's link (:func:`labkit.plan.emulated.emulated_spec`, the per-GPU
adapter of :mod:`labkit.plan.network`). That is the worst case, and the right one for a
plan made before any run. A job replayed from its own trace
(:mod:`labkit.measure.step_model`) knows better: two tensor-parallel groups whose
all-reduces cross the same link overlap only part of the time (one group's ranks reach
the next layer's call a little before the other's), so each call had the link to itself
for the rest. :func:`link_efficiency` turns that measured overlap into the factor by which
the call's bandwidth exceeds the planner's share, as the step model uses the run's own
compute rather than a formula's.
"""
from __future__ import annotations

from typing import Dict, Sequence

__all__ = ["link_efficiency", "covered"]


def _members(e) -> frozenset:
    return frozenset({e.rank, *e.peers})


def covered(spans, a: float = float("-inf"), b: float = float("inf")) -> float:
    """Seconds of ``[a, b]`` covered by ``spans`` (``(start, end)`` pairs; overlaps counted
    once); the whole union by default."""
    total, cur = 0.0, None
    for s, t in sorted((max(s, a), min(t, b)) for s, t in spans if t > a and s < b):
        if cur is None or s > cur[1]:
            total += (cur[1] - cur[0]) if cur else 0.0
            cur = [s, t]
        else:
            cur[1] = max(cur[1], t)
    return total + ((cur[1] - cur[0]) if cur else 0.0)


def link_efficiency(events: Sequence, phys: Dict[int, int], per_node: int) -> Dict[int, float]:
    """``{id(event): factor}`` for every communication call in ``events`` (all ranks'
    :class:`~labkit.trace.Event` s of one or more steps) whose group crosses a node
    boundary; calls inside a node are absent (factor 1).

    Args:
        events: the run's events; calls are ``cat`` comm/p2p with an ``op``.
        phys: ``{rank: position}`` with a node's ranks adjacent
            (:func:`labkit.plan.emulated.physical_order`); node = position // ``per_node``.
        per_node: ranks per node.

    For a call of rank ``r`` whose group has ``g`` members on ``r``'s node, the flows on
    that node's link while it ran are ``k = 1 + Σ f / g'``: for every rank of the node (the
    caller too: a rank may have a data-parallel bucket in flight beside a tensor-parallel
    call) and every other group it crosses with, ``f`` is the fraction of the call's span
    covered by that rank's calls of the group, and ``g'`` the group's members on the node
    (the ranks of one group move one set of flows; the call's own group adds none). The planner assumed ``per_node / g``
    flows, so the factor is ``(per_node / g) / k``: ``1`` when the node's ranks did cross
    together, up to ``per_node / g`` when the call crossed alone. It multiplies the
    bandwidth (``predict_comm``'s ``efficiency``); latency is unchanged.
    """
    node = {r: p // per_node for r, p in phys.items()}
    crossing = {}
    for e in events:
        if e.cat in ("comm", "p2p") and e.op and e.rank in node:
            m = _members(e)
            if all(r in node for r in m) and len({node[r] for r in m}) > 1:
                crossing[id(e)] = (e, m)
    by_rank: dict = {}
    for e, m in crossing.values():
        by_rank.setdefault(e.rank, []).append((e, m))
    out = {}
    for key, (e, m) in crossing.items():
        n = node[e.rank]
        g = sum(1 for r in m if node[r] == n)
        span = e.end - e.start
        k = 1.0
        if span > 0:
            for r2, calls in by_rank.items():
                if node[r2] != n:
                    continue
                others = [(o.start, o.end, om) for o, om in calls if om != m]
                for om in {om for _, _, om in others}:
                    f = covered([(s, t) for s, t, x in others if x == om],
                                      e.start, e.end) / span
                    k += f / sum(1 for r in om if node[r] == n)
        out[key] = (per_node / g) / k
    return out
