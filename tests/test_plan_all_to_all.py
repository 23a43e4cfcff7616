"""The planner's all-to-all time (issues 29/C43, C41): switched clusters (NVLink inside a
server, each GPU's own adapter across), the torus's bisection bound, and the expert
all-to-alls of one DeepSeek-V3 layer — every number computed by hand here."""
import pytest

from labkit.plan import Layout, estimate
from labkit.plan.experts import expert_all_to_all_time
from labkit.plan.hardware import cluster_preset
from labkit.plan.models import PLAN_MODELS
from labkit.plan.network import all_to_all_time, collective_time, place
from labkit.plan.runtime import runtime_preset

BASE, ETA = 8.4e-6, 0.8


def test_switched_all_to_all_uses_nvlink_inside_and_each_gpus_adapter_across():
    """64 ranks on 8 servers of DeepSeek-V3's H800s (NVLink 200 GB/s, IB 50 GB/s per GPU
    per direction): of S bytes, 7/64 stay in the server, 56/64 leave through the rank's own
    adapter (not 8 pooled, as a ring's g·NIC); the slower sets the time."""
    c = cluster_preset("deepseek-h800-2048")
    pl = place(c, (64, 1))
    assert (pl.per_server, pl.nic_bandwidth, pl.inside_bandwidth) == (8, 50e9, 200e9)
    S = 1e9
    t = all_to_all_time(S, pl)
    assert t == pytest.approx(BASE + 9.6e-6 + 56 / 64 * S / (50e9 * ETA))
    assert collective_time("all_to_all", S, pl) == t
    # a ring of the same group would get min(NVLink, 8·IB) = 200 GB/s: 4x too fast
    assert pl.bandwidth == 200e9
    # inside one server: NVLink only
    t8 = all_to_all_time(S, place(c, (8, 1)))
    assert t8 == pytest.approx(BASE + 3.4e-6 + 7 / 8 * S / (200e9 * ETA))
    # bytes the runtime sends across instead (one copy per server)
    assert all_to_all_time(S, pl, across_bytes=0.25 * S) == pytest.approx(
        BASE + 9.6e-6 + 0.25 * S / (50e9 * ETA))


def test_torus_all_to_all_is_bisection_bound():  # claim C41
    """The scaling book (Part 3, AllToAll): on a bidirectional ring an all-to-all costs
    about a quarter of an all-gather of the same array, V / (4·W_ici), W_ici = 2W: the
    bisection's 2 links carry n·S/4 bytes each way → e·S/(8W). Two axes: the narrower cut
    (the longer axis) sets it; a line (no wraparound) halves the cut."""
    t = cluster_preset("tpu-v5p-4096")  # 16 x 16 x 16, W = 9e10 B/s one way per link
    W, S = 9e10, 1e8
    ring = place(t, (16, 1))
    a2a = collective_time("all_to_all", S, ring)
    assert a2a == pytest.approx(BASE + 7e-6 + 16 * S / (8 * W * ETA))
    ag = collective_time("all_gather", 16 * S, ring)  # the same array V = 16·S, gathered
    assert 0.2 < (a2a - BASE - 7e-6) / (ag - BASE - 15e-6) < 0.3
    # the ring bytes the planner used before: (n−1)/n·S over 2W — 4.3x too optimistic
    assert a2a - BASE - 7e-6 > 4 * (15 / 16 * S / (2 * W * ETA))
    line = place(t, (8, 1))  # half an axis: a line, cut of one link
    assert collective_time("all_to_all", S, line) == pytest.approx(
        BASE + 3e-6 + 8 * S / (4 * W * ETA))  # ⌊7/2⌋ hops
    plane = place(t, (16, 1), (8, 16))  # 16 closed x 8 open: the line's cut is narrower
    assert collective_time("all_to_all", S, plane) == pytest.approx(
        BASE + 11e-6 + max(16 / 8, 8 / 4) * S / (W * ETA))
    cube = place(t, (4096, 1))  # time per byte grows as N^(1/3): 16/8 on every axis
    assert collective_time("all_to_all", S, cube) == pytest.approx(
        BASE + 22e-6 + 2 * S / (W * ETA))


def test_deepseek_v3_layer_all_to_all_by_hand():  # claim C43
    """One MoE layer, one microbatch of 4,096 tokens, 8 routed experts of h = 7,168, ep 64
    over 8 servers: a token reaches min(8·(1−(7/8)^8), 4) = 4 servers (node-limited
    routing), 3.5 of them not its own, once each over IB (DeepSeek-V3 §3.2.2). Dispatch at
    1 byte (FP8), combine at 2 (BF16); forward and backward each direction."""
    m, c = PLAN_MODELS["deepseek-v3"], cluster_preset("deepseek-h800-2048")
    r = runtime_preset("deepseek-v3-2024")
    lay = Layout(pp=16, dp=128, ep=64, zero=1, global_batch=15360, order=("tp", "cp", "dp", "pp"))
    x = expert_all_to_all_time(m, c, lay, r)
    assert x["placement"].per_server == 8 and x["placement"].size == 64
    T, k, h, lat = 4096, 8, 7168, BASE + 9.6e-6
    across = 3.5 / 8                                        # of a rank's routed rows
    t_d = lat + across * T * k * h * 1 / (50e9 * ETA)       # IB slower than NVLink (7/8 S)
    t_c = lat + across * T * k * h * 2 / (50e9 * ETA)
    counts = lat + 56 / 64 * 256 * 8 / (50e9 * ETA)
    assert x["seconds"] == pytest.approx(2 * t_d + 2 * t_c + counts)
    assert x["across_bytes"] == pytest.approx(2 * across * T * k * h * (1 + 2))
    # full recomputation repeats the forward's all-to-alls (and counts)
    xr = expert_all_to_all_time(m, c, lay.with_(checkpoint="full"), r)
    assert xr["seconds"] == pytest.approx(3 * t_d + 3 * t_c + 2 * counts)
    # without the once-per-server dispatch (labkit's / Megatron's dispatcher, bf16):
    # 56/64 of every routed row crosses
    plain = expert_all_to_all_time(m, c, lay, runtime_preset("llama3-2024"))
    t2 = lat + 56 / 64 * T * k * h * 2 / (50e9 * ETA)
    assert plain["seconds"] == pytest.approx(4 * t2 + counts)


def test_exposed_all_to_all_follows_the_runtime_overlap():  # claim C43
    """Blocking dispatcher (llama3-2024: ep_overlap 0): the whole all-to-all is on the
    critical path. DualPipe (deepseek-v3-2024): hidden behind the layer's compute where
    chunks pair, exposed in the warm-up and cool-down ((p−1)/m of the chunks)."""
    lay = Layout(pp=16, dp=128, ep=64, zero=1, global_batch=15360,
                 order=("tp", "cp", "dp", "pp"))
    blocking = estimate("deepseek-v3", "deepseek-h800-2048", lay, "llama3-2024")
    ep = blocking.comm["ep"]
    assert ep.exposed == pytest.approx(ep.seconds) and ep.seconds > 0
    dual = estimate("deepseek-v3", "deepseek-h800-2048", lay, "deepseek-v3-2024")
    ep2 = dual.comm["ep"]
    per = ep2.seconds  # per-layer all-to-all is shorter than the layer's compute here
    assert ep2.exposed == pytest.approx(15 / 120 * per)
    # the slowest rank is the last (3 layers and the output head): 120 microbatches
    assert ep2.nic_bytes == pytest.approx(120 * 3 * 2 * 3.5 / 8 * 4096 * 8 * 7168 * 3)
