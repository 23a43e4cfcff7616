"""CheckpointView, headless: the figure shows the executed schedule's own record."""
from __future__ import annotations

import pytest

from labkit.parallel.checkpoint import formula_counts, make_schedule
from labkit.parallel.checkpoint.exec import run_schedule


@pytest.fixture
def view():
    from labkit_widgets.checkpoint_view import CheckpointView

    return CheckpointView(n_layers=8, strategy="every", every=3)


def test_figure_is_the_recorded_run(view):
    import plotly.graph_objects as go

    res = view.result
    assert res.schedule.strategy == "every" and res.schedule.every == 3
    want = formula_counts("every", 8, 3)
    assert res.counts == want and "(equal)" in view.status.value
    curve = view.fig.data[2]
    assert list(curve.y) == [s.bytes // res.unit_bytes for s in res.steps]
    assert max(curve.y) == want.peak_units
    assert view.step.max == view.play.max == len(res.steps) - 1
    n_marked = sum(len(view.fig.data[3 + i].x) for i in range(4))  # forward/recompute/backward/free
    assert n_marked == len(res.steps)
    assert len(view.fig.data[4].x) == want.recompute  # recompute marks
    fig = view.figure()
    assert type(fig) is go.Figure  # a plain copy, no widget
    assert "application/vnd.plotly.v1+json" in view._repr_mimebundle_()


def test_stepping_shows_which_activations_are_alive(view):
    res = view.result
    k = next(i for i, s in enumerate(res.steps) if s.action.startswith("R"))
    view.play.value = k  # Play drives the step slider
    assert view.step.value == k
    grid = view.fig.data[0]
    alive = {f"{'A' if y == 0 else 's'}{x}" for x, y, c in zip(grid.x, grid.y, grid.marker.color)
             if c != "#EEEEEE"}
    assert alive == set(res.steps[k].alive)
    assert list(view.fig.data[1].text) == [res.steps[k].action]
    assert list(view.fig.data[8].x) == [k]


def test_controls_rerun_the_schedule(view):
    view.set(n_layers=16, strategy="sqrt")
    assert view.result.schedule.n_layers == 16 and view.result.schedule.every == 4
    assert view.result.counts == formula_counts("sqrt", 16)
    view.controls["strategy"].value = "segment"
    view.controls["every"].value = 5
    assert view.result.schedule.strategy == "segment" and view.result.schedule.every == 5
    view.controls["n_layers"].value = 4  # C is clamped to N
    assert view.controls["every"].value == 4 and view.result.schedule.every == 4
    view.controls["strategy"].value = "full"
    assert view.controls["every"].disabled
    assert max(view.fig.data[2].y) == formula_counts("full", 4).peak_units


def test_view_of_a_given_schedule_or_result():
    from labkit_widgets.checkpoint_view import CheckpointView

    v = CheckpointView(schedule=make_schedule("selective", 6))
    assert v.controls["strategy"].value == "selective" and v.result.counts.ew_recompute == 6
    res = run_schedule(make_schedule("none", 5))
    v.update(res)
    assert v.result is res and v.controls["n_layers"].value == 5
    assert "CheckpointView('none', N=5" in repr(v)
