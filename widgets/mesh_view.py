"""MeshView: the ranks of a :class:`labkit.mesh.Mesh` as a grid, one row per server, each
rank coloured by its group along one axis (claims C7, C36), and on hover the group of any
axis highlighted.

Ranks are numbered with TP innermost (``pp, dp_replicate, dp_shard, cp, tp`` outer to inner),
so a server of ``gpus_per_server`` consecutive ranks holds whole tensor-parallel groups when
``tp`` divides it: TP stays inside the server, the other axes cross servers (claim C34).
Hovering a rank shows its ``[TP, CP, PP, DP]`` coordinates (Llama 3's order, Dubey et al.
2024 §3.3.2) and the ranks of its group.

Two drawings of the same grid:

* :attr:`MeshView.figure`, a static plotly figure for one axis (its hover text lists the
  group's ranks);
* :meth:`MeshView.widget`, the interactive view: toggle buttons choose the axis (tp, cp, pp
  or dp) and an ``ipywidgets.HTML`` holds an inline SVG (:mod:`labkit_widgets.mesh_svg`)
  whose CSS outlines, while the mouse is over a rank, every member of its group along the
  chosen axis. The highlight is CSS ``:has()`` evaluated by the browser, so hovering costs
  no kernel round trip; only the toggle asks the kernel (it re-renders the HTML with the
  new axis's colours).

A planned cluster-scale layout (a :class:`labkit.plan.layout.Layout`, thousands of GPUs) is
drawn summarised by :meth:`MeshView.planned`, a
:class:`~labkit_widgets.mesh_planned.PlannedMeshView`: one server in full, the pipeline's
stage columns, a few data-parallel replicas and an ellipsis, and which axis crosses which
bandwidth level.
"""
from __future__ import annotations

import plotly.graph_objects as go

from .mesh_planned import PlannedMeshView
from .mesh_roles import AXES4, AXIS_ROLE
from .mesh_roles import PALETTE as _PALETTE
from .mesh_svg import mesh_html, new_uid

__all__ = ["MeshView", "mesh_figure", "AXIS_ROLE", "MAX_RANKS"]

#: larger meshes are refused: one box per rank stops being readable
MAX_RANKS = 512


def _coords(mesh, rank: int) -> list:
    """``[TP, CP, PP, DP]`` of ``rank`` (claim C36's order)."""
    return [mesh.index(rank, a) for a in ("tp", "cp", "pp", "dp")]


def mesh_figure(mesh, axis: str = "tp", gpus_per_server: int = 8) -> go.Figure:
    """The figure of :class:`MeshView` (see there)."""
    return MeshView(mesh, axis, gpus_per_server).figure


