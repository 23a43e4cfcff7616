"""PlannedMeshView: a cluster-scale layout of :mod:`labkit.plan` drawn summarised (claims C7,
C34, C36).

16,384 boxes say nothing, so the view draws what the layout repeats, computed from the
planner's :class:`~labkit.plan.layout.Layout` and :class:`~labkit.plan.hardware.ClusterSpec`
(:func:`~labkit_widgets.mesh_summary.summarize_layout`):

* **one server in full**: its ``gpus_per_node`` GPUs, each with its ``[TP, CP, PP, DP]``
  coordinates (Llama 3's order, Dubey et al. 2024 §3.3.2) — under Llama 3's layout, one
  tensor-parallel group;
* **the pipeline** as stage columns, one cell per tensor-parallel group (its first rank
  written in it), one row per context-parallel rank of each data-parallel replica shown; DP
  (and CP, when large) as a few representative rows and an ellipsis row with the count;
  cells that share a server are outlined together;
* **a table** of each axis: what it splits of the activation (claim C7), its degree, rank
  stride, group count, members per server, servers per group, and the hierarchy level its
  collectives run on with the bandwidth — NVLink inside a server, the network beyond
  (claim C34), as :func:`labkit.plan.network.place` places them.

Hovering a GPU or a cell shows its coordinates and, for each axis, its group's size, rank
stride and level. Colours mark the groups of one chosen axis.
"""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.plan.layout import AXES, Layout

from .mesh_summary import AXIS_ROLE, LayoutSummary, rank_of, summarize_layout
from .mesh_roles import PALETTE as _PALETTE

__all__ = ["PlannedMeshView", "pick"]


def pick(n: int, most: int) -> list:
    """Indices ``0 … n−1`` to draw: all when ``n <= most``, else the first ``most − 2``, an
    ellipsis (``None``) and the last."""
    if n <= most:
        return list(range(n))
    return list(range(most - 2)) + [None, n - 1]


