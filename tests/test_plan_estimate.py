"""labkit.plan.estimate / network / search: one layout's numbers, and the search over many."""
import math

import pytest

from labkit.plan import (CLUSTERS, GiB, Layout, PLAN_MODELS, comm_bytes, estimate,
                         model_state_bytes, rank_memory, search)
from labkit.plan.network import collective_time, place
from labkit.plan.runtime import LINK_EFFICIENCY
from labkit.plan.search import reason_kind

LLAMA = CLUSTERS["llama3-24k"]
L405 = Layout(tp=8, pp=16, dp=128, zero=1, global_batch=2048, schedule="interleaved",
              virtual_stages=4, checkpoint="full")


# ------------------------------------------------------------------ network
def test_groups_land_on_the_level_they_span():
    tp = place(LLAMA, (8, 1))
    assert (tp.level, tp.bandwidth, tp.per_server) == ("nvlink", 450e9, 8)
    # Llama 3's DP: one rank per server, 16 per pod: the 1:7 aggregation layer is not the
    # bottleneck (a ring leaves each pod once)
    dp = place(LLAMA, (128, 128))
    assert (dp.level, dp.bandwidth, dp.slowdown) == ("cluster", 50e9, 1.0)
    # one rank in each of 8 pods: all traffic crosses the 1:7 layer
    thin = place(LLAMA, (8, 3072))
    assert thin.level == "cluster" and thin.slowdown == 7 and thin.bandwidth == 50e9 / 7
    # TP 16 over two servers: 8 rings through 8 adapters, min(NVLink, 8 × 50 GB/s)
    tp16 = place(LLAMA, (16, 1))
    assert (tp16.level, tp16.per_server, tp16.bandwidth) == ("rack", 8, 400e9)
    assert place(LLAMA, (1, 4)).level == "hbm"
    with pytest.raises(ValueError, match="spans"):
        place(CLUSTERS["h100-server"], (2, 8))


def test_collective_time_is_ring_bytes_over_bandwidth_plus_latency():
    pl = place(LLAMA, (8, 1))
    S = 1e9
    t = collective_time("all_gather", S, pl)
    bw_part = comm_bytes("all_gather", S, 8) / (450e9 * LINK_EFFICIENCY)
    assert bw_part < t < bw_part + 1e-4
    assert 2 * bw_part < collective_time("all_reduce", S, pl) < 2 * bw_part + 1e-4
    assert collective_time("all_reduce", S, place(LLAMA, (1, 1))) == 0.0
    # latency grows with the ring: a tiny all-gather over 1024 ranks costs ~1023 hops
    big = collective_time("all_gather", 1e3, place(LLAMA, (1024, 1)))
    assert big > 1023 * 9e-6


# ------------------------------------------------------------------ one layout
def test_plan_terms_name_formula_and_source():
    p = estimate("llama3-405b", "llama3-24k", L405)
    for name in ("memory.parameters", "memory.activations", "t.layer_forward", "t.pipeline",
                 "bubble_ratio", "comm.tp.seconds", "comm.dp.exposed", "mfu", "hfu"):
        assert p.terms[name].formula, name
    for name in ("memory.activations", "bubble_ratio", "mfu", "t.layer_backward"):
        assert p.terms[name].source, name
    assert p.summary()["layout"]["order"] == ["tp", "cp", "pp", "dp"]


def test_step_time_and_mfu_follow_their_formulas():  # claims C21, C31
    p = estimate("llama3-405b", "llama3-24k", L405)
    m, lay = p.model, p.layout
    mb, v, pp = lay.microbatches, lay.virtual_stages, lay.pp
    assert p.terms["bubble_ratio"].value == pytest.approx((pp - 1) / (v * mb))
    t_mb = p.terms["t.stage_microbatch"].value
    assert p.terms["t.pipeline"].value == pytest.approx((mb + (pp - 1) / v) * t_mb)
    assert p.bubble == pytest.approx(((pp - 1) / v) / (mb + (pp - 1) / v))
    flops = lay.global_batch * m.seq_len * m.flops_per_token()
    assert p.mfu == pytest.approx(flops / (p.step_time * lay.n_gpus * 989.4e12), rel=1e-12)
    assert p.hfu > p.mfu  # full recomputation adds a forward
    assert p.terms["t.layer_backward"].value == pytest.approx(
        2 * p.terms["t.layer_forward"].value, rel=0.1)


