"""The ViT through the one training job with data, tensor (+ sequence) and context
parallelism, against the independent ViT of tests/oracle/vit.py (claim C45).

One warm 4-rank pool runs every layout; each rank's losses, first-step gradients (before
AdamW) and final parameters must equal the oracle's to fp32 tolerance, and every axis's
bytes the job's prediction, to the byte (also against counts by hand from the shapes). Pure
checks: the refusals before launch, and the video token count of labkit.plan.video.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from oracle.vit import vit_reference_flops, vit_reference_run

from labkit import jobs
from labkit.config import RunConfig, preset

TOL = 1e-5
MEAN = dataclasses.replace(preset("vit-digits"), pool="mean", name="vit-digits-mean")
BASE = RunConfig(model=MEAN, dataset="digits", steps=2, global_batch=8, return_state=True,
                 return_grads=True, measure_memory=False, count_flops=False, timeout_s=240,
                 adam_eps=1e-6)
# claim C45: ring attention without the causal mask, tp with sequence parallelism, and both
LAYOUTS = {
    "dp2": dict(dp=2),
    "tp2-cls": dict(tp=2, model=preset("vit-digits")),
    "cp2-ring": dict(cp=2, cp_zigzag=False),
    "dp2-tp2": dict(dp=2, tp=2),
    "tp2-cp2-sp-ring": dict(tp=2, cp=2, sequence_parallel=True, cp_zigzag=False),
    "cp4-ulysses": dict(cp=4, cp_method="ulysses"),
}
_ORACLE: dict = {}


def _oracle(cfg) -> dict:
    key = cfg.model_config
    if key not in _ORACLE:
        _ORACLE[key] = vit_reference_run(cfg)
    return _ORACLE[key]


def test_vit_layouts_match_the_oracle_on_every_rank(cluster4):
    """claim C45: every layout's losses, first-step gradients and final state, on every rank."""
    bad = []
    for name, kw in LAYOUTS.items():
        cfg = BASE.replace(**kw)
        ref = _oracle(cfg)
        r = cluster4.run(jobs.train, cfg)
        for rank, o in enumerate(r.outputs):
            worst = max(abs(a - b) for a, b in zip(o["losses"], ref["losses"]))
            if len(o["losses"]) != cfg.steps or worst > TOL:
                bad.append(f"{name} rank {rank}: losses {o['losses']} vs {ref['losses']}")
            for key in ("grads", "state"):
                if set(o[key]) != set(ref[key]):
                    bad.append(f"{name} rank {rank}: {key} names differ: "
                               f"{sorted(set(o[key]) ^ set(ref[key]))}")
                    continue
                for n, t in o[key].items():
                    d = (t - ref[key][n]).abs().max().item()
                    if t.shape != ref[key][n].shape or d > TOL:
                        bad.append(f"{name} rank {rank}: {key} {n} differs by {d:.2e}")
        bad += _bytes_disagree(name, cfg, r)
    assert not bad, "\n".join(bad[:20])


def _bytes_disagree(name: str, cfg, r) -> list:
    """Every rank's bytes per axis and collective against the job's prediction, which must
    cover tp and cp wherever their degree is above 1."""
    bad = []
    for m in r.metrics:
        pred = m["comm_predicted_by_axis"]
        for axis in ("tp", "cp"):
            if getattr(cfg.parallel, axis) > 1 and axis not in pred:
                bad.append(f"{name} rank {m['rank']}: no predicted {axis} bytes")
        for axis, ops in pred.items():
            got = {k: v for k, v in m["comm_bytes_by_axis"].get(axis, {}).items() if v}
            want = {k: v for k, v in ops.items() if v}
            if got != want:
                bad.append(f"{name} rank {m['rank']} {axis}: measured {got}, predicted {want}")
    return bad