class PlannedMeshView:
    """A planned layout on a cluster, drawn summarised (see the module docstring).

    Args:
        layout: a :class:`labkit.plan.layout.Layout` (degrees and rank order).
        cluster: a preset name of :data:`labkit.plan.hardware.CLUSTERS` or a
            :class:`~labkit.plan.hardware.ClusterSpec`.
        axis: ``"tp"``, ``"cp"``, ``"pp"`` or ``"dp"``: whose groups share a colour.
        max_stages: pipeline stage columns drawn before an ellipsis.
        max_replicas: data-parallel replicas (and context-parallel ranks per replica) drawn
            before an ellipsis row.

    Attributes:
        summary: the :class:`~labkit_widgets.mesh_summary.LayoutSummary` drawn.
        stages, replicas, cps: the indices drawn (``None`` = an ellipsis).
        cells: ``{(dp, cp, pp): ranks of that tensor-parallel group}`` for every cell drawn.
        server_ranks: the ranks of the server drawn in full.
        figure: the plotly figure (server row, pipeline grid, axis table).

    Raises:
        ValueError: an unknown axis, limits below 3, or what
            :func:`~labkit_widgets.mesh_summary.summarize_layout` refuses.
    """

    def __init__(self, layout: Layout, cluster="llama3-24k", axis: str = "pp",
                 max_stages: int = 16, max_replicas: int = 4):
        if axis not in AXES:
            raise ValueError(f"axis must be one of {', '.join(AXES)}, got {axis!r}")
        for name, v in (("max_stages", max_stages), ("max_replicas", max_replicas)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 3:
                raise ValueError(f"{name} must be an int >= 3, got {v!r}")
        self.summary: LayoutSummary = summarize_layout(layout, cluster)
        self.layout, self.axis = layout, axis
        self.stages = pick(layout.pp, max_stages)
        self.replicas = pick(layout.dp, max_replicas)
        self.cps = pick(layout.cp, max_replicas)
        tp_stride = layout.stride("tp")
        self.cells = {(d, c, p): tuple(rank_of(layout, cp=c, pp=p, dp=d) + k * tp_stride
                                       for k in range(layout.tp))
                      for d in self.replicas if d is not None
                      for c in self.cps if c is not None
                      for p in self.stages if p is not None}
        self.server_ranks = tuple(range(min(self.summary.gpus_per_server, layout.n_gpus)))
        self.figure = self._draw()

    # -- words -----------------------------------------------------------------------
    def group_of(self, rank: int, axis: str) -> int:
        """First rank of ``rank``'s ``axis`` group (its identity)."""
        lay = self.layout
        s = lay.stride(axis)
        return rank - ((rank // s) % getattr(lay, axis)) * s

    def hover(self, rank: int) -> str:
        """``rank``'s coordinates, server, and each axis's group size, stride and level."""
        s = self.summary
        tp, cp, pp, dp = self.layout.coords(rank)
        lines = [f"rank {rank:,}: [TP, CP, PP, DP] = [{tp}, {cp}, {pp}, {dp}]",
                 f"server {s.server_of(rank):,}"]
        for a, ax in s.axes.items():
            if ax.degree == 1:
                lines.append(f"{a}: 1 rank")
                continue
            first = self.group_of(rank, a)
            last = first + (ax.degree - 1) * ax.stride
            lines.append(f"{a} group: {ax.degree:,} ranks, stride {ax.stride:,} "
                         f"({first:,}, {first + ax.stride:,}, …, {last:,}), "
                         f"{ax.placement.level}")
        return "<br>".join(lines)

    # -- drawing ---------------------------------------------------------------------
    def _colour(self, keys: dict, rank: int) -> str:
        k = self.group_of(rank, self.axis)
        keys.setdefault(k, len(keys))
        return _PALETTE[keys[k] % len(_PALETTE)]

    def _rows(self) -> list:
        """``(dp, cp)`` per grid row, or ``("dp"|"cp", count left out)`` for an ellipsis."""
        lay, rows = self.layout, []
        for d in self.replicas:
            if d is None:
                rows.append(("dp", lay.dp - (len(self.replicas) - 1)))
                continue
            for c in self.cps:
                rows.append(("cp", lay.cp - (len(self.cps) - 1)) if c is None else (d, c))
        return rows

    def _cell_of(self, rank: int) -> tuple:
        """``(dp, cp, pp)`` of the tensor-parallel group (cell) holding ``rank``."""
        tp, cp, pp, dp = self.layout.coords(rank)
        return dp, cp, pp

    def _draw(self) -> go.Figure:
        s, lay = self.summary, self.layout
        rows, keys = self._rows(), {}
        grid_px, table_px, strip_px, gap = 36 * len(rows) + 40, 150, 50, 56
        fig = make_subplots(rows=3, cols=1, vertical_spacing=gap / (strip_px + grid_px
                                                                     + table_px + 2 * gap),
                            specs=[[{"type": "xy"}], [{"type": "xy"}], [{"type": "table"}]],
                            row_heights=[strip_px, grid_px, table_px],
                            subplot_titles=[f"server 0 in full: GPUs 0-{len(self.server_ranks) - 1}"
                                            ", each coloured as its cell below",
                                            "the pipeline: one cell per TP group (its first "
                                            "rank written); dotted: one server", ""])
        for a in fig.layout.annotations:
            a.font.size = 11
        # one server in full, each GPU in the colour of its cell
        r0 = list(self.server_ranks)
        fig.add_scatter(x=r0, y=[0] * len(r0), mode="markers+text", name="server 0",
                        text=[str(r) for r in r0], hovertext=[self.hover(r) for r in r0],
                        hoverinfo="text", textfont=dict(size=10),
                        marker=dict(symbol="square", size=28, opacity=0.55, color=[
                            self._colour(keys, self.cells.get(self._cell_of(r), (r,))[0])
                            for r in r0]), row=1, col=1)
        fig.add_shape(type="rect", x0=-0.5, x1=len(r0) - 0.5, y0=-0.5, y1=0.5,
                      line=dict(color="#555555", dash="dot"), row=1, col=1)
        # the pipeline grid
        cols = {p: j for j, p in enumerate(self.stages)}
        xs, ys, text, hover, colours = [], [], [], [], []
        for i, row in enumerate(rows):
            if isinstance(row[0], str):
                what = "data-parallel replicas" if row[0] == "dp" else "context-parallel ranks"
                fig.add_annotation(x=(len(self.stages) - 1) / 2, y=i, showarrow=False,
                                   text=f"⋮ {row[1]:,} more {what}", row=2, col=1)
                continue
            d, c = row
            for p in self.stages:
                if p is None:
                    fig.add_annotation(x=cols[p], y=i, showarrow=False, row=2, col=1,
                                       text="…")
                    continue
                ranks = self.cells[(d, c, p)]
                xs.append(cols[p])
                ys.append(i)
                text.append(f"{ranks[0]:,}")
                servers = sorted({s.server_of(r) for r in ranks})
                where = (f"server {servers[0]:,}" if len(servers) == 1 else
                         f"servers {', '.join(f'{v:,}' for v in servers)}")
                hover.append(f"TP group of {len(ranks)}: ranks {ranks[0]:,} … {ranks[-1]:,} "
                             f"({where})<br>" + self.hover(ranks[0]))
                colours.append(self._colour(keys, ranks[0]))
        fig.add_scatter(x=xs, y=ys, mode="markers+text", text=text, hovertext=hover,
                        hoverinfo="text", name="TP groups", textfont=dict(size=9),
                        marker=dict(symbol="square", size=32, color=colours, opacity=0.55),
                        row=2, col=1)
        self._outline_servers(fig, rows, cols)
        fig.add_trace(self._table(), row=3, col=1)
        left = lay.pp - (len(self.stages) - 1)
        ticks = [str(p) if p is not None else f"+{left}" for p in self.stages]
        fig.update_xaxes(visible=False, row=1, col=1)
        fig.update_yaxes(visible=False, range=[-0.6, 0.6], row=1, col=1)
        fig.update_xaxes(tickvals=list(range(len(ticks))), ticktext=ticks, tickfont_size=10,
                         title=dict(text="pipeline stage", font_size=11, standoff=4),
                         zeroline=False, showgrid=False, row=2, col=1)
        fig.update_yaxes(tickvals=[i for i, r in enumerate(rows) if not isinstance(r[0], str)],
                         ticktext=[f"dp {r[0]:,}" + (f" · cp {r[1]}" if lay.cp > 1 else "")
                                   for r in rows if not isinstance(r[0], str)],
                         range=[len(rows) - 0.5, -0.5], zeroline=False, showgrid=False,
                         tickfont_size=10, row=2, col=1)
        domains = "".join(f" · {n:,} {name}{'s' * (n > 1)}" for name, _sz, n, _p in s.domains)
        fig.update_layout(
            template="plotly_white", showlegend=False, width=840,
            height=92 + strip_px + grid_px + table_px + 2 * gap,
            margin=dict(l=80, r=10, t=72, b=10),
            title=dict(font_size=13, x=0.01, xanchor="left", text=(
                f"planned: {' × '.join(f'{a.upper()} {getattr(lay, a):,}' for a in AXES)} = "
                f"{s.n_gpus:,} GPUs on {s.cluster.name}: {s.servers:,} servers of "
                f"{s.gpus_per_server}{domains}<br><sup>layers → PP (columns), batch → DP "
                "(replica rows), sequence → CP, channels → TP (the GPUs of a cell); colour = "
                f"{self.axis} group of a cell's first rank</sup>")))
        return fig

    def _outline_servers(self, fig, rows, cols) -> None:
        """A dotted box around each run of neighbouring cells of one server."""
        s = self.summary
        for i, row in enumerate(rows):
            if isinstance(row[0], str):
                continue
            run: Optional[list] = None
            for p in self.stages + [None]:
                servers = None if p is None else {s.server_of(r) for r in self.cells[(*row, p)]}
                one = servers if servers and len(servers) == 1 else None
                if run and one == run[2]:
                    run[1] = cols[p]
                    continue
                if run:
                    fig.add_shape(type="rect", x0=run[0] - 0.45, x1=run[1] + 0.45,
                                  y0=i - 0.42, y1=i + 0.42, row=2, col=1,
                                  line=dict(color="#555555", width=1, dash="dot"))
                run = [cols[p], cols[p], one] if one else None

    def _table(self) -> go.Table:
        s = self.summary
        head = ["axis", "splits", "degree", "stride", "groups", "per server",
                "servers / group", "level (bandwidth per GPU each way)"]
        cells = [[] for _ in head]
        for a, ax in s.axes.items():
            one = ax.degree == 1
            span = (f"{ax.servers[0]:,}" if ax.servers[0] == ax.servers[1]
                    else f"{ax.servers[0]:,}–{ax.servers[1]:,}")
            bw = ax.placement.bandwidth / 1e9
            level = "–" if one else f"{ax.placement.level}, {bw:,.0f} GB/s"
            if not one and ax.placement.slowdown > 1:
                level += f" (÷{ax.placement.slowdown:g} oversubscribed)"
            if a == "pp" and not one and ax.neighbour.level != ax.placement.level:
                level += f"; neighbours {ax.neighbour.level}"
            row = [a.upper(), AXIS_ROLE[a], f"{ax.degree:,}", "–" if one else f"{ax.stride:,}",
                   f"{ax.groups:,}", "–" if one else str(ax.per_server),
                   "–" if one else span, level]
            for col, v in zip(cells, row):
                col.append(v)
        return go.Table(header=dict(values=head, font_size=11, align="left"),
                        cells=dict(values=cells, font_size=11, align="left", height=22),
                        columnwidth=[40, 62, 52, 52, 52, 60, 70, 230])
