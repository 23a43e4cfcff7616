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
