"""Claim C18 on labkit's own layers: what each transformer layer of the training job keeps for
backward, measured by part, equals Korthikanti et al. 2022's count for the same shapes
(labkit.parallel.tensor.activations.megatron_block_terms) plus the terms labkit keeps beyond
it, each named (labkit_adjustments) — to the byte, for tp 1/2/4, sequence parallelism on and
off, context parallelism 1/2, bf16 with bf16 weights (ZeRO) and under autocast.

* Under fake tensors and a fake process group (labkit.measure.layer_activations): the job's
  own build of one rank (cheap, one process), and one layer of Llama 3 405B on its TP8+SP rank.
* In the real job on two CPU ranks (tiny model, TP2+SP, bf16): the same bytes, and the
  same as the fake measurement of each rank.
* The count is the lecture's: for this model it is the planner's Megatron-LM accounting
  (labkit.plan.activations, which reduces to S·B·H·(34 + 5·A·S/H) for GPT-3's shapes), and
  with TP, SP and the attention core recomputed every term divides by T.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from labkit.config import ModelConfig, ParallelConfig, RunConfig, preset
from labkit.measure.layer_activations import (fake_layer_activations, job_layer_activations,
                                              predicted_layer_activations)
from labkit.parallel.tensor.activations import (PARTS, labkit_adjustments, megatron_block_terms)

GQA = ModelConfig(n_layers=2, d_model=64, n_heads=8, n_kv_heads=4, vocab_size=256, seq_len=32,
                  tie_embeddings=False, name="gqa")
#: (tp, sp, cp, zero): ZeRO 1 over 2 data ranks keeps bf16 weights; ZeRO 0 autocasts
CASES = [(1, False, 1, 0), (1, False, 2, 1), (2, False, 1, 1), (2, True, 1, 0),
         (2, True, 2, 1), (2, False, 2, 0), (4, True, 1, 1), (4, False, 1, 0), (4, True, 2, 0)]
ADJUSTMENTS = {"1/rms per norm (fp32)", "fp32 residual stream (autocast): norm inputs"}


def _cfg(tp, sp, cp, zero, model=GQA, **kw) -> RunConfig:
    return RunConfig(model=model, parallel=ParallelConfig(dp=2, tp=tp, cp=cp), global_batch=4,
                     micro_batch=2, steps=1, precision="bf16", zero_stage=zero,
                     sequence_parallel=sp, count_flops=False, **kw)


def _check(got: dict, want: dict) -> None:
    """Every layer's parts equal the count; the rotary rows indexed once per forward are the
    first layer's, as predicted."""
    assert sorted(got["layers"]) == list(range(len(got["layers"])))
    for i, parts in got["layers"].items():
        parts = dict(parts)
        rope = parts.pop("rotary tables", 0)
        assert parts == want["total"], (i, parts, want["total"])
        assert rope == (want["per_forward"]["rotary tables"] if i == 0 else 0), i


@pytest.mark.parametrize("tp,sp,cp,zero", CASES,
                         ids=[f"tp{t}{'-sp' if s else ''}-cp{c}-zero{z}" for t, s, c, z in CASES])
def test_each_layer_keeps_c18_plus_named_terms(tp, sp, cp, zero):
    cfg = _cfg(tp, sp, cp, zero)
    want = predicted_layer_activations(cfg)
    _check(fake_layer_activations(cfg, cfg.parallel.world_size - 1), want)
    # the total is C18's count plus the named terms, nothing else
    assert set(want["adjustments"]) == (ADJUSTMENTS if zero == 0 else
                                        {"1/rms per norm (fp32)"})
    for part in PARTS:
        assert want["total"][part] == want["megatron"][part] + sum(
            t.get(part, 0) for t in want["adjustments"].values())


def test_kv_heads_fewer_than_tp_are_not_repeated():
    """K < T: each rank keeps the one K/V head its query heads read, at its own width."""
    cfg = _cfg(4, True, 1, 1, model=replace(GQA, n_kv_heads=2))
    _check(fake_layer_activations(cfg, 5), predicted_layer_activations(cfg))


def test_llama3_405b_layer_on_its_tp8_sp_rank():
    """One layer of Llama 3 405B (H 16,384, 128 query and 8 K/V heads, F 53,248) at sequence
    8,192, microbatch 1, TP8 + SP, bf16 weights: 0.598 GiB per layer, C18's count plus 8 KiB
    of 1/rms; before, labkit's layer kept 1.250 GiB (gathered inputs, fp32 norm copies,
    normalised inputs, K/V repeated to the query heads, a copy of the attention output)."""
    cfg = RunConfig(model=replace(preset("llama3-405b"), n_layers=2),
                    parallel=ParallelConfig(tp=8, dp=2), global_batch=2, micro_batch=1,
                    steps=1, precision="bf16", zero_stage=1, sequence_parallel=True,
                    count_flops=False)
    want = predicted_layer_activations(cfg)
    _check(fake_layer_activations(cfg, 9), want)
    per_layer = sum(want["total"].values())
    assert per_layer - sum(want["megatron"].values()) == 2 * 4 * 8192 // 8
    assert per_layer == 642_260_992  # 0.598 GiB


