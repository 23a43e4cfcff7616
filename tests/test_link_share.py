"""The emulated links as the step model prices them: the share of a node's link a crossing
call had (labkit.measure.link_share), the links' α–β fit over a sweep and the pairs it
times (labkit.measure.hierarchy, labkit.collectives.links). Hand-computed values; no ranks."""
import pytest

from labkit import nodes
from labkit.collectives.links import link_pairs
from labkit.measure.hierarchy import fit_alpha_beta
from labkit.measure.link_share import link_efficiency
from labkit.measure.step_model import predict_step
from labkit.plan.emulated import emulated_spec, physical_order
from labkit.trace import Event

# cyclic placement of 4 ranks on 2 nodes: ranks 0, 2 in node 0 and 1, 3 in node 1
CYCLIC = physical_order(range(4), lambda r: nodes.node_of(r, 4, 2, "cyclic"))


def _ar(rank, start, end, peers, nbytes=1e6):
    return Event(rank, "all_reduce", "comm", start, end, step=1, op="all_reduce",
                 bytes_sent=nbytes, peers=peers, axis="tp")


def test_a_call_gets_the_link_share_its_overlap_with_the_nodes_other_groups_leaves():
    """Two tensor-parallel groups, (0, 1) and (2, 3), each crossing: the planner gives each
    half of node 0's link (per_node 2, g 1). Rank 0's call [0, 1] overlapped by rank 2's
    call of the other group over [0.5, 1]: k = 1.5 flows, factor 2 / 1.5."""
    a = _ar(0, 0.0, 1.0, (0, 1))
    b = _ar(2, 0.5, 1.5, (2, 3))
    got = link_efficiency([a, b], CYCLIC, 2)
    assert got[id(a)] == pytest.approx(2 / 1.5)
    assert got[id(b)] == pytest.approx(2 / 1.5)   # b is covered over [0.5, 1] of its 1 s
    # fully together: the planner's worst case holds exactly; apart: the whole link each
    c = _ar(2, 0.0, 1.0, (2, 3))
    assert link_efficiency([a, c], CYCLIC, 2)[id(a)] == pytest.approx(1.0)
    d = _ar(2, 1.0, 2.0, (2, 3))
    assert link_efficiency([a, d], CYCLIC, 2)[id(a)] == pytest.approx(2.0)
    # two calls of rank 2 covering the same half count it once
    halves = [_ar(2, 0.5, 1.0, (2, 3)), _ar(2, 0.6, 0.9, (2, 3))]
    assert link_efficiency([a, *halves], CYCLIC, 2)[id(a)] == pytest.approx(2 / 1.5)
    # a call inside a node is not priced on the link: absent
    inside = _ar(0, 0.0, 1.0, (0, 2))
    assert id(inside) not in link_efficiency([inside, c], CYCLIC, 2)


def test_a_group_spanning_both_nodes_uses_the_whole_link_and_the_same_groups_ranks_are_one_flow():
    """FSDP over all 4 ranks (2 per node): the planner already gives the group the whole
    link (g = per_node); its own ranks' calls are not other flows."""
    ring = (0, 1, 2, 3)
    calls = [_ar(r, 0.0, 1.0, ring) for r in range(4)]
    got = link_efficiency(calls, CYCLIC, 2)
    assert got == {id(c): pytest.approx(1.0) for c in calls}
    # rank 2 in a two-rank group crossing beside rank 0's: the other group has one member
    # on node 0, so it adds a whole flow when it overlaps all of the call
    a, b = _ar(0, 0.0, 1.0, (0, 1)), _ar(2, 0.0, 1.0, (2, 3))
    assert link_efficiency([a, b], CYCLIC, 2)[id(a)] == pytest.approx(1.0)
    # the caller's own call of another group (a data-parallel bucket in flight over half
    # of a tensor-parallel call) is another flow; a second call of its own group is not
    tp, dp = _ar(0, 0.0, 1.0, (0, 1)), _ar(0, 0.5, 3.0, (0, 3))
    again = _ar(0, 0.0, 1.0, (0, 1))
    assert link_efficiency([tp, dp, again], CYCLIC, 2)[id(tp)] == pytest.approx(2 / 1.5)


