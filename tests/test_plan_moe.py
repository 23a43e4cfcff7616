"""The planner (:mod:`labkit.plan`) on mixture-of-experts models, held against real runs.

Nothing here compares the planner with labkit's own formulas: parameter counts with the
built model's tensors, FLOPs with torch's ``FlopCounterMode``, per-rank parameters and
model-state bytes with what each rank of a training job on the cluster held
(``metrics["rank_params"]``, ``metrics["memory"]["model_state"]``), all-to-all bytes with
the bytes ``labkit.comm`` traced on every rank.

What the planner leaves out, in words: Adam's step counter (torch keeps one 4-byte tensor
per parameter tensor, or per flat unit under ZeRO), so a rank's measured optimizer bytes
exceed the plan by 4 bytes per such tensor; and the planner's all-to-all bytes assume
balanced routing unless told the share of rows that left the rank.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit import jobs
from labkit.config import PRESETS, RunConfig
from labkit.models import build_model
from labkit.plan import Layout, estimate, plan_model
from labkit.plan.comm import expert_all_to_all_bytes

BASE = RunConfig(steps=1, global_batch=4, count_flops=False, measure_memory=True,
                 sequence_parallel=False)
#: (run changes, the same layout for the planner); global batch 4, one microbatch per rank
CASES = {
    "dp2": (dict(dp=2), dict(dp=2, zero=0, global_batch=4, microbatch=2)),
    "dp2-ep2": (dict(dp=2, ep=2), dict(dp=2, ep=2, zero=0, global_batch=4, microbatch=2)),
    "tp2": (dict(tp=2), dict(tp=2, zero=0, global_batch=4, microbatch=4)),
    "pp2": (dict(pp=2, micro_batch=2), dict(pp=2, zero=0, global_batch=4, microbatch=2,
                                            schedule="1f1b")),
    "zero1": (dict(dp=2, zero_stage=1), dict(dp=2, zero=1, global_batch=4, microbatch=2)),
    "zero3": (dict(dp=2, zero_stage=3), dict(dp=2, zero=3, global_batch=4, microbatch=2)),
    # the experts stay out of ZeRO's flat units: only the rest of the state is sharded
    "dp2-ep2-zero1": (dict(dp=2, ep=2, zero_stage=1),
                      dict(dp=2, ep=2, zero=1, global_batch=4, microbatch=2)),
}
MATRIX = [(model, case) for model in ("tiny", "tiny-moe") for case in CASES
          if not (model == "tiny" and "ep" in case)]


def _plan(model: str, layout: dict):
    return estimate(model, "h100-server", Layout(sequence_parallel=False, **layout),
                    runtime="labkit-fp32", timing=False)


def test_parameters_are_the_built_models_and_flops_are_torchs_count():
    """Total parameters and matmul FLOPs per token (router + k experts) of tiny-moe."""
    for name in ("tiny", "tiny-moe"):
        # the explicit attention (QKᵀ and ·V as matmuls) is counted by torch itself, whether or
        # not labkit.measure.flops registered its CPU SDPA formula earlier in the session
        model = build_model(PRESETS[name], seed=0, attention="math")
        pm = plan_model(name)
        assert pm.params == sum(p.numel() for p in model.parameters())
        x = torch.randint(0, 256, (2, pm.seq_len), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as fc:
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                              x.flatten()).backward()
        # attention is counted dense (every query-key pair), as the planner counts it
        per_token = fc.get_total_flops() / x.numel()
        assert per_token == pm.flops_per_token()
    moe, dense = plan_model("tiny-moe"), plan_model("tiny")
    assert moe.params == 344_896 and dense.params == 123_200


@pytest.mark.parametrize("model,case", MATRIX, ids=[f"{m}-{c}" for m, c in MATRIX])
def test_planned_parameters_and_state_per_rank_equal_the_run(cluster2, model, case):
    run_changes, layout = CASES[case]
    cfg = BASE.replace(model=model, **run_changes)
    plan = _plan(model, layout)
    r = cluster2.run(jobs.train, cfg)
    n_tensors = len(list(build_model(PRESETS[model], seed=0).parameters()))
    for m in r.metrics:                                       # every rank
        stage = m["coords"]["pp"]
        planned, got = plan.stage_memory[stage], m["memory"]["model_state"]
        assert m["rank_params"] == plan.rank_params[stage], (m["rank"], stage)
        assert got["parameters"] == planned["parameters"], m["rank"]
        assert got["gradients"] == planned["gradients"], m["rank"]
        # Adam's step counters: 4 bytes per parameter tensor (or flat unit) the rank steps
        extra = got["optimizer"] - planned["optimizer"]
        assert 0 < extra <= 4 * n_tensors and extra % 4 == 0, (m["rank"], extra)


@pytest.mark.parametrize("checkpoint,micro", [("none", 2), ("full", 1)])
def test_planned_all_to_all_bytes_equal_the_traced(cluster2, checkpoint, micro):
    """ep=2, tiny-moe: the planner's bytes, given the share of rows that left each rank
    (read from the run's routing), equal the ep bytes traced on the ranks, summed; with
    full recomputation the forward all-to-alls run twice."""
    cfg = BASE.replace(model="tiny-moe", dp=2, ep=2, micro_batch=micro, checkpoint=checkpoint,
                       measure_memory=False)
    r = cluster2.run(jobs.train, cfg)
    mc = PRESETS["tiny-moe"]
    tokens, accum = micro * mc.seq_len, cfg.accum_steps
    local = mc.n_experts // 2
    planned = balanced = 0.0
    for rank, out in enumerate(r.outputs):
        for kept in out["routing"][0]["kept"]:                # per layer, all microbatches
            away = sum(n for e, n in enumerate(kept) if e // local != rank)
            f = away / (accum * tokens * mc.top_k)
            kw = dict(recompute=checkpoint == "full")
            planned += accum * expert_all_to_all_bytes(tokens, mc.d_model, mc.top_k,
                                                       mc.n_experts, 2, sent_fraction=f,
                                                       **kw)["total"]
            balanced += accum * expert_all_to_all_bytes(tokens, mc.d_model, mc.top_k,
                                                        mc.n_experts, 2, **kw)["total"]
    traced = sum(m["comm_bytes_by_axis"]["ep"]["all_to_all"] for m in r.metrics)
    assert traced == planned
    # balanced routing sends half the rows away; the run's routing is near that
    assert abs(traced / balanced - 1) < 0.1
    plan = estimate("tiny-moe", "h100-server",
                    Layout(dp=2, ep=2, zero=0, global_batch=4, microbatch=micro,
                           checkpoint=checkpoint, sequence_parallel=False),
                    runtime="labkit-fp32", timing=False)
    per_layer = plan.terms["moe.all_to_all.total"].value
    assert 2 * mc.n_layers * accum * per_layer == balanced


def test_layouts_the_planner_refuses_for_experts():
    moe = plan_model("tiny-moe")
    bad = [(dict(dp=2, ep=2), "tiny", "ep=2 needs a mixture-of-experts model"),
           (dict(dp=3, ep=3, global_batch=3), "tiny-moe", "ep=3 does not divide n_experts=4"),
           (dict(dp=1, ep=2), "tiny-moe", r"ep=2 must divide the data ranks dp x cp = 1"),
           (dict(tp=2), "tiny-moe", "sequence_parallel=True with tp=2 and n_experts=4")]
    for lay, model, msg in bad:
        with pytest.raises(ValueError, match=msg):
            Layout(**lay).check(plan_model(model))
    assert moe.layer_matmul_params == (2 * 64 * 64 + 2 * 64 * 64) + 64 * 4 + 2 * 3 * 64 * 192
