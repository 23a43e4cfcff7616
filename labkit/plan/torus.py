"""Groups on a TPU torus: which axes of the torus a group spans and what its collectives
cost (claim C41).

A GPU cluster is switched (:mod:`labkit.plan.network`): 8 GPUs per server on NVSwitch,
about 256 on one non-blocking switch domain, an oversubscribed spine beyond — a group that
leaves a domain sparsely is slowed. A TPU pod has no switch: chip ``(x, y, z)`` is wired to
its six neighbours by inter-chip interconnect (ICI) links, and each axis wraps around into a
ring (Austin et al. 2025, "How to Scale Your Model", Part 2 "TPUs" and Part 3 "Sharded
Matrices"). Collectives run as **rings along the torus axes**:

* along one axis of ``e`` chips with wraparound, a bidirectional ring sends half the data
  each way: an all-gather of ``V`` bytes takes ``(e−1)/e · V / (2W)``, ``W`` the one-way
  rate of one link (the scaling book's ``V / W_ici`` with ``W_ici`` bidirectional); without
  wraparound (a group covering part of an axis: a line) half that rate, ``W``;
* over several axes at once every axis's links carry a share, so the rates add up (the
  scaling book: an AllGather over two axes is twice as fast as over one);
* groups whose members sit ``δ`` chips apart along an axis share its links with the other
  ``δ − 1`` interleaved groups: ``W/δ`` each;
* latency: ``Σ (e_d − 1)`` ring steps along the axes (not ``n − 1`` as on one flat ring),
  ~1 µs per ICI hop.

So a group's rate depends on how many axes it spans and whether it closes the rings, never
on a switch domain: no 256-chip cliff. What the torus pays instead is distance: an
**all-to-all** is bound by the torus's bisection (the scaling book, Part 3, "AllToAll":
on a bidirectional ring it costs about a quarter of an all-gather of the same array,
``V / (4·W_ici)``). Cut the group in half across axis ``d`` of extent ``e``: each of the
``n/2`` ranks on one side sends ``S/n`` to each of the ``n/2`` on the other, ``n·S/4``
bytes each way, over the ``2·n/e`` links the cut severs on a ring (``n/e`` on a line),
shared by the ``δ`` interleaved groups: ``e·δ·S / (8W)`` seconds (``e·δ·S / (4W)`` on a
line). The narrowest cut (largest ``e·δ``) sets the time; the bisection grows only as
``N^(2/3)`` on a cube, so the all-to-all's time per byte grows as ``N^(1/3)``.

Ranks are numbered with X fastest (``r = x + X·(y + Y·z)``), so the planner's innermost
axis (TP) lies along X.
"""
from __future__ import annotations

import itertools
import math

__all__ = ["torus_members", "torus_extents", "torus_rate", "torus_all_to_all_rate"]


def torus_members(axes, limit: int = 1 << 16) -> list[int]:
    """Ranks of the group containing rank 0, made of ``axes`` ((size, stride) pairs).

    Raises:
        ValueError: a group of more than ``limit`` ranks (too many to enumerate).
    """
    n = math.prod(size for size, _ in axes)
    if n > limit:
        raise ValueError(f"a group of {n} ranks is more than {limit} to enumerate")
    ranges = [range(0, size * stride, stride) for size, stride in axes]
    return sorted({sum(c) for c in itertools.product(*ranges)})


def torus_extents(dims: tuple, axes) -> list[tuple[int, int, bool]]:
    """Per torus axis: ``(extent e, spacing δ, wraps)`` of the group of ``axes``.

    ``e`` distinct coordinates ``δ`` apart; ``wraps`` when they close the ring
    (``e · δ`` is the axis length and ``e > 2``)."""
    coords = [set() for _ in dims]
    for r in torus_members(axes):
        for i, d in enumerate(dims):
            coords[i].add(r % d)
            r //= d
    out = []
    for c, d in zip(coords, dims):
        cs = sorted(c)
        e = len(cs)
        delta = min(b - a for a, b in zip(cs, cs[1:])) if e > 1 else 1
        out.append((e, delta, e > 2 and e * delta == d))
    return out


def torus_rate(dims: tuple, link: float, axes) -> tuple[float, int, int]:
    """``(bytes/s per chip before link efficiency, ring steps, largest spacing)`` of the
    group of ``axes`` on a torus of ``dims`` with one-way link rate ``link``: the sum over
    the axes it spans of ``2·W/δ`` (a closed ring) or ``W/δ`` (a line)."""
    bw, steps, spacing = 0.0, 0, 1
    for e, delta, wraps in torus_extents(dims, axes):
        if e == 1:
            continue
        bw += (2.0 if wraps else 1.0) * link / delta
        steps += e - 1
        spacing = max(spacing, delta)
    return bw, steps, spacing


def torus_all_to_all_rate(dims: tuple, link: float, axes) -> float:
    """Bytes/s at which one rank's all-to-all send buffer ``S`` drains through the
    bisection of the group of ``axes`` (before link efficiency): ``S / t`` with ``t =
    max_d e_d·δ_d·S / (c_d·W)``, ``c_d = 8`` on a closed ring, ``4`` on a line (module
    docstring; the scaling book's ``V / (4·W_ici)`` for one ring, ``V = e·S``,
    ``W_ici = 2W``). ``inf`` for a group of one chip."""
    worst = 0.0
    for e, delta, wraps in torus_extents(dims, axes):
        if e > 1:
            worst = max(worst, e * delta / (8.0 if wraps else 4.0))
    return link / worst if worst else float("inf")
