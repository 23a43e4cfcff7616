"""The lectures' cluster-scale claims, computed by labkit.plan (C19, C27, C29, C34, C36, C38).

C3 is in test_plan_model.py; C35 and the published runs in test_plan_published.py.
"""
import pytest

from labkit.plan import GiB, Layout, estimate, layer_activation_bytes, plan_model, search
from labkit.plan.rules import comm_per_flop, tp_scaling


# ------------------------------------------------------------------ C19: the scaling recipe
def test_c19_plain_dp_fits_1b_not_8b_and_fsdp_takes_over():  # claim C19
    """16 (here 18: fp32 gradients) bytes per parameter: a 1B model trains with plain data
    parallelism, and DP is the best layout on 128 GPUs; an 8B model's replicated state alone
    (144 GB) exceeds an 80 GB GPU — sharding it (ZeRO/FSDP) makes it fit."""
    one = estimate("llama3.2-1b", "h100-server", Layout(dp=8, zero=0, global_batch=64,
                                                        seq_len=4096))
    assert one.fits and one.memory["total"] < 40 * GiB
    eight = estimate("llama3-8b", "h100-server", Layout(dp=8, zero=0, global_batch=64,
                                                        seq_len=4096))
    assert not eight.fits and "optimizer" in eight.reasons[0]
    assert estimate("llama3-8b", "h100-server", Layout(dp=8, zero=3, global_batch=64,
                                                      seq_len=4096)).fits
    best = search("llama3.2-1b", "cs336-cluster", 128, 512, 4096, top=1, cp=[1, 2],
                  pp=[1, 2], microbatch=(1,)).best
    assert (best.layout.tp, best.layout.cp, best.layout.pp, best.layout.dp) == (1, 1, 1, 128)


def test_c19_hsdp_beyond_256_gpus():  # claim C19
    """Flat FSDP gathers and reduces every layer over all N ranks: the ring's latency grows
    with N (NCCL: 9.6 µs per network hop) until it outlasts a layer's compute. On the
    CS336 cluster with one 4K sequence per GPU that happens at 256 GPUs; HSDP (shards inside
    64 GPUs, replicas across) keeps its efficiency."""
    mfu = {}
    for n in (64, 128, 256, 512, 1024):
        lay = Layout(dp=n, zero=3, microbatch=1, global_batch=n, seq_len=4096,
                     checkpoint="full")
        flat = estimate("llama3-8b", "cs336-cluster", lay, detail=False).mfu
        hsdp = estimate("llama3-8b", "cs336-cluster", lay.with_(dp_shard=64), detail=False).mfu
        mfu[n] = flat, hsdp
    for n in (64, 128):
        assert mfu[n][0] >= mfu[n][1] - 0.005  # same cost while N is small
    assert mfu[256][0] < 0.95 * mfu[256][1]
    assert mfu[512][0] < 0.7 * mfu[512][1] and mfu[1024][0] < 0.5 * mfu[1024][1]
    assert min(h for _, h in mfu.values()) > 0.95 * max(h for _, h in mfu.values())


def test_c19_model_parallelism_beyond_about_1000_gpus():  # claims C19, C38
    """With a 4M-token batch (1,024 sequences of 4,096) data parallelism alone can use at
    most 1,024 GPUs; beyond, only layouts with TP/CP/PP remain."""
    dp_only = dict(tp=[1], cp=[1], pp=[1], microbatch=(1,), zero=(1,))
    at_1k = search("llama3-8b", "llama3-24k", 1024, 1024, 4096, top=1, **dp_only)
    assert at_1k.best is not None and at_1k.best.mfu > 0.5
    at_2k = search("llama3-8b", "llama3-24k", 2048, 1024, 4096, top=1, **dp_only)
    assert at_2k.best is None and set(at_2k.reason_counts()) == {"global_batch"}
    mp = search("llama3-8b", "llama3-24k", 2048, 1024, 4096, top=1, tp=[1, 2], cp=[1, 2],
                pp=[1, 2], microbatch=(1,), zero=(1,))
    L = mp.best.layout
    assert L.tp * L.cp * L.pp >= 2 and L.dp <= 1024


