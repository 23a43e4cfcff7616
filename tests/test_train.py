"""The one training job: every composition equals single-process training (fp32, 3 AdamW
steps, losses and every rank's parameters and first-step gradients within 1e-5), and the
one loss rule (sum over tokens / global tokens; every reduction a sum) holds everywhere."""
from __future__ import annotations

import pytest
from parity import assert_parity

from labkit import jobs
from labkit.config import ModelConfig, RunConfig

pytestmark = pytest.mark.distributed

# adam_eps 1e-6: with PyTorch's 1e-8 a parameter whose gradient is ~1e-9 moves by up to lr
# when the gradient's last bit changes, which one process in fp32 vs fp64 already shows
BASE = RunConfig(steps=3, global_batch=8, return_state=True, return_grads=True,
                 measure_memory=False, count_flops=False, timeout_s=120, adam_eps=1e-6)
#: 4 thin layers: pp=2 with 2 stages per rank (interleaved, ZB-V)
DEEP = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16, name="deep4")
UNTIED = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16, tie_embeddings=False,
                     name="deep4-untied")

TWO = {  # compositions on 2 ranks
    "dp2": dict(dp=2),
    "dp2-accum": dict(dp=2, micro_batch=2),
    "dp2-naive": dict(dp=2, dp_mode="naive"),
    "dp2-small-buckets": dict(dp=2, bucket_mb=0.05),
    "zero1": dict(dp=2, zero_stage=1),
    "zero1-accum": dict(dp=2, zero_stage=1, micro_batch=1),
    "zero2-accum": dict(dp=2, zero_stage=2, micro_batch=2),
    "zero3": dict(dp=2, zero_stage=3),
    "zero3-no-prefetch-no-keep": dict(dp=2, zero_stage=3, prefetch=False, keep_last=False),
    "zero3-full-checkpoint": dict(dp=2, zero_stage=3, checkpoint="full"),
    "hsdp-one-shard": dict(dp=2, zero_stage=3, hsdp_replicas=2),
    "pp2-1f1b": dict(pp=2),
    "pp2-gpipe": dict(pp=2, schedule="gpipe"),
    "pp2-interleaved": dict(pp=2, schedule="interleaved", model=DEEP),
    "pp2-zb-h1": dict(pp=2, schedule="zb-h1"),
    "pp2-zb-v": dict(pp=2, schedule="zb-v", model=DEEP),
    "pp2-two-flushes": dict(pp=2, micro_batch=1, microbatches=4),
    "pp2-selective-checkpoint": dict(pp=2, checkpoint="selective"),
    "torch-ddp": dict(dp=2, impl="torch"),
    "torch-fsdp2": dict(dp=2, zero_stage=3, impl="torch"),
    "torch-1f1b": dict(pp=2, impl="torch", micro_batch=2),
    "torch-interleaved": dict(pp=2, impl="torch", schedule="interleaved", model=DEEP),
    "dp1-zero3": dict(zero_stage=3),
}
FOUR = {  # compositions on 4 ranks
    "dp2xpp2": dict(dp=2, pp=2),
    "dp2xpp2-accum": dict(dp=2, pp=2, micro_batch=1, microbatches=2),
    "zero1xpp2": dict(dp=2, pp=2, zero_stage=1),
    "zero2xpp2": dict(dp=2, pp=2, zero_stage=2),
    "zero3xpp2": dict(dp=2, pp=2, zero_stage=3),
    "zero3xpp2-untied": dict(dp=2, pp=2, zero_stage=3, model=UNTIED),
    "hsdp2x2": dict(dp=4, zero_stage=3, hsdp_replicas=2),
    "hsdp2x2-zero2": dict(dp=4, zero_stage=2, hsdp_replicas=2),
    "dp4": dict(dp=4),
    "dp2xpp2-gpipe": dict(dp=2, pp=2, schedule="gpipe"),
    "dp2xpp2-interleaved": dict(dp=2, pp=2, schedule="interleaved", model=DEEP),
    "dp2xpp2-zb-h1": dict(dp=2, pp=2, schedule="zb-h1"),
    "dp2xpp2-zb-v": dict(dp=2, pp=2, schedule="zb-v", model=DEEP),
}


