"""The device mesh: coordinates, groups and views (pure), and the per-pool group cache:
re-running a configuration creates no process group."""
from __future__ import annotations

import itertools
import pickle

import pytest

from labkit.mesh import AXES, Mesh


def test_coordinates_round_trip_and_tp_is_innermost():
    m = Mesh(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert m.size == 32
    for r in range(m.size):
        assert m.rank(**m.coords(r)) == r
    assert m.coords(1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert m.coords(16)["pp"] == 1  # pp outermost
    assert m.group(0, "tp") == (0, 1)  # tp ranks adjacent


@pytest.mark.parametrize("axes", list(AXES) + ["dp", "dp_cp", "fsdp", "ep", "edp",
                                               ("pp", "tp"), ("dp_shard", "cp")])
def test_groups_partition_the_ranks(axes):
    m = Mesh(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=1, ep=4)
    groups = m.groups(axes)
    flat = sorted(itertools.chain.from_iterable(groups))
    assert flat == list(range(m.size))
    assert all(len(g) == m.degree(axes) for g in groups)
    for r in range(m.size):
        g = m.group(r, axes)
        assert r in g and list(g) == sorted(g)
        assert m.index(r, axes) == g.index(r)


def test_views_are_products_of_axes():
    m = Mesh(dp_replicate=2, dp_shard=3, cp=2)
    assert m.degree("dp") == 6 and m.degree("dp_cp") == 12 and m.degree("fsdp") == 6
    # the fsdp shard group: same replica, every shard and cp coordinate
    assert m.group(0, "fsdp") == tuple(range(6))
    assert m.group(0, "dp_replicate") == (0, 6)


def test_expert_view_splits_the_data_ranks_without_adding_ranks():
    m = Mesh(dp_shard=4, tp=2, ep=2)
    assert m.size == 8
    assert m.groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert m.groups("edp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    with pytest.raises(ValueError, match=r"ep=3 must divide the data ranks .* = 4"):
        Mesh(dp_shard=4, ep=3)


def test_required_groups_are_deterministic_and_cover_every_axis():
    m = Mesh(pp=2, dp_shard=2, tp=2)
    a, b = m.required_groups(), Mesh(pp=2, dp_shard=2, tp=2).required_groups()
    assert a == b and len(a) == len(set(a))
    for name in ("tp", "pp", "dp_shard", "dp_cp"):
        assert all(g in a for g in m.groups(name))
    # HSDP with one shard per replica group still gets its one-rank shard groups
    assert (0,) in Mesh(dp_replicate=2).required_groups()


def test_mesh_is_frozen_picklable_and_checks_its_degrees():
    m = Mesh(pp=2, tp=2)
    assert pickle.loads(pickle.dumps(m)) == m and hash(m) == hash(Mesh(pp=2, tp=2))
    with pytest.raises(ValueError, match="Mesh.tp must be a positive int, got 0"):
        Mesh(tp=0)
    with pytest.raises(ValueError, match="rank 8 is outside the mesh of 8 ranks"):
        Mesh(pp=8).coords(8)
    with pytest.raises(ValueError, match="unknown mesh axis 'xx'"):
        m.groups("xx")
    text = m.describe()
    assert "pp=2 x tp=2" in text and "tp           groups: (0,1) (2,3)" in text


@pytest.mark.distributed
def test_rerunning_a_configuration_creates_no_process_group(cluster4):
    """The pool creates a job's groups once (DESIGN §9): slider re-runs of the same
    composition leave torch's group count unchanged, and so does switching to a smaller job
    and back; a full-world HSDP job after a partial-cluster job runs (its groups were
    created by every rank, so no member's group counter is out of step). Five re-runs: a
    job that creates a group it should have reused does so on every run, so the count is
    already off after the first."""
    from jobs_for_tests import group_count

    from labkit import jobs
    from labkit.config import RunConfig

    cfg = RunConfig(steps=1, measure_memory=False, count_flops=False).replace(dp=2, pp=2)
    cluster4.run(jobs.train, cfg)
    before = cluster4.run(group_count).outputs
    for _ in range(5):
        cluster4.run(jobs.train, cfg)
    assert cluster4.run(group_count).outputs == before
    cluster4.run(jobs.train, cfg.replace(dp=1, pp=1))  # a job on 1 of the 4 ranks
    hsdp = RunConfig(steps=1, measure_memory=False, count_flops=False, zero_stage=3,
                     hsdp_replicas=2).replace(dp=4)
    cluster4.run(jobs.train, hsdp)
    after = cluster4.run(group_count).outputs
    cluster4.run(jobs.train, cfg)
    cluster4.run(jobs.train, hsdp)
    assert cluster4.run(group_count).outputs == after
    assert all(a["torch_groups"] == after[0]["torch_groups"] for a in after)