def test_c19_sequences_of_16k_outgrow_a_gpu():  # claim C19
    """One sequence's activations of Llama 3 8B, no recomputation, no TP/CP: 45 GiB at 8K,
    90 GiB at 16K — past an 80 GiB GPU before any weights."""
    act = {s: estimate("llama3-8b", "h100-server",
                       Layout(dp=8, zero=3, global_batch=8, seq_len=s)).memory["activations"]
           for s in (8192, 16384)}
    assert act[8192] < 80 * GiB < act[16384]
    assert act[16384] == pytest.approx(2 * act[8192], rel=0.01)


# ------------------------------------------------------------------ C27
def test_c27_tensor_parallelism_collapses_across_servers():  # claim C27
    """GPT-3 175B, 2,048-token sequences, four per microbatch, on H100 servers: per-GPU
    throughput relative to TP 1 is 0.97, 0.91, 0.82 at TP 2, 4, 8, then 0.61 and 0.39 at
    TP 16 and 32 (HF's measurement: 0.90, 0.90, 0.88, 0.58, 0.35). Inside the server the
    all-gathers ride NVLink; across, their latency and the doubled volume per FLOP bite."""
    r = tp_scaling("gpt3-175b", "llama3-24k", 2048, microbatch=4)
    assert r[2] >= 0.9 and r[8] >= 0.75
    assert r[16] <= 0.7 and r[32] <= 0.45
    assert 1 - r[16] / r[8] > 2 * (1 - r[8] / r[4])  # the server boundary is a cliff
    assert all(r[a] > r[b] for a, b in ((1, 2), (2, 4), (4, 8), (8, 16), (16, 32)))


# ------------------------------------------------------------------ C29
def test_c29_131072_tokens_on_cp16_is_8192_per_gpu():  # claim C29
    lay = Layout(tp=8, cp=16, pp=16, dp=8, global_batch=128, seq_len=131072,
                 schedule="interleaved", virtual_stages=4, checkpoint="full")
    p = estimate("llama3-405b", "llama3-24k", lay)
    assert p.terms["seq_per_cp_rank"].value == 8192
    m = plan_model("llama3-405b", 131072)
    assert p.terms["act.layer_no_recompute"].value == pytest.approx(
        layer_activation_bytes(m, 1, 8192, 131072, 8, True)["total"])


# ------------------------------------------------------------------ C34
def test_c34_tp_fills_the_server_then_pp_or_fsdp_then_dp():  # claim C34
    """Llama 3 405B on 16,384 GPUs (TP 1–16 tried): every one of the ten best layouts keeps
    TP inside the server, spreads the model over servers with PP or ZeRO-3, and uses data
    parallelism for the rest. (The planner often pairs TP 4 with CP inside the server: CP
    moves only K and V, and spends no batch.)"""
    res = search("llama3-405b", "llama3-24k", 16384, 2048, 8192, top=10, zero=(1, 3),
                 microbatch=(1,))
    assert len(res.plans) == 10
    for p in res.plans:
        L = p.layout
        assert L.tp <= 8 and p.comm["tp"].level == "nvlink"
        assert L.pp > 1 or L.zero == 3  # the model state needs more than a server
        assert L.dp > 1
        assert p.comm["pp"].level != "nvlink" and p.comm["dp"].level != "nvlink"


@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b"])
def test_c34_bandwidth_need_tp_cp_pp_dp(model):  # claim C34
    """Bytes sent per FLOP computed, each axis alone at degree 2, Llama 3's 16M-token
    batch of 8K sequences: TP > CP > PP > DP."""
    need = {a: comm_per_flop(model, a, 8192, 2048) for a in ("tp", "cp", "pp", "dp")}
    assert need["tp"] > need["cp"] > need["pp"] > need["dp"] > 0


