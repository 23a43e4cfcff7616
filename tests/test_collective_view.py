"""CollectiveView, headless: controls re-run real collectives on the warm 4-rank cluster and
the figure follows the recorded steps (values, arrows, colours)."""
from __future__ import annotations

import json

import pytest

from labkit.collectives import jobs

pytestmark = pytest.mark.distributed


@pytest.fixture
def view(cluster4):
    from labkit_widgets.collective_view import CollectiveView

    return CollectiveView(cluster4, op="all_reduce", algorithm="ring", n=4)


def _state(view):
    return view.fig.data[1]


def _arrows(view):
    return [a for a in view.fig.layout.annotations if a.showarrow]


def test_ring_all_reduce_ends_with_the_sums_on_every_rank(view):
    rec = view.recording
    assert rec.steps == 6 and view.step.max == 6 and view.step.value == 6
    # chunk j of rank r starts as 10·r + j, so every rank ends with 60 + 4·j in chunk j
    assert [list(row) for row in _state(view).text] == [["60", "64", "68", "72"]] * 4
    assert [list(row) for row in _state(view).z] == [[4] * 4] * 4  # all 4 ranks in each
    assert view.result.bytes_match and "= formula" in view.status.value


def test_stepping_shows_partial_sums_and_arrows(view):
    view.step.value = 1
    z1 = [list(row) for row in _state(view).z]
    flat = [v for row in z1 for v in row]
    assert flat.count(2) == 4 and flat.count(1) == 12  # one chunk per rank got a partner
    assert len(_arrows(view)) == 4 and "step 1/6" in view.fig.layout.title.text
    assert "reduce" in view.info.value
    view.play.value = 3  # the Play widget drives the step slider
    assert view.step.value == 3 and "step 3/6" in view.fig.layout.title.text
    view.next_button.click()
    assert view.step.value == 4 and "all-gather" in view.fig.layout.title.text
    snap = view.figure(step=0)
    assert not [a for a in snap.layout.annotations if a.showarrow]
    json.loads(snap.to_json())  # a static figure nbval can store


def test_the_legend_says_reduced_only_for_collectives_that_reduce(view):
    assert "ranks reduced into the chunk" in view.fig.layout.title.text
    assert "red = reduced into the destination" in view.fig.layout.title.text
    for op in ("broadcast", "all_gather"):
        view.set(op=op, step=1)
        title = view.fig.layout.title.text
        assert "reduced into" not in title and "nothing is reduced" in title, title
    view.set(op="reduce_scatter", step=1)
    assert "reduced into the destination" in view.fig.layout.title.text


def test_changing_op_and_n_reruns_on_the_cluster(view):
    before = view.result
    view.op.value = "all_to_all"
    assert view.algorithm.value == "pairwise" and view.result is not before
    assert view.transpose.layout.display is None  # the transpose view is offered
    view.n.value = 2
    assert view.recording.world_size == 2 and len(_state(view).y) == 2
    view.set(n=4, step=1)
    assert len(_arrows(view)) == 4 and _arrows(view)[0].axref == "x"
    view.transpose.value = True
    out = [list(row) for row in _state(view).text]
    assert out == [[str(10 * j + r) for j in range(4)] for r in range(4)]
    assert not _arrows(view) and "transpose" in view.fig.layout.title.text
    view.algorithm.value = "native"
    assert view.recording.steps == 1 and view.step.max == 1


def test_reduce_non_root_buffer_is_not_shown_as_a_result(cluster4):
    from labkit_widgets.collective_view import CollectiveView

    v = CollectiveView(cluster4, op="reduce", algorithm="tree", n=2,
                       inputs=([[1, 2], [3, 4]], [[4, 5], [6, 7]]))
    assert list(_state(v).text[0]) == ["5, 7, 9, 11"]
    assert list(_state(v).text[1]) == ["—"] and _state(v).z[1][0] is None


def test_without_a_cluster_it_shows_a_given_run(cluster4):
    from labkit_widgets.collective_view import CollectiveView

    run = jobs.run(cluster4, "broadcast", "tree", 4, root=1)
    v = CollectiveView(None)
    assert v.recording is None and v.status.value == ""  # nothing ran, nothing claimed
    v.rerun()
    assert "no cluster" in v.status.value and v.recording is None
    v.update(run)
    assert "no cluster" not in v.status.value
    assert v.recording.steps == 2 and [list(r) for r in _state(v).text] == [["10, 11, 12, 13"]] * 4
    v.update(run.recording)
    assert "broadcast" in v.fig.layout.title.text and "CollectiveView(" in repr(v)
    v.rerun()
    assert "no cluster" in v.status.value


def test_bad_choice_is_shown_not_raised(view):
    view.run_kwargs = {"reduce": "avg"}  # avg of the default int64 inputs: refused
    view.rerun()
    assert "floating-point" in view.status.value and "error" in view.status.value