def test_memory_categories_follow_zero_and_the_16_bytes_rule():  # claims C10–C12
    m = PLAN_MODELS["llama3-8b"]
    lay = Layout(dp=8, zero=0, global_batch=8, seq_len=2048)
    p = estimate(m, "h100-server", lay, runtime="megatron-2021")
    P = p.terms["params_per_gpu"].value
    state = sum(p.memory[k] for k in ("parameters", "gradients", "optimizer"))
    assert state == pytest.approx(model_state_bytes(P)["total"]) == pytest.approx(16 * P)
    assert P == pytest.approx(m.params, rel=1e-9)  # one rank holds everything
    totals = [estimate(m, "h100-server", lay.with_(zero=z), runtime="megatron-2021"
                       ).memory for z in range(4)]
    for z, mem in enumerate(totals):
        ref = rank_memory(P, z, 8, 2)
        assert {k: mem[k] for k in ("parameters", "gradients", "optimizer")} == pytest.approx(
            {k: ref[k] for k in ("parameters", "gradients", "optimizer")})
    assert [t["total"] for t in totals] == sorted((t["total"] for t in totals), reverse=True)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_rank_memory_agrees_with_the_zero_formulas(zero):  # ZeRO §5.1
    P, N = 3.3e9, 64
    ref = model_state_bytes(P, N, zero)
    got = rank_memory(P, zero, N, grad_bytes=2, activations=5.0, comm_buffers=7.0)
    assert {k: got[k] for k in ("parameters", "gradients", "optimizer")} == pytest.approx(
        {k: ref[k] for k in ("parameters", "gradients", "optimizer")}, rel=1e-12)
    assert got["total"] == pytest.approx(ref["total"] + 12.0)


def test_recomputation_trades_memory_for_time():
    m = "llama3-70b"
    base = Layout(tp=8, pp=4, dp=4, zero=1, global_batch=64, seq_len=8192)
    plans = {c: estimate(m, "llama3-24k", base.with_(checkpoint=c))
             for c in ("none", "selective", "full")}
    act = {c: p.memory["activations"] for c, p in plans.items()}
    assert act["none"] > act["selective"] > act["full"]
    assert plans["none"].step_time < plans["selective"].step_time < plans["full"].step_time
    assert plans["full"].hfu > plans["full"].mfu and plans["none"].hfu == plans["none"].mfu


def test_tensor_parallel_traffic_is_timed_on_nvlink_then_on_the_network():
    lay = Layout(tp=8, dp=2, global_batch=16, seq_len=4096)
    inside = estimate("llama3-70b", "llama3-24k", lay).comm["tp"]
    across = estimate("llama3-70b", "llama3-24k", lay.with_(tp=16, dp=1)).comm["tp"]
    assert inside.level == "nvlink" and across.level == "rack"
    assert across.nic_bytes > 0 == inside.nic_bytes


def test_estimate_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="16384 GPUs; h100-server has 8"):
        estimate("llama3-405b", "h100-server", L405)
    with pytest.raises(ValueError, match="does not divide n_heads"):
        estimate("llama3-8b", "h100-server", Layout(tp=3))
    p = estimate("llama3-405b", "h100-server", Layout(tp=8, global_batch=1))
    assert not p.fits and "memory" in p.reasons[0] and "GiB" in p.reasons[0]
    roomy = estimate("llama3-405b", "h100-server", Layout(tp=8, global_batch=1),
                     memory_limit=float("inf"))
    assert roomy.fits and math.isfinite(roomy.step_time)


# ------------------------------------------------------------------ search
def test_search_ranks_fitting_layouts_and_explains_the_rest():
    res = search("llama3-8b", "h100-server", 8, 64, 8192, top=5)
    assert res.plans and all(p.fits for p in res.plans)
    times = [p.step_time for p in res.plans]
    assert times == sorted(times)
    assert res.best.mfu == max(p.mfu for p in res.plans)
    kinds = res.reason_counts()
    assert "memory" in kinds and all(r.reason for r in res.rejected)
    assert res.considered == res.fitting + len(res.rejected) + res.dominated
    mem = next(r for r in res.rejected if r.reason.startswith("memory"))
    assert not estimate("llama3-8b", "h100-server", mem.layout).fits