def test_c34_pp_versus_dp_turns_on_tokens_per_step():
    """The last link of the rule needs B·s > 3Ψ/(4h) ≈ 9·L·h tokens per step: Llama 3 405B
    at 16M tokens moves more data-parallel than pipeline bytes per FLOP; at 64M it does not."""
    m = plan_model("llama3-405b")
    assert 3 * m.params / (4 * m.d_model) > 2048 * 8192 > 3 * 70.6e9 / (4 * 8192)
    at16 = {a: comm_per_flop(m, a, 8192, 2048) for a in ("pp", "dp")}
    at64 = {a: comm_per_flop(m, a, 8192, 8192) for a in ("pp", "dp")}
    assert at16["dp"] > at16["pp"] and at64["pp"] > at64["dp"]


# ------------------------------------------------------------------ C36
def test_c36_llama3_layout_places_each_axis_on_its_level():  # claim C36
    lay = Layout(tp=8, cp=1, pp=16, dp=128, zero=1, global_batch=2048, seq_len=8192,
                 schedule="interleaved", virtual_stages=4, checkpoint="full")
    p = estimate("llama3-405b", "llama3-24k", lay)
    assert p.fits
    assert p.comm["tp"].level == "nvlink"  # TP 8 = one server
    assert p.comm["pp"].level == "rack"  # neighbours on the next server
    assert p.comm["dp"].level == "cluster"  # DP outermost, across pods
    long = Layout(tp=8, cp=16, pp=16, dp=8)
    assert [long.coords(r) for r in (1, 8, 128, 2048)] == [
        [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]


def test_c36_cp_only_for_long_context():  # claims C36, C38
    """At 131,072 tokens Llama 3's 16M-token batch is 128 sequences: without CP the
    remaining axes must be pipeline stages with one microbatch each, and the bubble eats the
    step. At 8K there is batch to spare and layouts without CP do fine."""
    space = dict(tp=[8], pp=[1, 2, 4, 8, 16], zero=(1,), microbatch=(1,),
                 checkpoint=("full",))
    long_cp1 = search("llama3-405b", "llama3-24k", 16384, 128, 131072, cp=[1], **space)
    long_cp = search("llama3-405b", "llama3-24k", 16384, 128, 131072, cp=[8, 16], **space)
    assert long_cp1.best.mfu < 0.25 * long_cp.best.mfu
    assert long_cp1.best.bubble > 0.5
    short_cp1 = search("llama3-405b", "llama3-24k", 16384, 2048, 8192, cp=[1], **space)
    short_cp = search("llama3-405b", "llama3-24k", 16384, 2048, 8192, cp=[2, 4, 8], **space)
    assert short_cp1.best.mfu > 0.66 * short_cp.best.mfu


# ------------------------------------------------------------------ C38
def test_c38_batch_is_a_budget_dp_and_microbatches_share():  # claim C38
    B, p = 256, 8
    bubbles = []
    for dp in (1, 2, 4, 8, 16, 32):
        lay = Layout(pp=p, dp=dp, microbatch=1, global_batch=B)
        assert lay.microbatches == B // dp  # what DP takes, microbatches lose
        bubbles.append(estimate("llama3-8b", "llama3-24k", lay, detail=True)
                       .terms["bubble_ratio"].value)
    assert bubbles == sorted(bubbles) and bubbles[-1] == pytest.approx((p - 1) / 8)
    # CP and TP split each sequence instead: they spend no batch
    assert Layout(pp=p, dp=4, cp=4, tp=2, global_batch=B).microbatches == B // 4
    with pytest.raises(ValueError, match="global_batch=256 is not divisible by dp x "
                                         "microbatch = 512 x 1"):
        Layout(dp=512, global_batch=B).check(plan_model("llama3-8b"))
