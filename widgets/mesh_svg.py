"""The interactive mesh grid's markup: an inline SVG of a :class:`labkit.mesh.Mesh`'s ranks and
the CSS that highlights, on hover, the group of the selected axis (claims C7, C34, C36).

:func:`mesh_html` returns one self-contained HTML fragment, ``<div id=UID class="lk-mesh"
data-axis=AXIS>`` holding a ``<style>`` block, a caption and the ``<svg>``:

* one ``<g class="rank g-tp-i g-cp-j g-pp-k g-dp-l" data-rank=r>`` per rank, where ``i`` is
  the position of the rank's tensor-parallel group in ``mesh.groups("tp")`` (likewise for the
  other axes), holding a ``<title>`` (the hover tooltip: the rank's ``[TP, CP, PP, DP]``
  coordinates, Dubey et al. 2024 §3.3.2, and its group along each axis), a square filled
  with the colour of its group along the selected axis, and its number;
* one dashed outline per server, the ranks placed as in :class:`MeshView`'s figure:
  column ``rank % gpus_per_server``, row ``rank // gpus_per_server``;
* CSS rules scoped under ``#UID``, one per group of each of the four axes, of the form
  ``#UID[data-axis="tp"]:has(.g-tp-3:hover) .g-tp-3 {...}``: hovering any member outlines
  every member of its group along the axis named by ``data-axis`` (and a rule that fades
  every other rank while one is hovered). Only the browser evaluates them (CSS ``:has()``),
  so hovering needs no kernel.

Geometry in CSS pixels: a rank's square is :data:`CELL` wide, its top-left corner at
``(LEFT + column · PITCH, TOP + row · ROW)``.
"""
from __future__ import annotations

import html
import re
import secrets

from .mesh_roles import AXES4, AXIS_ROLE
from .mesh_roles import PALETTE as _PALETTE

__all__ = ["AXES4", "CELL", "PITCH", "ROW", "LEFT", "TOP", "group_index", "hover_rules",
           "mesh_html", "new_uid"]

#: a rank's square (px), the distance between neighbouring squares in a server (px) and
#: between servers (px), the left margin for the "server s" labels (px), the top margin (px)
CELL, PITCH, ROW, LEFT, TOP = 40, 50, 60, 76, 6
_HIGHLIGHT = "#111111"
_UID = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


def new_uid() -> str:
    """A fresh element id for one view (random, so views of two kernels on a page differ)."""
    return f"lk-mesh-{secrets.token_hex(5)}"


def group_index(mesh, axis: str) -> dict:
    """``{rank: i}``: the position of each rank's ``axis`` group in ``mesh.groups(axis)``."""
    return {r: i for i, g in enumerate(mesh.groups(axis)) for r in g}


def hover_rules(mesh, uid: str) -> list:
    """The highlight rules: for each axis of :data:`AXES4` and each of its groups ``i``, one
    ``#uid[data-axis="<axis>"]:has(.g-<axis>-<i>:hover) .g-<axis>-<i> {...}`` (in that
    order). Its specificity (1, 4, 0) beats the fade rule's (1, 3, 0)."""
    return [f'#{uid}[data-axis="{a}"]:has(.g-{a}-{i}:hover) .g-{a}-{i} '
            f"{{ opacity: 1; stroke: {_HIGHLIGHT}; stroke-width: 3px; }}"
            for a in AXES4 for i in range(len(mesh.groups(a)))]


