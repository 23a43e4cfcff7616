"""Emulated nodes (labkit.nodes, issue 27): placement, gloo's addresses, the bytes on the
shaped links, the flat fallback. Timings live in benchmarks/multinode.py."""
from __future__ import annotations

import os

import pytest

import labkit
from labkit import cluster as cluster_mod
from labkit import nodes


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def need_nodes() -> None:
    """Skip where the machine cannot emulate nodes (the reason), except in CI (root)."""
    reason = nodes.probe()
    if reason:
        if _in_ci():
            pytest.fail(f"{reason} (CI is set, so this is an error, not a skip)",
                        pytrace=False)
        pytest.skip(reason)


def test_rates_and_placement_are_checked_before_launch():
    assert nodes.parse_rate("1gbit") == 125e6 and nodes.parse_rate("100mbps") == 100e6
    assert nodes.parse_rate(5e6) == 5e6
    for bad in ("fast", "-1mbit", 0, "10 parsecs"):
        with pytest.raises(ValueError, match="inter_node"):
            nodes.parse_rate(bad)
    with pytest.raises(ValueError, match="nodes=3 must divide world_size=4"):
        labkit.Cluster(4, nodes=3)
    # consecutive blocks: tp (innermost, adjacent ranks) stays inside a node
    assert [nodes.node_of(r, 8, 2) for r in range(8)] == [0] * 4 + [1] * 4
    assert [nodes.node_of(r, 8, 4) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [nodes.node_of(r, 8, 2, "cyclic") for r in range(8)] == [0, 1] * 4
    with pytest.raises(ValueError, match="placement"):
        labkit.Cluster(4, nodes=2, placement="random")


def test_without_namespaces_the_cluster_says_so_in_one_line_and_runs_flat(monkeypatch, capsys):
    spawned = []

    def no_network(*a, **k):
        raise OSError("no emulated nodes: `unshare --net` failed (Operation not permitted)")

    monkeypatch.setattr(cluster_mod, "EmulatedNetwork", no_network)
    monkeypatch.setattr(cluster_mod, "spawn_ranks",
                        lambda *a: spawned.append(a) or ([], [], None))
    c = labkit.Cluster(4, nodes=2, replace=False)
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["labkit: no emulated nodes: `unshare --net` failed (Operation not "
                   "permitted); the ranks run flat"]
    assert c.network is None and spawned[0][4] is None  # ranks spawned without node specs
    assert "flat" in c.network_note


@pytest.mark.distributed
def test_two_nodes_place_ranks_bind_gloo_to_node_addresses_and_count_link_bytes():
    """One 4-rank cluster of 2 nodes: ranks 0,1 share node 0's namespace and 2,3 node 1's;
    every gloo connection leaves from the rank's node address; a send across the boundary
    is counted by the sender's tc class (the bytes plus TCP/IP headers, not more), and
    traffic inside a node crosses no link."""
    need_nodes()
    from jobs_nodes import node_facts, send

    # a generous start timeout: on a loaded 2-core machine 4 ranks may take minutes to start
    with labkit.Cluster(4, nodes=2, inter_node="1gbit", replace=False,
                        start_timeout_s=600) as c:
        facts = c.run(node_facts).outputs
        assert [f["node"] for f in facts] == ["0", "0", "1", "1"]
        assert facts[0]["netns"] == facts[1]["netns"] != facts[2]["netns"] == facts[3]["netns"]
        assert facts[0]["netns"] != os.readlink("/proc/self/ns/net")
        assert all(f["sum"] == [6.0] * 4 for f in facts)
        for r, f in enumerate(facts):
            mine = nodes.node_address(c.node_of(r))
            assert f["ifname"] == "eth0" and f["tcp"], (r, f)
            assert {loc for loc, _ in f["tcp"]} == {mine}, (r, f["tcp"])
            assert nodes.node_address(1 - c.node_of(r)) in {rem for _, rem in f["tcp"]}
        net, n = c.network, 4 << 20
        b0 = net.link_bytes()
        c.run(send, (0, 1, n))
        c.run(send, (3, 2, n))
        b1 = net.link_bytes()
        # inside a node nothing crosses (a few IPv6 neighbour messages may)
        assert b1[0] - b0[0] < 0.01 * n and b1[1] - b0[1] < 0.01 * n, (b0, b1)
        c.run(send, (1, 2, n))
        b2 = net.link_bytes()
        across = b2[0] - b1[0]
        # 64 KiB segments: headers < 1 %; leave room for a retransmission under load
        assert n <= across <= n * 1.05, (across, n)
        assert b2[1] - b1[1] < 0.05 * n, (b1, b2)  # the receiver sends only acknowledgements


def test_a_network_shapes_both_ends_of_each_cable_and_says_when_latency_cannot_be_added(capsys):
    """No ranks: the namespaces alone. Each node's eth0 and its switch port carry an htb
    class at the configured rate; latency is netem's or one line says it is missing."""
    need_nodes()
    net = nodes.EmulatedNetwork(2, "200mbit", latency_ms=2)
    try:
        for n, h in enumerate(net.members):
            cls = net.ns(h, "tc", "class", "show", "dev", "eth0")
            assert "htb 1:1" in cls and "rate 200Mbit" in cls, cls
            assert f"inet {nodes.node_address(n)}/24" in net.ns(h, "ip", "addr", "show", "eth0")
            port = net.ns(net.switch, "tc", "class", "show", "dev", f"n{n}")
            assert "rate 200Mbit" in port, port
        qdiscs = net.ns(net.members[0], "tc", "qdisc", "show", "dev", "eth0")
        if net.netem:
            assert net.latency_ms == 2 and "netem" in qdiscs and "delay 2ms" in qdiscs
        else:
            assert net.latency_ms is None and "netem" not in qdiscs
            assert capsys.readouterr().out.count("no netem") == 1
        holders = [h.pid for h in [net.switch, *net.members]]
    finally:
        net.close()
    assert not any(os.path.exists(f"/proc/{p}") for p in holders)  # nothing outlives it


def test_planner_prices_each_recorded_call_on_its_place_in_the_emulated_hierarchy():
    """labkit.plan.emulated by hand: 2 nodes x 2 ranks, 400 MB/s inside, a 100 MB/s node
    link shared by its 2 ranks (50 MB/s each), 1 ms / 2 ms per ring step."""
    from labkit.plan.emulated import emulated_spec, physical_order, predict_comm
    from labkit.plan.hardware import NCCL_BASE_LATENCY as base
    from labkit.trace import Event

    spec = emulated_spec(2, 2, 400e6, 100e6, 1e-3, 2e-3)
    cyc = physical_order(range(4), lambda r: nodes.node_of(r, 4, 2, "cyclic"))
    assert cyc == {0: 0, 2: 1, 1: 2, 3: 3}  # node 0's ranks first, as the planner numbers
    blk = physical_order(range(4), lambda r: nodes.node_of(r, 4, 2))
    s = 8e6  # an all-reduce of 8 MB over 2 ranks: each sends 8 MB (2(n-1)/n = 1)
    ar = lambda peers: Event(0, "all_reduce", "comm", 0, 1, 1, "all_reduce", s, s, "tp",  # noqa: E731
                             peers)
    inside = base + 2 * 1e-3 + s / 400e6
    across = base + 2 * 2e-3 + s / 50e6
    assert predict_comm([ar((0, 1))], spec, blk) == pytest.approx(inside)
    assert predict_comm([ar((0, 1))], spec, cyc) == pytest.approx(across)  # 0,1 in 2 nodes
    send = Event(0, "send", "p2p", 0, 1, 1, "send", 1e6, 0, "pp", (2,))
    assert predict_comm([send], spec, blk) == pytest.approx(base + 2e-3 + 1e6 / 50e6)
    assert predict_comm([send], spec, cyc) == pytest.approx(base + 1e-3 + 1e6 / 400e6)
    compute = Event(0, "forward", "compute", 0, 1, 1)
    assert predict_comm([compute, ar((0,))], spec, blk) == 0.0
