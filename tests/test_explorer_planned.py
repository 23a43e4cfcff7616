"""The Explorer's planned panel: the controls' layout scaled to a real model and cluster by an
explicit rule, its numbers the planner's own (exact), redrawn at each accepted change before
the ranks run, and the planner's reason instead of numbers when it refuses the layout."""
from __future__ import annotations

import html
import re

import pytest

from labkit.config import RunConfig
from labkit.plan import GiB, Layout, estimate
from labkit.plan.layout import MESH_ORDER
from labkit_widgets.explorer_planned import (MEMORY_CATEGORIES, RUNTIME, PlannedPanel,
                                             gpu_counts, scale, step_parts)

from test_widgets import FakeCluster

TOUR = RunConfig(model="tiny", steps=3, global_batch=8)


def _plain(widget_html: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", widget_html))).strip()


def _lay(**kw) -> Layout:
    """A Layout as the rule should give it: one sequence per microbatch, the lab mesh's rank
    order, sequence parallelism off unless given."""
    return Layout(microbatch=1, order=MESH_ORDER, **{"sequence_parallel": False, **kw})


# (lab configuration, GPUs, the layout the rule must give)
CASES = [
    (TOUR.replace(dp=4), 1024, _lay(dp=1024, zero=0, global_batch=1024)),
    (TOUR.replace(dp=1, pp=2, zero_stage=1), 1024,
     _lay(pp=2, dp=512, zero=1, global_batch=512 * 4)),
    (TOUR.replace(dp=1, pp=2, schedule="interleaved", microbatches=4, checkpoint="full"), 512,
     _lay(pp=2, dp=256, zero=0, global_batch=256 * 4, schedule="interleaved",
          virtual_stages=2, checkpoint="full")),
    (TOUR.replace(dp=2, tp=2, cp=2, sequence_parallel=True, zero_stage=2), 16384,
     _lay(tp=2, cp=2, dp=4096, zero=2, global_batch=4096, sequence_parallel=True)),
    (TOUR.replace(dp=4, zero_stage=3, hsdp_replicas=2), 1024,
     _lay(dp=1024, zero=3, global_batch=1024, dp_shard=512)),
    (TOUR.replace(dp=1, pp=2, microbatches=2, micro_batch=2, checkpoint="every"), 64,
     _lay(pp=2, dp=32, zero=0, global_batch=32 * 2, checkpoint="full")),
]


@pytest.mark.parametrize("cfg, gpus, want", CASES, ids=range(len(CASES)))
def test_the_scaling_rule(cfg, gpus, want):
    """TP, CP, PP as in the lab; DP fills the GPUs; each data rank runs the lab's flush of
    microbatches, one sequence each; ZeRO, HSDP replicas, schedule, V, recomputation and
    sequence parallelism carried over; ranks numbered as the lab's mesh."""
    lay, notes = scale(cfg, gpus)
    assert lay == want
    assert "the lab runs fp32; the plan is bf16 mixed precision" in notes


@pytest.mark.parametrize("cfg, gpus, want", CASES[:4], ids=range(4))
@pytest.mark.parametrize("model, cluster", [("llama3-8b", "llama3-24k"),
                                            ("llama3-70b", "cs336-cluster")])
def test_panel_numbers_are_the_planners(cfg, gpus, want, model, cluster):
    panel = PlannedPanel(cfg, model=model, cluster=cluster, gpus=gpus)
    plan = estimate(model, cluster, want, RUNTIME)
    assert panel.reason is None and panel.planned_layout == want
    n = panel.numbers
    assert n["memory"] == plan.memory and n["memory_limit"] == plan.memory_limit
    assert (n["step_time_s"], n["bubble"], n["mfu"], n["hfu"], n["fits"], n["reasons"]) == (
        plan.step_time, plan.bubble, plan.mfu, plan.hfu, plan.fits, list(plan.reasons))
    fig = panel.fig
    for tr, c in zip(fig.data, MEMORY_CATEGORIES):
        assert tuple(tr.y) == (plan.memory[c] / GiB,), c
    parts = [tr.y[0] for tr in fig.data[len(MEMORY_CATEGORIES):]]
    assert parts == step_parts(plan) and sum(parts) == pytest.approx(plan.step_time, rel=1e-12)
    assert fig.layout.shapes[0].y0 == plan.memory_limit / GiB
    title = fig.layout.title.text
    assert f"MFU {100 * plan.mfu:.1f} %" in title and f"bubble {100 * plan.bubble:.1f} %" in title
    assert ("fits" if plan.fits else "does not fit: memory") in title
    rule = _plain(panel.rule.value)
    assert f"DP fills the GPUs: {gpus:,} / " in rule and f"= {want.dp:,}." in rule


def test_a_slider_change_replans_before_the_run():
    seen = []
    fake = FakeCluster(on_run=lambda cfg: seen.append(ex.planned.planned_layout))
    from labkit_widgets import Explorer

    ex = Explorer(fake, TOUR.replace(dp=2), run_now=False, timeline=False)
    assert ex.planned in ex.children and ex.planned.planned_layout.dp == 1024
    ex.set(dp=1, pp=2)                                         # a released slider, via set
    want = _lay(pp=2, dp=512, zero=0, global_batch=512 * 4)   # the lab: 4 microbatches
    assert ex.planned.planned_layout == want and seen == [want]   # planned before the run
    assert ex.planned.numbers["bubble"] == estimate("llama3-8b", "llama3-24k", want,
                                                    RUNTIME).bubble
    ex.controls["zero_stage"].value = 1                        # a drag
    assert ex.planned.planned_layout.zero == 1 and seen[-1].zero == 1
    assert ex.planned.numbers["memory"] == estimate(
        "llama3-8b", "llama3-24k", want.with_(zero=1), RUNTIME).memory
    before = ex.planned.numbers
    ex.set(pp=3)                                               # refused by validate: no change
    assert ex.last_error is not None and ex.planned.numbers == before


def test_a_refused_layout_shows_the_reason_instead_of_numbers():
    cfg = TOUR.replace(dp=1, tp=3)
    panel = PlannedPanel(cfg, model="llama3-8b", cluster="llama3-24k", gpus=24576)
    reason = "tp=3 does not divide n_heads=32"                 # the planner's own words
    assert panel.reason == reason and panel.plan is None and panel.numbers == {}
    assert all(tuple(tr.y) == (None,) for tr in panel.fig.data)
    assert reason in _plain(panel.rule.value) and "not planned" in _plain(panel.rule.value)
    assert any(reason in (a.text or "").replace("<br>", " ") for a in panel.fig.layout.annotations)
    assert not panel.fig.layout.xaxis.visible and not panel.fig.layout.shapes
    panel.update(TOUR.replace(dp=1, tp=2))                     # a plannable layout again
    assert panel.reason is None and panel.numbers["fits"] in (True, False)
    assert panel.fig.layout.xaxis.visible and len(panel.fig.layout.annotations) == 2
    for cfg, gpus, why in [
            (TOUR.replace(dp=1, pp=2, schedule="zb-h1"), 1024, "schedule='zb-h1': the planner"),
            (TOUR.replace(dp=1, tp=3), 1024, "1,024 GPUs / (tp x cp x pp = 3 x 1 x 1 = 3) is "
                                             "not whole"),
            (TOUR.replace(dp=4, zero_stage=1, hsdp_replicas=2), 1024, "HSDP under ZeRO-3"),
            (TOUR.replace(dp=1, cp=3), 24576, "cp=3 does not divide seq_len=8192")]:
        panel.set(gpus=gpus)
        panel.update(cfg)
        assert why in panel.reason and panel.numbers == {}, (cfg, panel.reason)


def test_a_layout_that_does_not_fit_keeps_its_numbers():
    panel = PlannedPanel(TOUR.replace(dp=4), model="llama3-405b", gpus=16384)
    assert panel.reason is None and panel.numbers["fits"] is False
    assert panel.numbers["memory"]["total"] > panel.numbers["memory_limit"]
    assert "does not fit: memory" in panel.fig.layout.title.text


def test_dropdowns_replan():
    panel = PlannedPanel(TOUR.replace(dp=4))
    assert gpu_counts("llama3-24k")[:2] == [8, 16] and gpu_counts("llama3-24k")[-1] == 24576
    assert gpu_counts("h100-server") == [8]
    panel.model.value = "llama3-70b"
    assert panel.numbers["memory"] == estimate("llama3-70b", "llama3-24k",
                                               _lay(dp=1024, zero=0, global_batch=1024),
                                               RUNTIME).memory
    panel.cluster.value = "selene-a100"        # 3,072 GPUs: the count nearest 1,024 stays
    assert panel.gpus.value == 1024 and panel.gpus.options[-1] == ("3,072", 3072)
    assert "A100" in panel.fig.layout.title.text
    panel.cluster.value = "h100-server"
    assert panel.gpus.value == 8 and panel.planned_layout.dp == 8
    with pytest.raises(ValueError, match="gpus=16: h100-server offers"):
        panel.set(gpus=16)
    with pytest.raises(ValueError, match="unknown"):
        PlannedPanel(TOUR, model="nope")


def test_the_tours_question_has_the_answer_its_prose_implies():
    """notebooks/00_tour.ipynb asks which ZeRO stage first fits Llama 3 8B on 1,024 H100s,
    starting from plain data parallelism that "needs far more than 80 GiB per GPU"."""
    panel = PlannedPanel(TOUR.replace(dp=4))
    fits = {}
    for z in (0, 1, 2, 3):
        panel.update(TOUR.replace(dp=4, zero_stage=z))
        fits[z] = panel.numbers["fits"]
        if z == 0:
            assert panel.numbers["memory"]["total"] > 2 * 80 * GiB
    assert fits == {0: False, 1: False, 2: True, 3: True}


def test_one_legend_names_each_colour_once():
    """Memory categories and step-time parts share the panel's legend: no colour may mean
    two things (a step-time bar once had the parameters' blue)."""
    from labkit_widgets.explorer_planned import planned_figure

    colours = [t.marker.color for t in planned_figure().data]
    assert len(colours) == len(set(colours)), colours


def test_the_panel_plans_a_mixture_of_experts_for_tiny_moe_and_ep_is_planned():
    """A dense lab model is planned on the dense presets; tiny-moe switches the dropdown to
    the mixture-of-experts presets, so the lab's ep > 1 is planned (it used to be refused on
    every offered model); each kind keeps the user's last choice."""
    from labkit.config import RunConfig
    from labkit_widgets.explorer_planned import MODELS, MOE_MODELS, PlannedPanel

    dense = RunConfig(model="tiny", steps=2, parallel=dict(dp=4))
    moe = RunConfig(model="tiny-moe", steps=2, parallel=dict(dp=4, ep=2))
    panel = PlannedPanel(dense)
    assert panel.model.value == "llama3-8b" and set(panel.model.options) == set(MODELS)
    panel.update(moe)
    assert set(panel.model.options) == set(MOE_MODELS) and panel.reason is None
    assert panel.plan.layout.ep == 2 and panel.plan.model.n_experts > 0
    panel.set(model="deepseek-v3")
    panel.update(dense)
    assert panel.model.value == "llama3-8b" and panel.plan.layout.ep == 1
    panel.update(moe)
    assert panel.model.value == "deepseek-v3"


def test_a_control_that_holds_values_back_says_why_on_hover():
    from labkit.config import RunConfig
    from labkit_widgets import explorer_controls as C

    base = RunConfig(model="tiny-moe", steps=2)
    values = {**C.initial_values(base), "dp": 4, "ep": 2}
    a = C.availability(base, values, 4)
    tip = C.tooltip_now(C.BY_NAME["model"], a["model"])
    assert a["model"]["offer"] == ["tiny-moe"]
    assert "not offered now: tiny, small: ep=2 needs a mixture-of-experts model" in tip, tip
    assert C.tooltip_now(C.BY_NAME["tp"], {"refused": {}}) == C.BY_NAME["tp"].tooltip