# The bytes of one step from the shapes, by hand: 8 images of 16 patch tokens (8x8 digits in
# 2x2 patches; + 1 class token with pool="cls"), H = 64, 2 blocks, fp32, one microbatch.
B, P, H, L = 8, 16, 64, 2
U = (2 - 1) / 2 * B * P * H * 4          # one all-gather / reduce-scatter of (B, P, H) over 2
HAND = {
    # each block: 2 all-reduces forward (attention, MLP outputs) + 2 backward (their
    # inputs' gradients) of (B, P + 1, H); nothing else is split
    "tp2-cls": (dict(tp=2, model=preset("vit-digits")),
                {"tp": {"all_reduce": L * 4 * 2 * (2 - 1) / 2 * B * (P + 1) * H * 4}}),
    # SP: per block 2 all-gathers + 2 reduce-scatters forward, 2 + 2 backward, 2 regathers;
    # the split sequence's gradient gathered once; the pooled (B, H) sum all-reduced forward;
    # the norm weights' gradients (2 per block + the final one, H each) all-reduced
    "tp2-sp": (dict(tp=2, sequence_parallel=True),
               {"tp": {"all_gather": (L * 6 + 1) * U, "reduce_scatter": L * 4 * U,
                       "all_reduce": (2 - 1) * (B * H * 4 + (2 * L + 1) * H * 4)}}),
    # ring: K and V of this rank's P/2 tokens (2·B·P/2·H·4 bytes) sent once forward, once
    # more backward and dK/dV twice; the pooled (B, H) sum all-reduced forward and backward
    "cp2-ring": (dict(cp=2, cp_zigzag=False),
                 {"cp": {"send": L * 4 * 2 * B * P // 2 * H * 4,
                         "all_reduce": 2 * 2 * (2 - 1) / 2 * B * H * 4}}),
}
# the prediction against the measurement where a hand count would repeat the formula:
# recomputation and accumulation, tp with cp, bf16 weights under ZeRO-3
AGREE = {
    "tp2-cls-checkpoint-accum": dict(tp=2, model=preset("vit-digits"), checkpoint="full",
                                     micro_batch=4),
    "tp2-sp-checkpoint": dict(tp=2, sequence_parallel=True, checkpoint="full"),
    "cp2-allgather-accum": dict(cp=2, cp_method="allgather", micro_batch=2),
    "tp2-cp2-sp-ring": dict(tp=2, cp=2, sequence_parallel=True, cp_zigzag=False),
    "dp2-tp2-sp-zero3-bf16": dict(dp=2, tp=2, sequence_parallel=True, zero_stage=3,
                                  precision="bf16"),
}