def test_the_step_model_prices_a_crossing_call_with_its_share_and_the_worst_case_without():
    """Both ranks of node 0 all-reduce 10 MB across, apart in time: the shared-links replay
    gives each the whole 100 MB/s link; the worst case, half of it."""
    spec = emulated_spec(2, 2, 400e6, 100e6, 1e-3, 2e-3)
    ev = []
    for r, t0 in ((0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)):
        peers = (0, 1) if r in (0, 1) else (2, 3)
        ev.append(Event(r, "f", "compute", 0.0, t0, step=1))
        ev.append(_ar(r, t0, t0 + 0.2, peers, nbytes=10e6))

    class T:
        events = ev

        def filter(self, rank=None, step=None):
            return [e for e in ev if (rank is None or e.rank == rank)
                    and (step is None or e.step == step)]

    base = 8.4e-6 + 2 * 2e-3
    whole = predict_step(T(), range(4), [1], spec, CYCLIC)
    worst = predict_step(T(), range(4), [1], spec, CYCLIC, shared_links=False)
    assert whole["per_rank"][0] == pytest.approx(base + 10e6 / 100e6)
    assert worst["per_rank"][0] == pytest.approx(base + 10e6 / 50e6)
    assert whole["per_rank"][2] == pytest.approx(1.0 + base + 10e6 / 100e6)


def test_the_links_line_takes_busbw_from_the_big_calls_and_the_hop_from_every_size():
    """t = base + 2·hop + S / busbw recovered exactly from points on it; busbw from the
    calls of >= 1 MiB alone; the hop is the median of what each size leaves, so one noisy
    tiny call or one fast mid-size call moves neither term; one size is refused."""
    base, hop, bw = 8.4e-6, 2e-4, 60e6
    sizes = (4096, 65536, 262144, 1 << 20, 2 << 20, 4 << 20)
    pts = [(s, base + 2 * hop + s / bw) for s in sizes]
    got_hop, got_bw = fit_alpha_beta(pts, base)
    assert got_hop == pytest.approx(hop, rel=1e-9) and got_bw == pytest.approx(bw, rel=1e-9)
    # the 4 KiB call 3x slow and the 256 KiB one on the bucket's credit (half its time):
    # busbw exact, hop exact (the median of six residuals, four of them on the line)
    noisy = list(pts)
    noisy[0] = (sizes[0], 3 * pts[0][1])
    noisy[2] = (sizes[2], 0.5 * pts[2][1])
    h2, b2 = fit_alpha_beta(noisy, base)
    assert b2 == pytest.approx(bw, rel=1e-9) and h2 == pytest.approx(hop, rel=1e-9)
    # the big calls 10 % slow (a slower link): busbw follows them, not the small calls
    slow = [(s, t + (0.1 * s / bw if s >= 1 << 20 else 0.0)) for s, t in pts]
    assert fit_alpha_beta(slow, base)[1] == pytest.approx(bw / 1.1, rel=1e-9)
    # fewer sizes than the cut: the two largest set the slope; a hop below 0 is clamped
    h3, b3 = fit_alpha_beta([(1e3, 1e-6 + 1e3 / bw), (1e4, 1e-6 + 1e4 / bw)], 1e-4)
    assert h3 == 0.0 and b3 == pytest.approx(bw, rel=1e-9)
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit_alpha_beta([(4096, 1e-3), (4096, 2e-3)])


class _Cluster:
    def __init__(self, world, n, placement):
        self.world_size, self.nodes, self.placement = world, n, placement

    def node_of(self, r):
        return nodes.node_of(r, self.world_size, self.nodes, self.placement)


@pytest.mark.parametrize("world,n,placement,want", [
    (4, 2, "block", ((0, 1), (0, 2))),
    (4, 2, "cyclic", ((0, 2), (0, 1))),
    (8, 2, "cyclic", ((0, 2), (0, 1))),
    (8, 4, "block", ((0, 1), (0, 2))),
    (8, 4, "cyclic", ((0, 4), (0, 1))),
])
def test_the_inside_pair_shares_a_node_and_the_across_pair_does_not(world, n, placement, want):
    c = _Cluster(world, n, placement)
    inside, across = link_pairs(c)
    assert (inside, across) == want
    assert c.node_of(inside[0]) == c.node_of(inside[1])
    assert c.node_of(across[0]) != c.node_of(across[1])


def test_measure_links_times_the_pairs_of_the_clusters_placement():
    """measure_links asks the ranks to time link_pairs' groups (a cyclic cluster's ranks 0
    and 1 sit in different nodes) and labels the rows by them."""
    from labkit.collectives.links import measure_links

    class Run(_Cluster):
        inter_node = 62.5e6

        def run(self, job, cfg):
            self.groups = cfg.groups

            class R:
                outputs = [[{"group": g, "op": "all_reduce", "call": 0, "time_s": 1e-3}
                            for g in cfg.groups]]
            return R()

    c = Run(4, 2, "cyclic")
    rows = {r["where"]: r["group"] for r in measure_links(c, ("all_reduce",), 1024, 1)}
    assert c.groups == ((0, 2), (0, 1)) and rows == {"inside": (0, 2), "across": (0, 1)}