@pytest.mark.parametrize("name", list(TWO))
def test_parity_two_ranks(cluster2, name):
    cfg = BASE.replace(**TWO[name])
    assert_parity(cluster2.run(jobs.train, cfg), cfg)


@pytest.mark.parametrize("name", list(FOUR))
def test_parity_four_ranks(cluster4, name):
    cfg = BASE.replace(**FOUR[name])
    assert_parity(cluster4.run(jobs.train, cfg), cfg)


def test_single_rank_is_the_reference(cluster2):
    cfg = BASE
    d = assert_parity(cluster2.run(jobs.train, cfg), cfg)
    assert d["loss"] == 0.0 and d["state"] == 0.0  # no communication, same arithmetic


def test_bf16_runs_and_stays_near_fp32(cluster2):
    """bf16 compute (autocast over fp32 weights at ZeRO 0; bf16 flat units with fp32 masters
    at ZeRO 1-3) is not bit-parity: its losses stay within 1e-2 of fp32's over 3 steps
    (seen: 3e-4 autocast, 1.2e-3 ZeRO-2), and its gradient bytes halve under ZeRO."""
    for kw in (dict(dp=2), dict(dp=2, zero_stage=2), dict(pp=2)):
        cfg = BASE.replace(precision="bf16", **kw)
        r = cluster2.run(jobs.train, cfg)
        fp32 = cluster2.run(jobs.train, cfg.replace(precision="fp32"))
        assert max(abs(a - b) for a, b in zip(r.losses, fp32.losses)) < 1e-2
        assert r.losses != fp32.losses  # it really ran in bf16
    z = cluster2.run(jobs.train, BASE.replace(dp=2, zero_stage=2, precision="bf16"))
    z32 = cluster2.run(jobs.train, BASE.replace(dp=2, zero_stage=2))
    for a, b in zip(z.metrics, z32.metrics):
        assert a["comm_bytes_by_axis"]["dp"]["reduce_scatter"] * 2 == \
            b["comm_bytes_by_axis"]["dp"]["reduce_scatter"]


CP = {  # context parallelism through the one job (2 ranks), every method and split
    f"cp2-{m}-{'zigzag' if z else 'contiguous'}": dict(cp=2, cp_method=m, cp_zigzag=z)
    for m in ("ring", "ulysses", "allgather") for z in (True, False)}
CP4 = {"cp2xdp2": dict(cp=2, dp=2), "cp2xpp2": dict(cp=2, pp=2),
       "cp2xzero3": dict(cp=2, dp=2, zero_stage=3), "cp4-ring": dict(cp=4),
       "cp2-accum-checkpoint": dict(cp=2, micro_batch=2, checkpoint="full")}


@pytest.mark.parametrize("name", list(CP))
def test_context_parallel_parity_two_ranks(cluster2, name):
    """C28: each rank holds (batch, sequence/cp, channels); the loss and every gradient are
    those of one process, and the cp bytes equal each method's formula exactly."""
    cfg = BASE.replace(**CP[name])
    r = cluster2.run(jobs.train, cfg)
    assert_parity(r, cfg)
    for m in r.metrics:
        got = {k: v for k, v in m["comm_bytes_by_axis"]["cp"].items() if v}
        assert got == m["comm_predicted_by_axis"]["cp"]


@pytest.mark.parametrize("name", list(CP4))
def test_context_parallel_composes_four_ranks(cluster4, name):
    cfg = BASE.replace(**CP4[name])
    r = cluster4.run(jobs.train, cfg)
    assert_parity(r, cfg)
    for m in r.metrics:
        got = {k: v for k, v in m["comm_bytes_by_axis"]["cp"].items() if v}
        assert got == m["comm_predicted_by_axis"]["cp"]