def test_vit_bytes_equal_the_prediction_on_every_rank(cluster4):
    """The ViT's tp and cp bytes of a step, as its traced calls moved them, equal the job's
    prediction (labkit.train.comm_predict) to the byte on every rank, and where counted by
    hand above, the hand count too."""
    bad = []
    for name, kw in {**{n: kw for n, (kw, _) in HAND.items()}, **AGREE}.items():
        cfg = BASE.replace(**kw, return_state=False, return_grads=False)
        r = cluster4.run(jobs.train, cfg)
        bad += _bytes_disagree(name, cfg, r)
        for axis, want in HAND.get(name, (None, {}))[1].items():
            for m in r.metrics:
                got = {k: v for k, v in m["comm_bytes_by_axis"][axis].items() if v}
                if got != want:
                    bad.append(f"{name} rank {m['rank']} {axis}: measured {got}, "
                               f"by hand {want}")
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("kw, words", [
    (dict(pp=2), "pipeline"),
    (dict(ep=2, dp=2), "expert"),
    (dict(cp=2, model=preset("vit-digits")), "pool='cls' adds a class token"),
    (dict(tp=2, sequence_parallel=True, model=preset("vit-digits")), "pool='mean'"),
    (dict(cp=2, model=dataclasses.replace(MEAN, image_size=6)), "9 patch tokens"),
    (dict(tp=3), "tp=3"),
    (dict(cp=4, cp_method="ulysses", model=dataclasses.replace(MEAN, n_heads=2)), "Ulysses"),
])
def test_vit_layouts_refused_before_launch(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        BASE.replace(**kw).validate()


@pytest.mark.parametrize("policy", ["full", "every", "selective"])
def test_checkpointed_vit_hardware_flops_count_the_recompute(policy):
    """The job counts a ViT step's FLOPs with its checkpoint policy applied, as it trains
    it: hardware FLOPs exceed model FLOPs by exactly the recomputed forward the oracle
    counts (they once came out equal: the ViT's count skipped the policy, so HFU left the
    recomputation out)."""
    import torch

    from labkit.train.flops import _count

    cfg = BASE.replace(checkpoint=policy, checkpoint_every=2 if policy == "every" else 1)
    assert cfg.micro == cfg.global_batch  # one microbatch: the oracle's whole batch
    want = vit_reference_flops(cfg)
    model = _count(cfg, (0,), "none", torch.device("cpu"))
    hardware = _count(cfg, (0,), policy, torch.device("cpu"))
    assert (model, hardware - model) == (want["model"], want["recompute"])
    assert want["recompute"] > 0


def test_class_token_gradient_holds_only_itself():
    """One image per microbatch: the class token's gradient is a tensor of its own, not a
    view of the (1, P+1, H) gradient of the token sequence (which AccumulateGrad would
    keep as ``.grad``, holding P+1 times the token's bytes as model state)."""
    import torch

    from labkit.models import build_model

    model = build_model(preset("vit-digits"), seed=0)
    model(torch.randn(1, 1, 8, 8), torch.tensor([3])).backward()
    g = model.cls_token.grad
    assert g.untyped_storage().nbytes() == g.numel() * g.element_size()


def test_fsdp2_vit_measures_its_root_parameters_as_parameters(cluster4):
    """Under PyTorch's FSDP2 (impl='torch', ZeRO 3) each rank's measured model state equals
    the job's prediction, category by category. The class token and the position table are
    the root's own parameters, all-gathered by the root's own hook into padded buffers
    (dim 0 is 1: 4 rows over 4 ranks); they were once measured as activations, the
    parameters short by their 4 × (64 + 17·64) · 4 bytes."""
    cfg = BASE.replace(dp=4, zero_stage=3, impl="torch", model=preset("vit-digits"), steps=1,
                       measure_memory=True, return_state=False, return_grads=False)
    for m in cluster4.run(jobs.train, cfg).metrics:
        got, want = m["memory"]["model_state"], m["memory_predicted"]
        assert {c: got[c] for c in ("parameters", "gradients", "optimizer")} == \
            {c: want[c] for c in ("parameters", "gradients", "optimizer")}, m["rank"]


def test_video_tokens_match_the_lecture():
    """claim C45: 5 minutes at 24 fps, 224² frames in 16² patches = 7200 × 196 tokens."""
    from labkit.plan.video import video_tokens

    v = video_tokens(seconds=300, fps=24, image_size=224, patch_size=16)
    assert (v.frames, v.patches_per_frame, v.tokens) == (7200, 196, 1_411_200)
    assert round(v.tokens / 1e6, 2) == 1.41
    # a tubelet of 2 frames (ViViT) halves it; a class token per clip adds one
    assert video_tokens(300, 24, 224, 16, tubelet=2).tokens == 705_600
    assert video_tokens(300, 24, 224, 16, cls_token=True).tokens == 1_411_201
    with pytest.raises(ValueError, match="patch_size=15"):
        video_tokens(300, 24, 224, 15)


ACT = {  # (degrees, precision, zero): fp32; bf16 autocast (fp32 stream); bf16 weights (ZeRO)
    "dp4": (dict(dp=4), "fp32", 0),
    "cp2-dp2": (dict(cp=2, dp=2), "fp32", 0),
    "tp2-cp2-sp": (dict(tp=2, cp=2, sequence_parallel=True), "fp32", 0),
    "cp4-bf16": (dict(cp=4), "bf16", 0),
    "cp2-dp2-bf16-zero1": (dict(cp=2, dp=2), "bf16", 1),
}


def test_planned_vit_activations_equal_the_measured_bytes(cluster4):
    """claim C45: the planner's per-rank activation bytes of the ViT's blocks
    (labkit.plan.video.vit_activation_bytes, the count the video-length plan uses) equal
    what the job's ViT blocks save for backward on every rank, by part, to the byte."""
    from labkit.measure.vit_activations import job_vit_layer_activations
    from labkit.plan.video import vit_activation_bytes

    bad = []
    for name, (deg, precision, zero) in ACT.items():
        cfg = BASE.replace(**deg, precision=precision, zero_stage=zero, micro_batch=2,
                           steps=1, return_state=False, return_grads=False)
        e, r = (4, 4) if precision == "fp32" else ((2, 2) if zero else (2, 4))
        want = vit_activation_bytes(MEAN, 16, cfg.parallel.cp, cfg.parallel.tp,
                                    sequence_parallel=cfg.sequence_parallel, batch=2,
                                    bytes_per_elem=e, resid_bytes=r)
        for o in cluster4.run(job_vit_layer_activations, cfg).outputs:
            assert o["tokens_per_rank"] == want["tokens_per_rank"]
            for i, parts in o["layers"].items():
                if parts != want["per_layer"]:
                    bad.append(f"{name} rank {o['rank']} layer {i}: {parts} != "
                               f"{want['per_layer']}")
    assert not bad, "\n".join(bad)
