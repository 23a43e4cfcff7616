"""labkit.plan models, hardware, layouts and activation memory (pure arithmetic, no torch)."""
import dataclasses
import math

import pytest

from labkit.config import PRESETS, ModelConfig
from labkit.plan import (CLUSTERS, GiB, Layout, PLAN_MODELS, cluster_preset, in_flight,
                         layer_activation_bytes, narayanan_flops, plan_model, runtime_preset,
                         stage_layers)
from labkit.plan.published import NARAYANAN_TABLE1


# ------------------------------------------------------------------ models
def test_parameter_counts_match_the_papers():
    assert PLAN_MODELS["llama3-8b"].params == pytest.approx(8.03e9, rel=1e-3)
    assert PLAN_MODELS["llama3-70b"].params == pytest.approx(70.55e9, rel=1e-3)
    assert PLAN_MODELS["llama3-405b"].params == pytest.approx(405.85e9, rel=1e-3)
    assert PLAN_MODELS["gpt3-175b"].params == pytest.approx(174.6e9, rel=1e-3)
    assert PLAN_MODELS["llama3.2-1b"].params == pytest.approx(1.236e9, rel=1e-3)


@pytest.mark.parametrize("row", NARAYANAN_TABLE1, ids=lambda r: r.model)
def test_megatron_presets_follow_narayanan_eq_2(row):
    """P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) (Narayanan et al. 2021 §5.1): exact for
    the presets but for the final LayerNorm's 2h; the table rounds to 0.1 billion."""
    m = PLAN_MODELS[row.model]
    assert (m.n_layers, m.d_model, m.n_heads) == (row.layers, row.hidden, row.heads)
    L, h, V, s = m.n_layers, m.d_model, m.vocab_size, m.seq_len
    eq2 = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    assert m.params - 2 * h == pytest.approx(eq2, rel=1e-12)
    assert abs(m.params / 1e9 - row.params_b) <= 0.051  # the table rounds to 0.1B


def test_narayanan_eq3_is_model_flops_plus_the_recomputed_forward():
    """Eq. 3 = 4/3 × the layers' model FLOPs + the logit layer's 6·B·s·h·V."""
    m = PLAN_MODELS["megatron-1t"]
    B, s, L, h, V = 3072, m.seq_len, m.n_layers, m.d_model, m.vocab_size
    layers = B * s * (m.flops_per_token() - 6 * h * V)
    assert narayanan_flops(m, B) == pytest.approx(4 / 3 * layers + 6 * B * s * h * V, rel=1e-12)


def test_plan_model_accepts_names_configs_and_overrides():
    assert plan_model("llama3-8b", seq_len=4096).seq_len == 4096
    assert plan_model(PRESETS["tiny"]).d_model == 64
    cfg = ModelConfig(n_layers=3, d_model=96, n_heads=6, n_kv_heads=2, seq_len=32)
    assert plan_model(cfg).kv_dim == 32
    with pytest.raises(ValueError, match="known"):
        plan_model("gpt-5")
    with pytest.raises(ValueError, match="vit"):
        plan_model(PRESETS["vit-digits"])
    with pytest.raises(ValueError, match="seq_len"):
        plan_model("tiny", seq_len=0)


# ------------------------------------------------------------------ hardware
def test_llama3_cluster_has_1_875_pib_of_gpu_memory():  # claim C3
    c = CLUSTERS["llama3-24k"]
    assert (c.n_gpus, c.gpus_per_node, c.gpu.memory_bytes) == (24576, 8, 80 * GiB)
    assert c.total_memory_bytes == 1.875 * 2 ** 50  # binary petabytes, exactly
    assert c.total_memory_bytes / 1e15 == pytest.approx(2.111, abs=1e-3)  # not decimal PB
    assert [lv.size for lv in c.levels] == [8, 16, 3072, 24576]
    assert c.levels[-1].oversubscription == 7


def test_bandwidth_hierarchy_falls_outwards():  # claim C2
    h = CLUSTERS["llama3-24k"].hierarchy()
    assert [name for name, _, _ in h] == ["hbm", "nvlink", "rack", "pod", "cluster"]
    assert h[0][2] == 3352e9 and 2 * h[1][2] == 900e9 and h[2][2] == 50e9
    assert h[-1][2] == pytest.approx(50e9 / 7)
    assert all(a[2] >= b[2] for a, b in zip(h, h[1:]))


