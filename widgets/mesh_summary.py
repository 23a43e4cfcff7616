"""Where a planned layout's ranks sit on a cluster: servers, racks, and each axis's groups.

Pure numbers for :class:`~labkit_widgets.mesh_planned.PlannedMeshView`, computed from a
:class:`labkit.plan.layout.Layout` (degrees and rank order) and a
:class:`labkit.plan.hardware.ClusterSpec` (GPUs per server, the bandwidth hierarchy), never
typed in: a rank's coordinate along an axis is ``(rank // stride) % degree`` with the
layout's own strides (:meth:`Layout.stride`), a server holds ``gpus_per_node`` consecutive
ranks, and the hierarchy level an axis's collectives run on is the planner's own
:func:`labkit.plan.network.place` — the same call :mod:`labkit.plan.steptime` charges time
with. Group counts, members per server and servers per group are counted over every group
(exact, not assumed regular).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from labkit.plan.hardware import ClusterSpec, cluster_preset
from labkit.plan.layout import AXES, Layout
from labkit.plan.network import Placement, place

from .mesh_roles import AXIS_ROLE

__all__ = ["AXIS_ROLE", "AxisSummary", "LayoutSummary", "summarize_layout", "rank_of"]



@dataclass(frozen=True)
class AxisSummary:
    """One axis of a layout on a cluster.

    Attributes:
        axis: ``"tp"``, ``"cp"``, ``"pp"`` or ``"dp"``.
        degree: ranks in one group.
        stride: rank distance between neighbours of the group (product of the degrees of
            the axes inside it in the layout's order).
        groups: number of groups (``n_gpus / degree``).
        per_server: most members of one group inside one server.
        servers: ``(fewest, most)`` servers one group spans, over every group.
        placement: the planner's :class:`~labkit.plan.network.Placement` of a group: the
            innermost hierarchy level holding it and its bandwidth (bytes/s per GPU per
            direction).
        neighbour: the placement of two neighbours of the axis (what a pipeline's
            point-to-point sends cross; the planner charges pipeline sends there).
    """

    axis: str
    degree: int
    stride: int
    groups: int
    per_server: int
    servers: tuple
    placement: Placement
    neighbour: Placement

    @property
    def crosses_servers(self) -> bool:
        return self.servers[1] > 1


@dataclass(frozen=True)
class LayoutSummary:
    """A layout on a cluster, summarised.

    Attributes:
        layout, cluster: what was summarised.
        n_gpus: ranks of the layout; ``gpus_per_server`` the cluster's NVLink domain.
        servers: servers the layout occupies (``⌈n_gpus / gpus_per_server⌉``).
        domains: per hierarchy level beyond the server, ``(name, GPUs per domain, domains
            occupied, the last one only partly)``.
        axes: :class:`AxisSummary` per axis, in :data:`labkit.plan.layout.AXES` order.
    """

    layout: Layout
    cluster: ClusterSpec
    n_gpus: int
    gpus_per_server: int
    servers: int
    domains: tuple
    axes: dict

    def server_of(self, rank: int) -> int:
        return rank // self.gpus_per_server

    def describe(self) -> str:
        """A few lines: the degrees, the servers and racks, each axis's groups and level."""
        lay, c = self.layout, self.cluster
        order = ", ".join(a.upper() for a in lay.order)
        lines = [f"{' x '.join(f'{a}{getattr(lay, a)}' for a in AXES)} = {self.n_gpus:,} "
                 f"GPUs on {c.name} ({c.gpu.name}); rank order [{order}], first fastest",
                 f"{self.servers:,} servers of {self.gpus_per_server} GPUs" + "".join(
                     f" · {n:,} {name}{'s' * (n > 1)} of {size:,} GPUs"
                     + (("" if not part else f" ({self.n_gpus:,} used)" if n == 1
                         else " (the last partly used)"))
                     for name, size, n, part in self.domains)]
        for a, s in self.axes.items():
            head = f"{a} ({AXIS_ROLE[a]}): {s.degree:,} rank{'s' * (s.degree > 1)}"
            if s.degree == 1:
                lines.append(head)
                continue
            span = (f"{s.servers[0]:,}" if s.servers[0] == s.servers[1]
                    else f"{s.servers[0]:,}-{s.servers[1]:,}")
            where = _level(s.placement)
            if a == "pp" and s.neighbour.level != s.placement.level:
                where += (f"; neighbours {s.neighbour.level} "
                          f"{s.neighbour.bandwidth / 1e9:,.0f} GB/s")
            lines.append(f"{head}, stride {s.stride:,}, {s.groups:,} groups, {s.per_server} "
                         f"per server, {span} server{'s' * (s.servers[1] > 1)} per group: "
                         f"{where}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _level(p: Placement) -> str:
    kind = "inside a server" if not p.crosses_servers else "network between servers"
    slow = f", slowed {p.slowdown:g}x by oversubscription" if p.slowdown > 1 else ""
    return f"{p.level} ({kind}) {p.bandwidth / 1e9:,.0f} GB/s per GPU each way{slow}"


def rank_of(layout: Layout, **coords) -> int:
    """Global rank of ``[TP, CP, PP, DP]`` coordinates (missing axes 0), in the layout's
    rank order: ``Σ coordinate · stride``.

    Raises:
        ValueError: a coordinate outside ``0 … degree − 1`` or an unknown axis.
    """
    r = 0
    for a, c in coords.items():
        n = getattr(layout, a) if a in AXES else None
        if n is None:
            raise ValueError(f"unknown axis {a!r}; axes: {', '.join(AXES)}")
        if not 0 <= c < n:
            raise ValueError(f"coordinate {a}={c} is outside 0..{n - 1}")
        r += c * layout.stride(a)
    return r


def _check(layout: Layout, cluster: ClusterSpec) -> None:
    for a in AXES:
        v = getattr(layout, a)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{a} must be a positive int, got {v!r}")
    if sorted(layout.order) != sorted(AXES):
        raise ValueError(f"order must be a permutation of {AXES}, got {layout.order!r}")
    if layout.n_gpus > cluster.n_gpus:
        raise ValueError(f"tp x cp x pp x dp = {layout.tp} x {layout.cp} x {layout.pp} x "
                         f"{layout.dp} = {layout.n_gpus:,} GPUs; {cluster.name} has "
                         f"{cluster.n_gpus:,}")


def summarize_layout(layout: Layout, cluster) -> LayoutSummary:
    """The :class:`LayoutSummary` of ``layout`` on ``cluster`` (a preset name or a
    :class:`ClusterSpec`).

    Raises:
        ValueError: a degree that is not a positive int, an order that is not a permutation
            of ``tp, cp, pp, dp``, more GPUs than the cluster has, an unknown preset.
    """
    c = cluster_preset(cluster)
    _check(layout, c)
    n, gps = layout.n_gpus, c.gpus_per_node
    ranks = np.arange(n, dtype=np.int64)
    server = ranks // gps
    axes = {}
    for a in AXES:
        deg, stride = getattr(layout, a), layout.stride(a)
        base = ranks - ((ranks // stride) % deg) * stride   # the group's first rank
        pairs, members = np.unique(base * (n // gps + 1) + server, return_counts=True)
        spans = np.unique(pairs // (n // gps + 1), return_counts=True)[1]
        axes[a] = AxisSummary(a, deg, stride, n // deg, int(members.max()),
                              (int(spans.min()), int(spans.max())), place(c, (deg, stride)),
                              place(c, (min(deg, 2), stride)))
    domains = tuple((lv.name, lv.size, math.ceil(n / lv.size), n % lv.size != 0)
                    for lv in c.levels[1:])
    return LayoutSummary(layout, c, n, gps, math.ceil(n / gps), domains, axes)