def test_search_rejects_bad_requests():
    with pytest.raises(ValueError, match="n_gpus must be in 1..8"):
        search("llama3-8b", "h100-server", 16, 64)
    with pytest.raises(ValueError, match="global_batch"):
        search("llama3-8b", "h100-server", 8, 0)
    with pytest.raises(ValueError, match="checkpoint"):
        search("llama3-8b", "h100-server", 8, 64, checkpoint=("sometimes",))
    with pytest.raises(ValueError, match=r"zero stages must be among 0, 1, 2, 3, got \[5\]"):
        search("llama3-8b", "h100-server", 8, 64, zero=(5,))
    with pytest.raises(ValueError, match=r"microbatch choices must be positive ints, got \[0\]"):
        search("llama3-8b", "h100-server", 8, 64, microbatch=(0,))
    with pytest.raises(ValueError, match="tp choices"):
        search("llama3-8b", "h100-server", 8, 64, tp=[-2])


def test_reason_kinds():
    assert reason_kind("memory 90.1 GiB > limit") == "memory"
    assert reason_kind("global_batch=12 is not divisible") == "global_batch"
    assert reason_kind("tp=3 does not divide n_heads=32") == "tp"
    assert reason_kind("the interleaved schedule needs") == "interleaved"


def test_memory_limit_moves_the_search():
    loose = search("llama3-8b", "h100-server", 8, 64, 8192, top=1, zero=(1,))
    tight = search("llama3-8b", "h100-server", 8, 64, 8192, top=1, zero=(1,),
                   memory_limit=40 * GiB)
    assert tight.fitting < loose.fitting
    assert tight.best.memory["total"] <= 40 * GiB


def test_comm_bytes_per_axis_are_exact():
    """Bytes each GPU sends per step, from the formulas in labkit.plan.steptime's docstring."""
    m = PLAN_MODELS["llama3-70b"]
    lay = Layout(tp=8, cp=2, pp=4, dp=4, zero=1, microbatch=1, global_batch=32, seq_len=8192,
                 checkpoint="selective")
    p = estimate(m, "llama3-24k", lay)
    s, t, cp, mb, layers = 8192, 8, 2, lay.microbatches, 20
    T = s // cp
    act = 2 * T * m.d_model
    tp = mb * layers * 2 * 2 * 2 * (t - 1) / t * act  # 2 passes x 2 x (all-gather + r-s)
    kv = 2 * 2 * s * m.kv_dim / t  # K and V of the whole sequence, 16-bit
    cpb = mb * layers * (2 + 1 + 1) * (cp - 1) / cp * kv  # AG fwd, AG bwd, AG recompute, RS
    ppb = mb * 2 * act / t
    h = m.d_model  # the slowest rank is the last: its layers, the head and the final norm
    P = layers * ((m.layer_params - 2 * h) / t + 2 * h) + m.vocab_size * h / t + h
    n = lay.dp * cp
    dpb = (n - 1) / n * (4 * P + 2 * P)  # fp32 gradients reduce-scattered, bf16 weights gathered
    got = {a: p.comm[a].bytes for a in ("tp", "cp", "pp", "dp")}
    assert got == pytest.approx({"tp": tp, "cp": cpb, "pp": ppb, "dp": dpb}, rel=1e-12)


def test_the_network_adapter_bounds_the_step():
    """Overlapped or not, every byte leaving the server crosses this GPU's adapter: with TP
    16 across two servers next to FSDP traffic the adapter, not the compute, sets the step."""
    lay = Layout(tp=16, cp=2, pp=8, dp=64, zero=3, microbatch=4, global_batch=2048,
                 seq_len=8192, schedule="interleaved", virtual_stages=4)
    p = estimate("llama3-405b", "llama3-24k", lay)
    nic = sum(a.nic_bytes for a in p.comm.values()) / (50e9 * LINK_EFFICIENCY)
    compute_bound = p.terms["t.pipeline"].value + p.comm["dp"].exposed
    assert nic > compute_bound
    assert p.step_time - p.terms["t.optimizer"].value == pytest.approx(nic, rel=1e-12)
    assert p.comm["tp"].nic_bytes == pytest.approx(p.comm["tp"].bytes / 8)  # 8 rails a server