def test_c18_count_is_the_planners_megatron_accounting():
    """The per-part count sums to labkit.plan's per-layer Megatron-LM bytes (16-bit, flash
    attention, SwiGLU, GQA, no dropout), which for GPT-3's shapes is S·B·H·(34 + 5·A·S/H)
    (tests/test_plan*.py); with SP and the core recomputed it divides by T (34·S·B·H/T)."""
    from labkit.plan.activations import layer_activation_bytes
    from labkit.plan.models import plan_model

    for name, tp, sp in (("tiny", 1, False), ("small", 2, True), ("llama3-8b", 8, True),
                         ("llama3-405b", 8, False)):
        mc = preset(name)
        s = mc.seq_len
        got = sum(megatron_block_terms(mc, 1, s, tp, sequence_parallel=sp).values())
        assert got == layer_activation_bytes(plan_model(mc), 1, s, s, tp, sp)["total"], name
    mc = preset("llama3-8b")  # K = 8 ≥ T
    one = megatron_block_terms(mc, 1, 4096, 1, recompute=True)
    for t in (2, 4, 8):
        parts = megatron_block_terms(mc, 1, 4096, t, sequence_parallel=True, recompute=True)
        assert {k: v * t for k, v in parts.items()} == one
    assert labkit_adjustments(mc, 1, 4096, 8, sequence_parallel=True) == {
        "1/rms per norm (fp32)": {"attn_norm": 4 * 512, "mlp_norm": 4 * 512}}


@pytest.mark.distributed
def test_real_job_layers_equal_the_count_and_the_fake_measurement(cluster2):
    """The tiny model, TP2 + SP, bf16 (autocast) in the real job on two CPU ranks: every
    layer of every rank keeps exactly the count; the fake measurement of each rank agrees."""
    cfg = RunConfig(model="tiny", parallel=ParallelConfig(tp=2), global_batch=4, steps=1,
                    precision="bf16", sequence_parallel=True, count_flops=False, timeout_s=120)
    want = predicted_layer_activations(cfg)
    r = cluster2.run(job_layer_activations, cfg)
    assert len(r.outputs) == 2
    for out in r.outputs:
        _check(out, want)
        fake = fake_layer_activations(cfg, out["rank"])
        assert fake["layers"] == out["layers"] and fake["outside"] == out["outside"]


def test_rms_norm_gradients_are_the_plain_formulas():
    """labkit.models.norm keeps only x and 1/rms and rebuilds the rest in backward: its
    outputs are the plain ops' bit for bit, its gradients torch's autograd of the plain ops
    (fp32: to 1e-6; bf16 input, fp32 weight: to bf16 rounding)."""
    import torch

    from labkit.models.norm import rms_norm

    def plain(x, w, eps=1e-5):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(8, generator=g, requires_grad=True)
    gy = torch.randn(2, 3, 8, generator=g)
    assert torch.equal(rms_norm(x, w, 1e-5), plain(x, w))
    for a, b in zip(torch.autograd.grad(rms_norm(x, w, 1e-5), (x, w), gy),
                    torch.autograd.grad(plain(x, w), (x, w), gy)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    wb = w.detach().float().requires_grad_()
    ours = torch.autograd.grad(rms_norm(xb, wb, 1e-5), (xb, wb), gy)
    ref = torch.autograd.grad(plain(xb, wb), (xb, wb), gy)
    assert torch.equal(rms_norm(xb, wb, 1e-5), plain(xb, wb))
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-2)


def test_regathered_matmuls_under_autocast_match_autocasts_own():
    """Sequence parallelism's column matmuls that keep the shard (degree 1 here, so the
    gathers are identities): under bf16 autocast over fp32 weights, the outputs and the
    gradients of the input and weights are those of autocast's own linear layers."""
    import torch
    import torch.nn.functional as F

    from labkit.models.gpt import compute_dtype
    from labkit.parallel.tensor.layers import _RegatherColumnMatmuls

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 16, generator=g, requires_grad=True)
    ws = [torch.randn(o, 16, generator=g, requires_grad=True) for o in (8, 4)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _RegatherColumnMatmuls.apply(x, None, {}, *ws)
        ref = tuple(F.linear(compute_dtype(x), w) for w in ws)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    gys = [torch.randn(y.shape, generator=g).to(y.dtype) for y in ref]
    a = torch.autograd.grad(ours, [x, *ws], gys)
    b = torch.autograd.grad(ref, [x, *ws], gys)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)


def test_regather_collectives_overlap_the_backward_matmuls(monkeypatch):
    """Megatron-LM's overlap, as an order of events (not a timing): in backward the
    re-gather of the kept shard is issued before dX = Σ dY·W is computed and waited for only
    after it; the reduce-scatter of dX is issued before the dW = dYᵀ·X are computed and
    waited for after them (Korthikanti et al. 2022 §4.2.2)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from labkit.parallel.tensor import layers

    log = []

    def recorded(name):
        def start(x, group, tags=None):
            log.append(f"issue {name}")

            def done():
                log.append(f"wait {name}")
                return x
            return done
        return start

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
                # dX: (tokens, O) @ (O, I); dW: (O, tokens) @ (tokens, I), 12 tokens
                log.append("dW" if args[0].shape[-1] == 12 else "dX")
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(layers, "start_gather_seq", recorded("gather"))
    monkeypatch.setattr(layers, "start_scatter_seq", recorded("scatter"))
    x = torch.randn(2, 6, 16, requires_grad=True)
    ws = [torch.randn(8, 16, requires_grad=True), torch.randn(4, 16, requires_grad=True)]
    ys = layers._RegatherColumnMatmuls.apply(x, None, {}, *ws)
    with Matmuls():
        torch.autograd.grad(ys, [x, *ws], [torch.ones_like(y) for y in ys])
    assert log == ["issue gather", "dX", "dX", "wait gather", "issue scatter", "dW", "dW",
                   "wait scatter"], log