def test_every_preset_names_its_source():
    for c in CLUSTERS.values():
        assert c.source and c.gpu.source and 0 < c.gpu.matmul_efficiency < 1
    for m in PLAN_MODELS.values():
        assert m.source
    assert runtime_preset("megatron-2021").grad_bytes == 2
    with pytest.raises(ValueError, match="known"):
        cluster_preset("frontier")
    with pytest.raises(ValueError, match="known"):
        runtime_preset("deepspeed")


# ------------------------------------------------------------------ activations (C18)
GPT = PLAN_MODELS["gpt3-175b"]


def _sbh(b=1):
    return GPT.seq_len * b * GPT.d_model


@pytest.mark.parametrize("b", [1, 2])
def test_korthikanti_per_layer_activations_without_parallelism(b):  # claim C18
    s, h, a = GPT.seq_len, GPT.d_model, GPT.n_heads
    got = layer_activation_bytes(GPT, b, s, s)["total"]
    assert got == pytest.approx(_sbh(b) * (34 + 5 * a * s / h), rel=1e-12)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_korthikanti_tensor_and_sequence_parallel(t):  # claim C18, Korthikanti Table 2
    s, h, a = GPT.seq_len, GPT.d_model, GPT.n_heads
    tp = layer_activation_bytes(GPT, 1, s, s, tp=t)
    assert tp["total"] == pytest.approx(_sbh() * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    sp = layer_activation_bytes(GPT, 1, s, s, tp=t, sp=True)
    assert sp["total"] == pytest.approx(_sbh() / t * (34 + 5 * a * s / h), rel=1e-12)
    # selective recomputation drops the scores: 34·s·b·h/t
    assert sp["total"] - sp["scores"] == pytest.approx(34 * _sbh() / t, rel=1e-12)
    assert sp["input"] == pytest.approx(2 * _sbh() / t)  # full recomputation keeps 2sbh/t


def test_flash_attention_stores_no_scores_matrix():
    m = PLAN_MODELS["llama3-8b"]
    a = layer_activation_bytes(m, 1, 8192, 8192)
    assert a["scores"] == 4 * m.n_heads * 8192  # fp32 log-sum-exp only


def test_in_flight_microbatches_per_schedule():
    assert in_flight("gpipe", 4, 8) == 8
    assert [in_flight("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2, 0) == 2  # fewer microbatches than stages
    assert in_flight("1f1b", 1, 8) == 1  # no pipeline: one at a time
    # interleaved: rank 0 holds L·(1 + (p−1)/(pV)) layers' worth (Korthikanti §4.2.3)
    p, v, L = 4, 2, 32
    assert in_flight("interleaved", p, 8, 0, v) * L / p == pytest.approx(L * (1 + (p - 1) / (p * v)))


# ------------------------------------------------------------------ layouts
def test_stage_layers_takes_the_remainder_from_the_ends():
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B
    assert stage_layers(128, 64) == [2] * 64
    assert stage_layers(10, 4) == [2, 3, 3, 2]
    assert stage_layers(7, 4) == [1, 2, 2, 2] and sum(stage_layers(7, 4)) == 7


def test_rank_coordinates_are_tp_cp_pp_dp_with_tp_fastest():  # claim C36
    lay = Layout(tp=8, cp=2, pp=4, dp=2)
    assert lay.coords(0) == [0, 0, 0, 0]
    assert lay.coords(7) == [7, 0, 0, 0]
    assert lay.coords(8) == [0, 1, 0, 0]
    assert lay.coords(16) == [0, 0, 1, 0]
    assert lay.coords(64) == [0, 0, 0, 1]
    assert lay.coords(127) == [7, 1, 3, 1]
    assert len({tuple(lay.coords(r)) for r in range(lay.n_gpus)}) == lay.n_gpus
    assert [lay.stride(a) for a in ("tp", "cp", "pp", "dp")] == [1, 8, 16, 64]
    with pytest.raises(ValueError, match="rank"):
        lay.coords(128)


@pytest.mark.parametrize("kwargs,words", [
    (dict(tp=3), "tp=3 does not divide n_heads=32"),
    (dict(cp=3, seq_len=8192), "cp=3 does not divide seq_len=8192"),
    (dict(dp=4, microbatch=2, global_batch=12), "global_batch=12 is not divisible by dp x "
                                                "microbatch = 4 x 2 = 8"),
    (dict(pp=4, virtual_stages=2), "virtual_stages=2 needs schedule='interleaved'"),
    (dict(pp=20, virtual_stages=2, schedule="interleaved", global_batch=40),
     "exceeds n_layers=32"),
    (dict(pp=4, schedule="interleaved", virtual_stages=2, global_batch=6),
     "microbatches=6 divisible by pp=4"),
    (dict(zero=4), "zero must be"), (dict(schedule="zb"), "schedule must be"),
    (dict(checkpoint="some"), "checkpoint must be"), (dict(tp=0), "tp must be"),
    (dict(dp=4, dp_shard=2, zero=1, global_batch=8), "needs zero=3"),
    (dict(dp=4, dp_shard=3, zero=3, global_batch=8), "dp_shard=3 must divide"),
])
def test_layout_check_names_the_field(kwargs, words):
    with pytest.raises(ValueError) as info:
        Layout(**kwargs).check(PLAN_MODELS["llama3-8b"])
    assert words in str(info.value)


def test_layout_from_the_lab_mesh_keeps_its_rank_order():
    from labkit.mesh import Mesh
    from labkit.plan.layout import layout_from_mesh

    mesh = Mesh(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2)
    lay = layout_from_mesh(mesh, zero=3, global_batch=8)
    assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.dp_shard) == (2, 1, 2, 4, 2)
    for r in range(mesh.size):
        c = mesh.coords(r)
        dp = c["dp_replicate"] * mesh.dp_shard + c["dp_shard"]
        assert lay.coords(r) == [c["tp"], c["cp"], c["pp"], dp]
    assert layout_from_mesh(mesh, zero=1).dp_shard is None
    estimate_ok = lay.check(PLAN_MODELS["tiny"])
    assert estimate_ok is lay


def test_key_value_heads_split_or_replicate():
    m = plan_model(ModelConfig(n_layers=2, d_model=96, n_heads=12, n_kv_heads=6, d_ff=384,
                               seq_len=32))
    Layout(tp=2).check(m)
    Layout(tp=12).check(m)  # each K/V head replicated on two ranks
    with pytest.raises(ValueError, match="tp=4 and n_kv_heads=6"):
        Layout(tp=4).check(m)


def test_sequence_parallelism_needs_tensor_parallelism():
    assert not Layout(tp=1).sp and Layout(tp=2).sp and not Layout(tp=2,
                                                                 sequence_parallel=False).sp
    assert math.isclose(Layout(dp=4, global_batch=32, microbatch=2).microbatches, 4)


def test_deepseek_v3_counts_its_published_671b():
    """DeepSeek-V3's report (§4.2): 671B parameters (its multi-token-prediction module's 14B
    not included). The preset folds two things into its shape, and says so: the shared
    expert (a ninth expert every token visits: 3·h·2,048 per MoE layer, not stored) and
    multi-head latent attention counted as multi-head attention. Put back, the count is the
    report's; without the first three layers being dense (FFN 18,432, the released config) it
    was 702B."""
    m = PLAN_MODELS["deepseek-v3"]
    h, moe_layers = 7168, 61 - 3
    shared = moe_layers * 3 * h * 2048
    # MLA's projections (released config: q rank 1,536, kv rank 512, heads of 128 + 64 rope)
    mla = h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * 256 + 128 * 128 * h
    assert abs(m.params + shared - 61 * (m.attention_params - mla) - 671e9) < 0.5e9
    assert abs(dataclasses.replace(m, dense_layers=0).params - 702.2e9) < 0.1e9
    with pytest.raises(ValueError, match="dense_layers=3 needs experts"):
        dataclasses.replace(PLAN_MODELS["gpt3-175b"], dense_layers=3, dense_d_ff=10)
    with pytest.raises(ValueError, match=r"dense_layers must be an int in 0..n_layers=61"):
        dataclasses.replace(m, dense_layers=62)
