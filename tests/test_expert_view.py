"""ExpertView, headless: the heatmap is the run's routed counts, the replayed all-to-alls are
the traced events, and a new run updates both."""
from __future__ import annotations

import dataclasses
import json

import pytest

from labkit.config import PRESETS
from labkit.parallel.expert import a2a_bytes_formula
from labkit.parallel.expert.jobs import ExpertRunConfig, train

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(cluster4):
    base = ExpertRunConfig(ep=2, steps=2)
    dropping = dataclasses.replace(base, model=dataclasses.replace(
        PRESETS["tiny-moe"], capacity_factor=0.75), ep=4, global_batch=4)
    return cluster4.run(train, base), cluster4.run(train, dropping)


def test_heatmap_is_the_routed_counts_and_frames_are_the_trace(runs):
    from labkit_widgets.expert_view import ALL, ExpertView

    run, _ = runs
    v = ExpertView(run)
    heat, traffic = v.fig.data
    kept = [o["routing"][0]["kept"] for o in run.outputs]
    assert [list(r) for r in heat.z] == [[k[0][e] + k[1][e] for e in range(4)] for k in kept]
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
    assert [list(r) for r in traffic.z] == v.frames[0]["matrix"]
    v.play.value = 5  # Play drives the frame slider and the right panel follows
    assert v.frame.value == 5 and [list(r) for r in traffic.z] == v.frames[5]["matrix"]
    assert "6/8" in v.fig.layout.title.text and "dispatch (backward)" in v.fig.layout.title.text
    v.layer.value = 1
    assert [list(r) for r in heat.z] == [k[1] for k in kept]
    v.step.value = 1
    assert [list(r) for r in heat.z] == [o["routing"][1]["kept"][1] for o in run.outputs]
    assert len(v.frames) == 8 and v.frames[0]["matrix"] != []


def test_update_with_a_new_run_and_static_figure(runs):
    import plotly.graph_objects as go

    from labkit_widgets.expert_view import ExpertView

    run, dropping = runs
    v = ExpertView()
    assert repr(v) == "ExpertView(no run)"
    v.update(run)
    v.layer.value = 0
    v.update(dropping)  # four ranks, tokens dropped
    heat = v.fig.data[0]
    assert len(heat.z) == 4 and v.layer.value == 0
    dropped = [o["routing"][0]["dropped"][0] for o in dropping.outputs]
    assert sum(dropped) > 0 and f"dropped {sum(dropped)}" in v.fig.layout.title.text
    assert any("(−" in cell for row in heat.text for cell in row)
    assert len(v.frames[0]["matrix"]) == 4 and "ep=4" in v.status.value
    fig = v.figure()
    assert isinstance(fig, go.Figure) and not isinstance(fig, go.FigureWidget)
    json.loads(fig.to_json())
    assert "application/vnd.plotly.v1+json" in v._repr_mimebundle_()
