"""PipelineView, headless: simulation-only, on a real run, re-run by set(), played, static."""
from __future__ import annotations

import pytest

from labkit.parallel.pipeline.schedules import build
from labkit.parallel.pipeline.simulate import simulate


def test_gantt_data_counts_spans_and_bubbles():
    from labkit_widgets.pipeline_view import gantt_data

    sim = simulate(build("1f1b", 4, 4))
    cols = gantt_data(sim.spans, 4, scale=1.0)
    assert len(cols["F"]["x"]) == len(cols["BW"]["x"]) == 16 and not cols["W"]["x"]
    # idle bars add up to the simulator's idle time on every rank
    for r in range(4):
        idle = sum(x for x, y in zip(cols["idle"]["x"], cols["idle"]["y"]) if y == f"rank {r}")
        assert idle == pytest.approx(sim.idle[r])
    half = gantt_data(sim.spans, 4, until=sim.makespan / 2, scale=1.0)
    assert 0 < len(half["F"]["x"]) < 16
    assert max(b + x for b, x in zip(half["F"]["base"], half["F"]["x"])) <= sim.makespan / 2


def test_simulation_only_without_cluster():
    import plotly.graph_objects as go
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(schedule="zb-h1", pp=4, microbatches=4)
    assert "simulated only" in v.status.value
    sim_bars = sum(len(v.fig.data[5 + i].x) for i in range(1, 5))
    assert sim_bars == 3 * 4 * 4  # F, B, W for 4 stages x 4 microbatches
    assert isinstance(v.figure(), go.Figure)
    v.controls["microbatches"].value = 8  # observe → re-simulate
    assert sum(len(v.fig.data[5 + i].x) for i in range(1, 5)) == 3 * 4 * 8


@pytest.mark.distributed
def test_real_run_rerun_and_play(cluster4):
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(cluster4, schedule="1f1b", pp=4, microbatches=4)
    assert v.report is not None and "measured" in v.status.value
    measured = sum(len(v.fig.data[i].x) for i in range(1, 5))
    assert measured == 2 * 4 * 4  # F and BW
    assert len(v.fig.data[0].x) > 0  # idle bubbles drawn
    v.set(schedule="zb-v", pp=2, microbatches=2)
    assert sum(len(v.fig.data[i].x) for i in range(1, 5)) == 3 * 4 * 2  # 4 stages on 2 ranks
    v.time.value = 10  # the play control drives this slider
    assert sum(len(v.fig.data[i].x) for i in range(1, 5)) < 3 * 4 * 2
    v.set(schedule="gpipe", microbatches=16)  # batch 8 does not split in 16: doubled to 32
    assert v.result.config.global_batch == 32
    bundle = v._repr_mimebundle_()
    assert "application/vnd.plotly.v1+json" in bundle
