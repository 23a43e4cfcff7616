"""ExpertView, headless, on training-job results: the heatmap is the run's routed counts,
the replayed all-to-alls are the traced events (ep groups side by side as blocks of one
matrix), a new run updates both, and the model knobs re-run training on the warm cluster."""
from __future__ import annotations

import dataclasses
import json

import pytest

from labkit import jobs
from labkit.config import PRESETS, RunConfig
from labkit.parallel.expert import a2a_bytes_formula

pytestmark = pytest.mark.distributed

BASE = RunConfig(model="tiny-moe", steps=2, global_batch=8, measure_memory=False,
                 count_flops=False)


@pytest.fixture(scope="module")
def runs(cluster4):
    dropping = BASE.replace(model=dataclasses.replace(PRESETS["tiny-moe"], capacity_factor=0.75),
                            dp=4, ep=4, global_batch=4)
    return {"ep2": cluster4.run(jobs.train, BASE.replace(dp=2, ep=2)),
            "ep2xdp4": cluster4.run(jobs.train, BASE.replace(dp=4, ep=2)),
            "dropping": cluster4.run(jobs.train, dropping)}


def _rows(heat) -> list:
    return [list(r) for r in heat.z]


def test_heatmap_is_the_routed_counts_and_frames_are_the_trace(runs):
    from labkit_widgets.expert_view import ALL, ExpertView

    run = runs["ep2"]
    v = ExpertView(run)
    heat, traffic = v.fig.data
    kept = [o["routing"][0]["kept"] for o in run.outputs]
    assert _rows(heat) == [[k[0][e] + k[1][e] for e in range(4)] for k in kept]
    assert v.layer.value == ALL and "imbalance max/mean" in v.fig.layout.title.text
    # two layers x (dispatch, combine) x (forward, backward), in the order they ran
    assert len(v.frames) == 8 and v.frame.max == v.play.max == 7
    kinds = [(f["layer"], f["phase"], f["pass"]) for f in v.frames]
    assert kinds[:4] == [(0, "dispatch", "forward"), (0, "combine", "forward"),
                         (1, "dispatch", "forward"), (1, "combine", "forward")]
    assert kinds[4:] == [(1, "combine", "backward"), (1, "dispatch", "backward"),
                         (0, "combine", "backward"), (0, "dispatch", "backward")]
    for f in v.frames:  # every matrix row equals the formula from the counts
        for i, row in enumerate(f["matrix"]):
            want = a2a_bytes_formula([k[f["layer"]] for k in kept], i, 64)
            sent = want[f"{f['phase']}_sent"] if f["pass"] == "forward" else (
                want[f"{f['phase']}_recv"])
            assert sum(row) == sent and row[i] == 0
    assert _rows(traffic) == v.frames[0]["matrix"]
    v.play.value = 5  # Play drives the frame slider and the right panel follows
    assert v.frame.value == 5 and _rows(traffic) == v.frames[5]["matrix"]
    # the title numbers the all-to-all as the slider does (0 … max), not 1-based
    assert f"all-to-all {v.frame.value}/{v.frame.max}:" == "all-to-all 5/7:"
    assert "all-to-all 5/7:" in v.fig.layout.title.text
    assert "dispatch (backward)" in v.fig.layout.title.text and "5/7" in repr(v)
    v.layer.value = 1
    assert _rows(heat) == [k[1] for k in kept]
    v.step.value = 1
    assert _rows(heat) == [o["routing"][1]["kept"][1] for o in run.outputs]
    assert len(v.frames) == 8 and v.frames[0]["matrix"] != []
    assert "ep=2 · 4 experts, 2 per rank" in v.status.value


def test_ep_groups_side_by_side_are_blocks_of_one_frame(runs):
    from labkit_widgets.expert_view import ExpertView

    run = runs["ep2xdp4"]
    v = ExpertView(run)
    assert len(v.fig.data[0].z) == 4 and len(v.frames) == 8
    for f in v.frames:
        assert f["ranks"] == [0, 1, 2, 3]
        for i, row in enumerate(f["matrix"]):
            block = i // 2
            assert all(b == 0 for j, b in enumerate(row) if j // 2 != block)  # no cross-group
            kept = [run.outputs[j]["routing"][0]["kept"][f["layer"]]
                    for j in (2 * block, 2 * block + 1)]
            want = a2a_bytes_formula(kept, i % 2, 64)
            key = "sent" if f["pass"] == "forward" else "recv"
            assert sum(row) == want[f"{f['phase']}_{key}"]


def test_update_with_a_new_run_and_static_figure(runs):
    import plotly.graph_objects as go

    from labkit_widgets.expert_view import ExpertView

    v = ExpertView()
    assert repr(v) == "ExpertView(no run)"
    v.update(runs["ep2"])
    v.layer.value = 0
    dropping = runs["dropping"]
    v.update(dropping)  # four ranks, tokens dropped
    heat = v.fig.data[0]
    assert len(heat.z) == 4 and v.layer.value == 0
    dropped = [o["routing"][0]["dropped"][0] for o in dropping.outputs]
    assert sum(dropped) > 0 and f"dropped {sum(dropped)}" in v.fig.layout.title.text
    assert any("(−" in cell for row in heat.text for cell in row)
    assert len(v.frames[0]["matrix"]) == 4 and "ep=4" in v.status.value
    assert v.capacity.value == 0.75 and v.top_k.value == 2 and v.top_k.max == 4
    fig = v.figure()
    assert type(fig) is go.Figure  # a plain copy, no widget
    json.loads(fig.to_json())
    assert "application/vnd.plotly.v1+json" in v._repr_mimebundle_()


def test_knobs_rerun_training_on_the_cluster(cluster4, runs):
    from labkit_widgets.expert_view import ExpertView

    v = ExpertView(runs["ep2"], cluster4)
    assert v.aux_weight in v.children[0].children  # the knobs show with a cluster
    assert v.aux_weight.value == 0.01 and v.capacity.value == 0.0
    v.capacity.value = 0.5
    mc = v.result.config.model_config
    assert mc.capacity_factor == 0.5 and v.result is not runs["ep2"]
    assert v.result.config.parallel == runs["ep2"].config.parallel
    assert _rows(v.fig.data[0]) == [[k[0][e] + k[1][e] for e in range(4)]
                                    for k in (o["routing"][0]["kept"] for o in v.result.outputs)]
    assert "dropped 0" not in v.fig.layout.title.text
    v.top_k.value = 1
    assert v.result.config.model_config.top_k == 1
    assert sum(v.fig.data[0].z[0]) + sum(
        o["routing"][0]["dropped"][0] + o["routing"][0]["dropped"][1]
        for o in v.result.outputs[:1]) == 2 * 64 * 4  # one choice per token, both layers
    shown = v.result
    v.run(BASE.replace(pp=2, dp=1, model="tiny-moe"))  # refused by the view, shown, not raised
    assert v.result is shown and "pp=2" in v.status.value
    v.run(BASE.replace(dp=4, ep=3))  # refused before any rank starts
    assert v.result is shown and "ep=3 must divide" in v.status.value
    with pytest.raises(ValueError, match="mixture-of-experts"):
        v.update(cluster4.run(jobs.train, BASE.replace(model="tiny", dp=2)))