TP = {  # tensor (and sequence) parallelism through the one job
    "tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True),
    "tp2-gqa-replicated-kv": dict(tp=2, model=ModelConfig(n_heads=4, n_kv_heads=1)),
    "tp2-untied-sp-accum": dict(tp=2, sequence_parallel=True, micro_batch=4, model=UNTIED),
    "tp2-checkpoint": dict(tp=2, checkpoint="full"),
    # a segment of 2 blocks repeats its first block's MLP output collective too (once
    # predicted as if each block were its own segment: one reduce-scatter short with SP)
    "tp2-checkpoint-every2": dict(tp=2, checkpoint="every", checkpoint_every=2),
    "tp2-sp-checkpoint-every2": dict(tp=2, sequence_parallel=True, checkpoint="every",
                                     checkpoint_every=2),
}
TP4 = {"tp2xdp2": dict(tp=2, dp=2), "tp2xzero3": dict(tp=2, dp=2, zero_stage=3),
       "tp2xpp2": dict(tp=2, pp=2), "tp2-sp-xpp2": dict(tp=2, pp=2, sequence_parallel=True),
       "tp2xcp2": dict(tp=2, cp=2), "tp2-sp-xcp2-ulysses": dict(
           tp=2, cp=2, sequence_parallel=True, cp_method="ulysses",
           model=ModelConfig(n_heads=4, n_kv_heads=4)),
       "tp4": dict(tp=4), "tp4-sp": dict(tp=4, sequence_parallel=True)}


def _tp_bytes_exact(r):
    for m in r.metrics:
        for axis in ("tp", "cp"):
            if axis in m["comm_predicted_by_axis"]:
                got = {k: v for k, v in m["comm_bytes_by_axis"][axis].items() if v}
                assert got == m["comm_predicted_by_axis"][axis], (axis, m["rank"])


@pytest.mark.parametrize("name", list(TP))
def test_tensor_parallel_parity_two_ranks(cluster2, name):
    """C24-C26 through the job: parity, and the tp bytes of a step equal the formula
    (blocks, embedding, head, vocab-parallel loss, recomputation) exactly, every rank."""
    cfg = BASE.replace(**TP[name])
    r = cluster2.run(jobs.train, cfg)
    assert_parity(r, cfg)
    _tp_bytes_exact(r)


@pytest.mark.parametrize("name", list(TP4))
def test_tensor_parallel_composes_four_ranks(cluster4, name):
    cfg = BASE.replace(**TP4[name])
    r = cluster4.run(jobs.train, cfg)
    assert_parity(r, cfg)
    _tp_bytes_exact(r)


MOE = "tiny-moe"
TOP1_DROP = ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64, n_experts=4, top_k=1,
                        capacity_factor=1.0, name="moe-top1-cf1")
EP = {"moe-dp2": dict(model=MOE, dp=2), "ep2": dict(model=MOE, dp=2, ep=2),
      "ep2-accum-checkpoint": dict(model=MOE, dp=2, ep=2, micro_batch=2, checkpoint="full"),
      "ep2-top1-capacity": dict(model=TOP1_DROP, dp=2, ep=2),
      "ep2xcp": dict(model=MOE, cp=2, ep=2), "moe-tp2": dict(model=MOE, tp=2),
      "moe-pp2": dict(model=MOE, pp=2)}
EP4 = {"ep2xdp4": dict(model=MOE, dp=4, ep=2), "ep4": dict(model=MOE, dp=4, ep=4),
       "ep2-zero1": dict(model=MOE, dp=4, ep=2, zero_stage=1),
       "ep2-zero3": dict(model=MOE, dp=4, ep=2, zero_stage=3),
       "ep2xpp2": dict(model=MOE, dp=2, ep=2, pp=2), "ep2xtp2": dict(model=MOE, dp=2, ep=2, tp=2)}


def _all_bytes_exact(r):
    for m in r.metrics:
        for axis, want in m["comm_predicted_by_axis"].items():
            got = {k: v for k, v in m["comm_bytes_by_axis"].get(axis, {}).items() if v}
            assert got == want, (axis, m["rank"], got, want)


@pytest.mark.parametrize("name", list(EP))
def test_expert_parallel_parity_two_ranks(cluster2, name):
    """C37 through the job: tokens go to their experts by all-to-all; the loss (with the
    load-balancing term per token group) and every gradient equal one process; every axis's
    bytes, the all-to-all's from all ranks' routed counts, equal the formula exactly."""
    cfg = BASE.replace(**EP[name])
    r = cluster2.run(jobs.train, cfg)
    assert_parity(r, cfg)
    _all_bytes_exact(r)
    assert len(r.outputs[0]["routing"]) == cfg.steps


@pytest.mark.parametrize("name", list(EP4))
def test_expert_parallel_composes_four_ranks(cluster4, name):
    cfg = BASE.replace(**EP4[name])
    r = cluster4.run(jobs.train, cfg)
    assert_parity(r, cfg)
    _all_bytes_exact(r)
