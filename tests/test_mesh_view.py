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


# --------------------------------------------------------------------------- planned layouts
import math  # noqa: E402

from labkit.plan import Layout, estimate  # noqa: E402
from labkit.plan.layout import layout_from_mesh  # noqa: E402
from labkit_widgets.mesh_planned import PlannedMeshView, pick  # noqa: E402
from labkit_widgets.mesh_summary import summarize_layout  # noqa: E402

AX4 = ("tp", "cp", "pp", "dp")
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