def _caption(mesh, axis: str, width: int) -> str:
    groups = mesh.groups(axis)
    deg = mesh.degree(axis)
    role = AXIS_ROLE[axis]
    if deg == 1:
        return (f"<b>{axis} = 1</b>: the activation is not split along its {role}; every rank is "
                f"its own {axis} group.")
    crossing = sum(len({r // width for r in g}) > 1 for g in groups)
    if crossing == 0:
        where = f"every {axis} group stays inside one server"
    elif crossing == len(groups):
        where = f"every {axis} group crosses a server boundary"
    else:
        where = f"{crossing} of {len(groups)} {axis} groups cross a server boundary"
    return (f"<b>colour = {axis} group</b> ({len(groups)} groups of {deg} ranks): "
            f"{axis.upper()} splits the activation along its {role} (claim C7); {where}. "
            f"Hover a rank to outline its {axis} group.")


def _title(mesh, rank: int, index: dict) -> str:
    coords = [mesh.index(rank, a) for a in AXES4]
    lines = [f"rank {rank}, [TP, CP, PP, DP] = {coords}"]
    lines += [f"{a} group {index[a][rank]}: {list(mesh.group(rank, a))}" for a in AXES4]
    return "\n".join(lines)


def mesh_html(mesh, axis: str, gpus_per_server: int, uid: str) -> str:
    """The view's HTML fragment (see the module docstring), squares coloured by their
    ``axis`` group with :class:`MeshView`'s palette.

    Raises:
        ValueError: an unknown ``axis``, or a ``uid`` that is not a CSS identifier.
    """
    if axis not in AXES4:
        raise ValueError(f"axis must be one of {', '.join(AXIS_ROLE)}, got {axis!r}")
    if not isinstance(uid, str) or not _UID.match(uid):
        raise ValueError(f"uid must be a CSS identifier (a letter, then letters, digits, - "
                         f"or _), got {uid!r}")
    w, n = gpus_per_server, mesh.size
    servers = -(-n // w)
    index = {a: group_index(mesh, a) for a in AXES4}
    s = f"#{uid}"
    css = [f"{s} {{ font: 13px sans-serif; color: #222; }}",
           f"{s} .lk-caption {{ margin: 0 0 6px 0; line-height: 1.4; }}",
           f"{s} .rank {{ stroke: #ffffff; stroke-width: 1px; cursor: default; }}",
           f"{s} .rank > text {{ stroke: none; fill: #ffffff; font: 13px sans-serif; "
           "text-anchor: middle; dominant-baseline: central; pointer-events: none; }",
           f"{s} .server {{ fill: none; stroke: #555555; stroke-width: 1px; "
           "stroke-dasharray: 3 3; }",
           f"{s} .server-label {{ fill: #555555; font: 12px sans-serif; "
           "dominant-baseline: central; }",
           f"{s}:has(.rank:hover) .rank {{ opacity: 0.35; }}"] + hover_rules(mesh, uid)
    body = []
    for srv in range(servers):
        k = min(w, n - srv * w)
        y = TOP + srv * ROW
        body.append(f'<rect class="server" x="{LEFT - 4}" y="{y - 4}" '
                    f'width="{(k - 1) * PITCH + CELL + 8}" height="{CELL + 8}"/>')
        body.append(f'<text class="server-label" x="4" y="{y + CELL / 2:g}">server {srv}</text>')
    colour = index[axis]
    for r in range(n):
        x, y = LEFT + (r % w) * PITCH, TOP + (r // w) * ROW
        cls = " ".join(f"g-{a}-{index[a][r]}" for a in AXES4)
        fill = _PALETTE[colour[r] % len(_PALETTE)]
        body.append(f'<g class="rank {cls}" data-rank="{r}">'
                    f"<title>{html.escape(_title(mesh, r, index))}</title>"
                    f'<rect x="{x}" y="{y}" width="{CELL}" height="{CELL}" rx="4" '
                    f'fill="{fill}"/>'
                    f'<text x="{x + CELL / 2:g}" y="{y + CELL / 2:g}">{r}</text></g>')
    width = LEFT + (min(w, n) - 1) * PITCH + CELL + 8
    height = TOP + (servers - 1) * ROW + CELL + 8
    return (f'<div id="{uid}" class="lk-mesh" data-axis="{axis}">'
            f"<style>\n" + "\n".join(css) + "\n</style>"
            f'<div class="lk-caption">{_caption(mesh, axis, w)}</div>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">' + "".join(body) + "</svg></div>")