class MeshView:
    """Grid of ``mesh``'s ranks coloured by their ``axis`` group.

    Args:
        mesh: a :class:`labkit.mesh.Mesh` (at most :data:`MAX_RANKS` ranks).
        axis: ``"tp"``, ``"cp"``, ``"pp"`` or ``"dp"``: whose groups share a colour.
        gpus_per_server: ranks per row; a row is one server, outlined.

    Attributes:
        groups: the ``axis`` groups (tuples of ranks), one trace each, in trace order.
        figure: the plotly figure: one scatter trace per group, one rectangle per server.

    :meth:`widget` is the interactive view (any axis's groups highlighted on hover);
    :meth:`html` its markup for one axis.

    Raises:
        ValueError: an unknown axis, ``gpus_per_server < 1``, or a mesh over
            :data:`MAX_RANKS` ranks (naming the numbers).
    """

    def __init__(self, mesh, axis: str = "tp", gpus_per_server: int = 8):
        if axis not in AXIS_ROLE:
            raise ValueError(f"axis must be one of {', '.join(AXIS_ROLE)}, got {axis!r}")
        if isinstance(gpus_per_server, bool) or not isinstance(gpus_per_server, int) \
                or gpus_per_server < 1:
            raise ValueError(f"gpus_per_server must be a positive int, got {gpus_per_server!r}")
        if mesh.size > MAX_RANKS:
            raise ValueError(f"a mesh of {mesh.size} ranks is over MeshView's {MAX_RANKS}; "
                             "plan it with labkit.plan instead")
        self.mesh, self.axis, self.width = mesh, axis, gpus_per_server
        self.groups = mesh.groups(axis)
        self.figure = self._draw()

    @staticmethod
    def planned(layout, cluster="llama3-24k", axis: str = "pp", **kwargs):
        """A planned ``layout`` (:class:`labkit.plan.layout.Layout`) on ``cluster`` (a
        :mod:`labkit.plan.hardware` preset), drawn summarised: a
        :class:`~labkit_widgets.mesh_planned.PlannedMeshView` (see there; ``kwargs`` go to
        it). Raises ``ValueError`` as it does."""
        return PlannedMeshView(layout, cluster, axis, **kwargs)

    def html(self, axis: str | None = None, uid: str | None = None) -> str:
        """The interactive grid's HTML for ``axis`` (default: the view's): a ``<style>`` block,
        a caption (the activation axis that ``axis`` splits, claim C7, and whether its groups
        stay inside a server, claim C34) and an inline SVG of one square per rank, placed at
        :meth:`position`, with classes naming its group on every axis (see
        :mod:`labkit_widgets.mesh_svg`). ``uid`` is the id its CSS is scoped under (default:
        a fresh random one).

        Raises:
            ValueError: an unknown axis, or a ``uid`` that is not a CSS identifier.
        """
        return mesh_html(self.mesh, self.axis if axis is None else axis, self.width,
                         new_uid() if uid is None else uid)

    def widget(self):
        """The interactive view: an ``ipywidgets.VBox`` of a ``ToggleButtons`` ("highlight
        groups of": tp, cp, pp, dp; starts at the view's axis) and an ``ipywidgets.HTML``
        holding :meth:`html` for the selected axis. Hovering a rank outlines every member of
        its group along that axis and fades the other ranks, in the browser alone; its
        tooltip gives its ``[TP, CP, PP, DP]`` coordinates and its group along each axis.
        Each call makes an independent box with its own CSS scope. :attr:`figure` and
        :attr:`groups` keep the axis given at construction."""
        import ipywidgets as W

        uid = new_uid()
        toggle = W.ToggleButtons(options=list(AXES4), value=self.axis,
                                 description="highlight groups of:",
                                 tooltip="the axis whose groups are coloured and outlined",
                                 tooltips=[f"{a.upper()} splits the {AXIS_ROLE[a]}"
                                           for a in AXES4],
                                 style={"description_width": "initial",
                                        "button_width": "56px"})
        grid = W.HTML(self.html(self.axis, uid))
        toggle.observe(lambda change: setattr(grid, "value", self.html(change["new"], uid)),
                       "value")
        box = W.VBox([toggle, grid])
        box.add_class("lk-mesh-view")
        return box

    def position(self, rank: int) -> tuple:
        """``(column, row)`` of ``rank``: its slot in its server, and the server."""
        return rank % self.width, rank // self.width

    def _draw(self) -> go.Figure:
        mesh, w = self.mesh, self.width
        fig = go.Figure()
        for i, group in enumerate(self.groups):
            xs, ys, hover = [], [], []
            for r in group:
                x, y = self.position(r)
                xs.append(x)
                ys.append(y)
                tp, cp, pp, dp = _coords(mesh, r)
                hover.append(f"rank {r}<br>[TP, CP, PP, DP] = [{tp}, {cp}, {pp}, {dp}]<br>"
                             f"{self.axis} group {i}: {list(group)}")
            fig.add_scatter(x=xs, y=ys, mode="markers+text", text=[str(r) for r in group],
                            hovertext=hover, hoverinfo="text", name=f"{self.axis} group {i}",
                            marker=dict(symbol="square", size=34,
                                        color=_PALETTE[i % len(_PALETTE)]),
                            textfont=dict(color="white"))
        servers = -(-mesh.size // w)
        for s in range(servers):
            n = min(w, mesh.size - s * w)
            fig.add_shape(type="rect", x0=-0.5, x1=n - 0.5, y0=s - 0.45, y1=s + 0.45,
                          line=dict(color="#555555", width=1, dash="dot"))
        roles = ", ".join(f"{a}: {AXIS_ROLE[a]}" for a in ("pp", "dp", "cp", "tp")
                          if mesh.degree(a) > 1)
        fig.update_layout(template="plotly_white", height=120 + 60 * servers,
                          title=f"{mesh.size} ranks, {servers} server(s) of {w}; colour = "
                                f"{self.axis} group ({roles or 'no parallel axes'})",
                          xaxis=dict(title="slot in the server", dtick=1, zeroline=False),
                          yaxis=dict(title="server", dtick=1, autorange="reversed",
                                     zeroline=False))
        return fig
