"""MeshView: every rank drawn once, in its server's row, coloured by its group of the chosen
axis, its hover giving the mesh's own [TP, CP, PP, DP] coordinates and group."""
from __future__ import annotations

import pytest

from labkit.mesh import Mesh
from labkit_widgets.mesh_view import MAX_RANKS, MeshView


@pytest.mark.parametrize("axis", ["tp", "pp", "dp", "cp"])
def test_traces_are_the_mesh_groups_and_hover_gives_coordinates(axis):
    mesh = Mesh(pp=2, dp_replicate=2, dp_shard=1, cp=2, tp=2)   # 16 ranks, two servers of 8
    view = MeshView(mesh, axis)
    fig = view.figure
    assert view.groups == mesh.groups(axis)
    assert len(fig.data) == len(mesh.groups(axis))
    drawn = [int(t) for tr in fig.data for t in tr.text]
    assert sorted(drawn) == list(range(16))
    for tr, group in zip(fig.data, mesh.groups(axis)):
        assert [int(t) for t in tr.text] == list(group)
        for r, x, y, hover in zip(group, tr.x, tr.y, tr.hovertext):
            assert (x, y) == (r % 8, r // 8)
            coords = [mesh.index(r, a) for a in ("tp", "cp", "pp", "dp")]
            assert f"rank {r}<br>[TP, CP, PP, DP] = {coords}" in hover
            assert str(list(group)) in hover
    assert len(fig.layout.shapes) == 2   # one outline per server


def test_tp_stays_inside_a_server_and_pp_crosses_servers():
    mesh = Mesh(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=8)
    tp = MeshView(mesh, "tp")
    assert all(len({tp.position(r)[1] for r in g}) == 1 for g in tp.groups)  # claim C34
    pp = MeshView(mesh, "pp")
    assert all(len({pp.position(r)[1] for r in g}) == 2 for g in pp.groups)


def test_bad_input():
    mesh = Mesh(pp=1, dp_replicate=2, dp_shard=1, cp=1, tp=2)
    with pytest.raises(ValueError, match="axis must be one of"):
        MeshView(mesh, "ep")
    with pytest.raises(ValueError, match="gpus_per_server"):
        MeshView(mesh, "tp", gpus_per_server=0)
    big = Mesh(pp=16, dp_replicate=8, dp_shard=1, cp=1, tp=8)
    with pytest.raises(ValueError, match=f"1024 ranks is over MeshView's {MAX_RANKS}"):
        MeshView(big, "tp")


# --------------------------------------------------------------------------- interactive grid
import re  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402

from labkit_widgets import mesh_svg  # noqa: E402
from labkit_widgets.mesh_view import _PALETTE  # noqa: E402

AX4 = ("tp", "cp", "pp", "dp")   # [TP, CP, PP, DP] (claim C36)

HOVER = [(Mesh(pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=2), 4),
         (Mesh(pp=2, dp_replicate=2, dp_shard=1, cp=2, tp=2), 8),
         (Mesh(pp=3, dp_shard=2, cp=1, tp=1), 4),        # a last server only half full
         (Mesh(pp=1, dp_replicate=2, dp_shard=2, cp=3, tp=2), 5)]
HOVER_IDS = ["x".join(map(str, m.shape)) + f"-gps{w}" for m, w in HOVER]


def _ranks(root) -> dict:
    """``{rank: <g>}`` of every rank element of the grid."""
    gs = [g for g in root.iter("{http://www.w3.org/2000/svg}g")
          if "rank" in g.get("class", "").split()]
    out = {int(g.get("data-rank")): g for g in gs}
    assert len(out) == len(gs), "a rank drawn twice"
    return out


def _css(html_text: str) -> str:
    return re.search(r"<style>(.*?)</style>", html_text, re.S).group(1)


@pytest.mark.parametrize("mesh,gps", HOVER, ids=HOVER_IDS)
@pytest.mark.parametrize("axis", AX4)
def test_grid_draws_each_rank_once_in_its_slot_with_its_group_on_every_axis(mesh, gps, axis):
    root = ET.fromstring(MeshView(mesh, axis, gps).html(uid="lk-test"))
    assert (root.get("id"), root.get("data-axis")) == ("lk-test", axis)
    ranks = _ranks(root)
    assert sorted(ranks) == list(range(mesh.size))
    svg = "{http://www.w3.org/2000/svg}"
    members = {}                                     # (axis, group index) -> ranks
    for r, g in ranks.items():
        rect = g.find(f"{svg}rect")
        assert (int(rect.get("x")), int(rect.get("y"))) == (
            mesh_svg.LEFT + (r % gps) * mesh_svg.PITCH, mesh_svg.TOP + (r // gps) * mesh_svg.ROW)
        assert g.find(f"{svg}text").text == str(r)
        classes = g.get("class").split()
        for a in AX4:
            mine = [c for c in classes if c.startswith(f"g-{a}-")]
            assert len(mine) == 1, (r, a, classes)
            members.setdefault((a, int(mine[0].rsplit("-", 1)[1])), []).append(r)
        title = g.find(f"{svg}title").text
        coords = [mesh.index(r, a) for a in AX4]
        assert title.startswith(f"rank {r}, [TP, CP, PP, DP] = {coords}\n"), title
        for a in AX4:
            i = mesh.groups(a).index(mesh.group(r, a))
            assert f"\n{a} group {i}: {list(mesh.group(r, a))}" in title
        i = mesh.groups(axis).index(mesh.group(r, axis))
        assert rect.get("fill") == _PALETTE[i % len(_PALETTE)]
    for a in AX4:   # class g-<a>-<i> is carried by exactly the ranks of mesh.groups(a)[i]
        assert {i: tuple(rs) for (b, i), rs in members.items() if b == a} == \
            dict(enumerate(mesh.groups(a))), a
    servers = [e for e in root.iter(f"{svg}rect") if e.get("class") == "server"]
    assert len(servers) == -(-mesh.size // gps)
    for s, e in enumerate(servers):   # each outline holds exactly its server's squares
        x0, y0 = float(e.get("x")), float(e.get("y"))
        x1, y1 = x0 + float(e.get("width")), y0 + float(e.get("height"))
        inside = {r for r, g in ranks.items()
                  if x0 <= float(g.find(f"{svg}rect").get("x")) <= x1 - mesh_svg.CELL
                  and y0 <= float(g.find(f"{svg}rect").get("y")) <= y1 - mesh_svg.CELL}
        assert inside == set(range(s * gps, min((s + 1) * gps, mesh.size))), s
        k = len(inside)                  # and reaches no empty slot of a last, partial server
        assert x1 < mesh_svg.LEFT + k * mesh_svg.PITCH and y1 < y0 + mesh_svg.ROW, s


@pytest.mark.parametrize("mesh,gps", HOVER, ids=HOVER_IDS)
def test_css_has_one_scoped_hover_rule_per_group_of_each_axis(mesh, gps):
    css = _css(MeshView(mesh, "tp", gps).html(uid="lk-a1"))
    rules = [r.strip() for r in css.split("}") if r.strip()]
    assert all(r.startswith("#lk-a1") for r in rules), "a selector outside the view's scope"
    hover = re.compile(r'^#lk-a1\[data-axis="(\w+)"\]:has\(\.g-(\w+)-(\d+):hover\) '
                       r'\.g-(\w+)-(\d+) \{(.*)$', re.S)
    found = {a: [] for a in AX4}
    for r in rules:
        m = hover.match(r)
        if m:
            a, b, i, c, j, body = m.groups()
            assert a == b == c and i == j, r
            assert "stroke-width: 3px" in body and "opacity: 1" in body, r
            found[a].append(int(i))
    for a in AX4:
        assert found[a] == list(range(len(mesh.groups(a)))), a
    assert "#lk-a1:has(.rank:hover) .rank { opacity: 0.35;" in rules   # the others fade


def test_toggle_changes_the_axis_and_the_colours_only():
    mesh = Mesh(pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=2)
    view = MeshView(mesh, "tp", gpus_per_server=4)
    box = view.widget()
    toggle, grid = box.children
    assert list(toggle.options) == list(AX4) and toggle.value == "tp"
    before = ET.fromstring(grid.value)
    uid = before.get("id")
    assert uid.startswith("lk-mesh-") and before.get("data-axis") == "tp"
    for axis in ("pp", "dp", "cp", "tp"):
        toggle.value = axis
        after = ET.fromstring(grid.value)
        assert (after.get("id"), after.get("data-axis")) == (uid, axis)
        index = {r: i for i, g in enumerate(mesh.groups(axis)) for r in g}
        fills = {r: g.find("{http://www.w3.org/2000/svg}rect").get("fill")
                 for r, g in _ranks(after).items()}
        assert fills == {r: _PALETTE[i % len(_PALETTE)] for r, i in index.items()}, axis
        assert grid.value == view.html(axis, uid)   # the same markup but axis and colours
        assert _css(grid.value) == _css(view.html("tp", uid))
    assert (view.axis, view.groups) == ("tp", mesh.groups("tp"))   # the figure's axis stays
    other = ET.fromstring(view.widget().children[1].value).get("id")
    assert other != uid                                              # two views, two scopes


def test_caption_names_the_activation_axis_and_the_server_boundary():
    mesh = Mesh(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=8)
    cap = {a: ET.fromstring(MeshView(mesh, a).html(uid="u")).find("div").itertext()
           for a in AX4}
    cap = {a: "".join(t) for a, t in cap.items()}
    assert "TP splits the activation along its channels (claim C7); every tp group stays " \
           "inside one server" in cap["tp"]
    assert "PP splits the activation along its layers (claim C7); every pp group crosses a " \
           "server boundary" in cap["pp"]
    assert "cp = 1: the activation is not split along its sequence" in cap["cp"]
    odd = MeshView(Mesh(dp_replicate=4, tp=3), "tp", gpus_per_server=4).html(uid="u")
    assert "2 of 4 tp groups cross a server boundary" in odd    # (3,4,5) and (6,7,8)


def test_grid_bad_input():
    view = MeshView(Mesh(pp=1, dp_replicate=2, dp_shard=1, cp=1, tp=2), "tp")
    with pytest.raises(ValueError, match="axis must be one of pp, dp, cp, tp, got 'ep'"):
        view.html("ep")
    with pytest.raises(ValueError, match="uid must be a CSS identifier"):
        view.html("tp", uid='x"><script>')


# --------------------------------------------------------------------------- planned layouts
import math  # noqa: E402

from labkit.plan import Layout, estimate  # noqa: E402
from labkit.plan.layout import layout_from_mesh  # noqa: E402
from labkit_widgets.mesh_planned import PlannedMeshView, pick  # noqa: E402
from labkit_widgets.mesh_summary import summarize_layout  # noqa: E402

SMALL = [Mesh(pp=2, dp_shard=2, cp=2, tp=2), Mesh(pp=2, dp_replicate=2, dp_shard=2, tp=4),
         Mesh(pp=4, tp=2, cp=3), Mesh(pp=3, dp_shard=2, tp=1, cp=2)]


@pytest.mark.parametrize("mesh", SMALL, ids=lambda m: "x".join(map(str, m.shape)))
def test_planned_summary_is_the_mesh_counted(mesh):
    """Servers, group sizes, counts, strides, members per server and servers per group of the
    planned layout equal what labkit.mesh.Mesh's own groups give (its rank order: pp
    outermost, unlike Llama 3's), on servers of 8 GPUs (claims C34, C36)."""
    s = summarize_layout(layout_from_mesh(mesh), "llama3-24k")
    assert (s.n_gpus, s.gpus_per_server, s.servers) == (mesh.size, 8, math.ceil(mesh.size / 8))
    for a in AX4:
        ax, groups = s.axes[a], mesh.groups(a)
        assert (ax.degree, ax.groups) == (mesh.degree(a), len(groups)), a
        if ax.degree > 1:
            assert {g[i + 1] - g[i] for g in groups for i in range(len(g) - 1)} == {ax.stride}
        per = [max(sum(r // 8 == v for r in g) for v in {r // 8 for r in g}) for g in groups]
        span = [len({r // 8 for r in g}) for g in groups]
        assert ax.per_server == max(per) and ax.servers == (min(span), max(span)), a
    for r in range(mesh.size):
        assert s.layout.coords(r) == [mesh.index(r, a) for a in AX4]


@pytest.mark.parametrize("mesh", SMALL, ids=lambda m: "x".join(map(str, m.shape)))
def test_planned_view_of_a_small_layout_draws_every_rank_of_the_mesh(mesh):
    view = PlannedMeshView(layout_from_mesh(mesh), "llama3-24k", "dp")
    assert None not in view.stages + view.replicas + view.cps   # small: nothing elided
    drawn = sorted(r for ranks in view.cells.values() for r in ranks)
    assert drawn == list(range(mesh.size))
    for (d, c, p), ranks in view.cells.items():
        assert ranks == mesh.group(ranks[0], "tp")              # a cell is one TP group
        assert [mesh.index(ranks[0], a) for a in ("dp", "cp", "pp")] == [d, c, p]
    strip, grid = view.figure.data[0], view.figure.data[1]
    assert [int(t) for t in strip.text] == list(range(min(8, mesh.size)))
    for first, hover in zip(grid.text, grid.hovertext):
        r = int(first.replace(",", ""))
        assert f"rank {r}: [TP, CP, PP, DP] = {[mesh.index(r, a) for a in AX4]}" in hover
        for a in AX4:
            g = mesh.group(r, a)
            if len(g) > 1:
                assert (f"{a} group: {len(g)} ranks, stride {g[1] - g[0]} ({g[0]}, {g[1]}, …, "
                        f"{g[-1]})") in hover, (a, hover)
        assert f"server {r // 8}" in hover


def test_llama3_405b_is_drawn_summarised_with_exact_numbers():
    """Llama 3 405B's TP 8 x PP 16 x DP 128 on its 24,576-GPU cluster (claims C3, C34, C36):
    2,048 servers, TP inside each, PP and DP across, and the levels the planner charges."""
    lay = Layout(tp=8, pp=16, dp=128, zero=1, global_batch=2048, seq_len=8192,
                 checkpoint="full")
    view = PlannedMeshView(lay, "llama3-24k")
    s = view.summary
    assert (s.n_gpus, s.servers) == (16384, 2048)
    assert s.domains == (("rack", 16, 1024, False), ("pod", 3072, 6, True),
                         ("cluster", 24576, 1, True))
    want = {"tp": (8, 1, 2048, 8, (1, 1), "nvlink"), "cp": (1, 8, 16384, 1, (1, 1), "hbm"),
            "pp": (16, 8, 1024, 1, (16, 16), "pod"), "dp": (128, 128, 128, 1, (128, 128),
                                                          "cluster")}
    for a, (deg, stride, groups, per, span, level) in want.items():
        ax = s.axes[a]
        assert (ax.degree, ax.stride, ax.groups, ax.per_server, ax.servers,
                ax.placement.level) == (deg, stride, groups, per, span, level), a
    assert s.axes["tp"].placement.bandwidth == 450e9 and not s.axes["tp"].crosses_servers
    assert s.axes["pp"].crosses_servers and s.axes["dp"].crosses_servers
    plan = estimate("llama3-405b", "llama3-24k", lay)   # the levels the planner charges
    assert plan.comm["tp"].level == s.axes["tp"].placement.level
    assert plan.comm["pp"].level == s.axes["pp"].neighbour.level == "rack"
    assert plan.comm["dp"].level == s.axes["dp"].placement.level
    assert view.stages == list(range(16)) and view.replicas == [0, 1, None, 127]
    assert len(view.cells) == 3 * 16 and view.cells[(127, 0, 15)] == tuple(range(16376, 16384))
    notes = [a.text for a in view.figure.layout.annotations]
    assert "⋮ 125 more data-parallel replicas" in notes
    table = view.figure.data[2].cells.values
    assert list(table[0]) == ["TP", "CP", "PP", "DP"] and list(table[3]) == ["1", "–", "8", "128"]
    assert "pod, 50 GB/s; neighbours rack" in list(table[7])
    assert "2,048 servers of 8 GPUs · 1,024 racks of 16 GPUs" in s.describe()


def test_pick_and_bad_input():
    assert pick(4, 4) == [0, 1, 2, 3] and pick(128, 4) == [0, 1, None, 127]
    lay = Layout(tp=8, pp=16, dp=128)
    with pytest.raises(ValueError, match="axis must be one of"):
        PlannedMeshView(lay, "llama3-24k", "ep")
    with pytest.raises(ValueError, match="max_stages must be an int >= 3"):
        PlannedMeshView(lay, "llama3-24k", max_stages=2)
    with pytest.raises(ValueError, match="16,384 GPUs; h100-server has 8"):
        MeshView.planned(lay, "h100-server")
    with pytest.raises(ValueError, match="order must be a permutation"):
        summarize_layout(lay.with_(order=("tp", "tp", "pp", "dp")), "llama3-24k")
    with pytest.raises(ValueError, match="unknown cluster"):
        summarize_layout(lay, "nowhere")
