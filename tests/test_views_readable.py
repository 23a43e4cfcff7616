"""TimelineView, CheckpointView and CollectiveView say what they show (headless checks).

The layout in a real browser (no output wider than its cell, no clipped labels) is checked
by tests/browser/test_notebook_layout.py; here, the data and state behind it: the step menu
is never blank, the title's milliseconds are the step's own length, back-to-back calls are
told apart, instrumented steps are marked, the greyed C slider shows the C in use, tick
labels thin out at N = 64, arrows never lie on top of each other, the recursive-doubling
label gives the non-power-of-two rule, and a view follows a cluster that was replaced,
saying "starting ranks…" while it waits.
"""
from __future__ import annotations

import html

import pytest

import labkit
from labkit.trace import Event, Trace, Tracer, use_tracer


def _traces(fig) -> dict:
    return {t.name: t for t in fig.data}


def _stepped_trace(flag_step=None) -> Trace:
    """2 ranks x 3 steps 50 ms apart: a 10 ms forward, then 20 back-to-back all-reduces."""
    ev = []
    for s in range(3):
        for r in range(2):
            b = 0.1 + s * 0.05
            ev.append(Event(r, "forward", "compute", b, b + 0.010, s))
            for k in range(20):
                t = b + 0.010 + k * 0.001
                ev.append(Event(r, "all_reduce", "comm", t, t + 0.001, s, op="all_reduce",
                                bytes_sent=64))
    if flag_step is not None:
        b = 0.1 + flag_step * 0.05
        ev.append(Event(0, "instrumented: memory", "mark", b, b, flag_step,
                        args={"instrumented": "memory"}))
    return Trace(ev)


# --------------------------------------------------------------------------- timeline
def test_step_menu_is_never_blank_and_the_title_gives_the_step_length():
    from labkit_widgets import TimelineView

    tv = TimelineView(_stepped_trace())
    sel = tv.step_selector
    assert sel.index == 0 and sel.label == "all steps" and tv.step is None
    assert sel.tooltip  # a real tooltip, never the string "null"
    tv.step = 2
    assert sel.label == "step 2"
    title = tv.fig.layout.title.text
    # step 2 runs from 100 to 130 ms after the first event: 30 ms long, not "130 ms"
    assert title.startswith("step 2: 30.0 ms long (from 100.0 ms)"), title
    assert tuple(tv.fig.layout.xaxis.range) == pytest.approx((99.4, 130.6))
    tv.update(_stepped_trace())  # a re-run keeps the chosen step
    assert tv.step == 2 and sel.label == "step 2"
    tv.step = None
    assert sel.index == 0 and tv.fig.layout.xaxis.autorange
    assert " spans on 2 ranks" in tv.fig.layout.title.text
    one = Trace([e for e in _stepped_trace().events if e.rank == 0 and e.step == 1])
    assert TimelineView(one).fig.layout.title.text.startswith("1 step: 30.0 ms, 21 spans on "
                                                              "1 rank")


def test_twenty_back_to_back_all_reduces_alternate_in_shade():
    from labkit_widgets import TimelineView

    ar = _traces(TimelineView(_stepped_trace()).fig)["all-reduce"]
    calls = sorted(zip(ar.y, ar.base, ar.marker.opacity))
    for lane in {y for y, _, _ in calls}:
        shades = [o for y, _, o in calls if y == lane]
        assert len(shades) == 60
        assert all(a != b for a, b in zip(shades, shades[1:])), "neighbours look the same"


def _in_flight_trace() -> Trace:
    """Rank 0's bucketed step: 20 all-reduces issued 1 ms apart during a 30 ms backward,
    finished by the backend 2 ms apart (``done``), all collected from 40 ms (``waited``),
    each wait() returning at its finish or at once; and a pipeline send issued at 0 ms,
    waited for at 45 ms, returning at 46 ms (gloo reports no completion for send/recv)."""
    ev = [Event(0, "backward", "compute", 0.0, 0.030, 0)]
    for k in range(20):
        done, waited = 0.005 + 0.002 * k, 0.040 + 0.0001 * k
        ev.append(Event(0, "all_reduce", "comm", 0.001 * k, max(done, waited) + 1e-5, 0,
                        op="all_reduce", bytes_sent=64, peers=(0, 1),
                        args={"async": True, "done": done, "waited": waited}))
    ev.append(Event(0, "send", "p2p", 0.0, 0.046, 0, op="send", bytes_sent=64, axis="pp",
                    peers=(1,), args={"async": True, "waited": 0.045}))
    return Trace(ev)


def test_calls_left_in_flight_draw_one_bar_each_and_the_waits_apart():
    """Twenty overlapping bucket all-reduces: one bar each, none overlapping, each ending
    where the backend finished it, with the whole issue..wait() span a faint line behind;
    a send collected at the end of the flush: a hatched bar for the part its caller
    waited, not one solid bar over the step; every bar's hover gives issue, finish, wait."""
    from labkit_widgets.timeline import _FAMILIES, timeline_traces

    tr = _in_flight_trace()
    cols, _layout = timeline_traces(tr, step=0)
    by = {fam: c for (_k, fam), c in zip(_FAMILIES, cols)}
    ar, p2p, line = by["all_reduce"], by["p2p"], by["in flight"]
    bars = sorted(zip(ar["base"], ar["x"]))
    assert len(bars) == 20
    assert all(b0 + x0 <= b1 + 1e-9 for (b0, x0), (b1, _) in zip(bars, bars[1:]))
    calls = sorted((e for e in tr.events if e.op == "all_reduce"), key=lambda e: e.start)
    assert [b + x for b, x in bars] == pytest.approx([1e3 * e.args["done"] for e in calls])
    assert set(ar["marker.pattern.shape"]) == {""}  # a measured finish: not hatched
    (b,), (x,) = p2p["base"], p2p["x"]
    assert (b, b + x) == pytest.approx((45.0, 46.0))
    assert p2p["marker.pattern.shape"] == ["/"]
    assert "the caller waited" in p2p["hovertext"][0]
    # the recorded spans, issue to wait(), stay drawn: a faint line per call
    got = [v for bx in sorted(zip(line["base"], line["x"])) for v in bx]
    want = [v for bx in sorted((1e3 * e.start, 1e3 * e.duration)
                               for e in tr.events if e.cat != "compute") for v in bx]
    assert got == pytest.approx(want)
    for text in ar["hovertext"] + p2p["hovertext"] + line["hovertext"]:
        assert "issued " in text and "waited for from " in text and "wait() returned" in text
    assert all("finished " in t for t in ar["hovertext"])


@pytest.mark.parametrize("impl", ["labkit", "torch"])
def test_in_flight_bars_lie_between_issue_and_completion_on_a_real_ddp_trace(cluster2, impl):
    """2-rank bucketed DDP (labkit's: waited handles; torch's: a comm hook closes each call
    from the future's callback): every call left in flight is drawn from no earlier than
    its issue to no later than the backend's completion (``done``, when it has one) and the
    return of its wait; all steps and each step alone (a step's lanes are split anew)."""
    from labkit import jobs
    from labkit.config import RunConfig
    from labkit_widgets.timeline import _drawn_spans

    cfg = RunConfig(steps=2, global_batch=8, measure_memory=False, count_flops=False,
                    bucket_mb=0.01).replace(dp=2, impl=impl)
    tr = cluster2.run(jobs.train, cfg).trace
    calls = [e for e in tr.events if (e.args or {}).get("async")]
    left = {id(e) for e in calls}
    assert {e.rank for e in calls if e.args.get("done") is not None} == {0, 1}
    assert len([e for e in calls if e.rank == 0 and e.step == 1]) > 3  # several buckets
    for events in [tr.events] + [tr.filter(step=s) for s in (0, 1)]:
        drawn = _drawn_spans(tr, events)
        for e in (e for e in events if id(e) in left):
            lo, hi, how = drawn[id(e)]
            done = e.args.get("done")
            assert how == ("done" if done is not None else "waited")
            last = e.end if done is None else min(done, e.end)
            assert e.start <= lo <= hi <= last, (impl, e, lo, hi)


def test_instrumented_step_is_shaded_named_and_not_drawn_as_a_bar():
    from labkit_widgets import TimelineView

    tv = TimelineView(_stepped_trace(flag_step=2))
    labels = [label for label, _ in tv.step_selector.options]
    assert labels == ["all steps", "step 0", "step 1", "step 2 (memory-tracked)"]
    (shade,) = tv.fig.layout.shapes
    assert (shade.x0, shade.x1) == pytest.approx((100.0, 130.0))
    assert "memory-tracked" in tv.fig.layout.annotations[0].text
    assert "memory-tracked" in tv.fig.layout.title.text
    assert sum(len(d.x) for d in tv.fig.data) == 2 * 3 * 21  # the mark is not a bar
    tv.step = 1
    assert not tv.fig.layout.shapes and "memory" not in tv.fig.layout.title.text
    tv.step = 2
    assert len(tv.fig.layout.shapes) == 1 and "not a step time" in tv.fig.layout.title.text


def test_the_memory_tracker_flags_the_step_it_measures():
    """The job side: measure_memory flags its step, whatever job calls it."""
    import torch

    from labkit.measure.memory import measure_memory

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = Tracer(0)
    with use_tracer(tracer):
        for s in range(3):
            tracer.step = s
            with tracer.region("forward"):
                loss = model(torch.ones(2, 4)).sum()
            if s == 2:
                measure_memory(lambda: (loss.backward(), opt.step()), model, opt)
    assert Trace(tracer.events).instrumented_steps() == {2: "memory"}


def test_legend_fits_the_figure_height():
    from labkit_widgets.timeline import _legend_height, timeline_traces

    ev = [Event(0, n, "compute", 0.0, 0.001, 0) for n in ("forward", "backward",
                                                           "optimizer", "data")]
    ev += [Event(0, op, "comm", 0.0, 0.001, 0, op=op)
           for op in ("all_reduce", "all_gather", "reduce_scatter", "send", "broadcast")]
    ev.append(Event(0, "wait", "wait", 0.0, 0.001, 0))
    cols, layout = timeline_traces(Trace(ev))
    legend = _legend_height(cols)
    assert legend >= 19 * 10 + 30 * 2
    margins = 64 + 40  # top + bottom of _base_layout
    assert layout["height"] - margins >= legend  # the plot area holds the legend


# --------------------------------------------------------------------------- checkpoint
def test_greyed_c_slider_shows_the_c_the_status_names():
    from labkit_widgets import CheckpointView

    view = CheckpointView(n_layers=8, strategy="every", every=2)
    c = view.controls["every"]
    assert not c.disabled and c.value == 2
    for strategy, n, want in (("sqrt", 8, 3), ("full", 64, 64), ("sqrt", 64, 8)):
        view.set(strategy=strategy, n_layers=n)
        text = html.unescape(view.status.value)
        assert c.disabled and c.value == want and f"C={want}" in text, (strategy, n, text)
    view.set(strategy="every", n_layers=8)  # the C you chose comes back
    assert not c.disabled and c.value == 2 and "C=2" in html.unescape(view.status.value)
    assert all(w.tooltip for w in view.controls.values())


def test_chain_tick_labels_thin_out_at_n_64():
    from labkit_widgets import CheckpointView

    view = CheckpointView(n_layers=8, strategy="sqrt")
    assert view.fig.layout.xaxis.dtick == 1
    view.set(n_layers=64)
    ax = view.fig.layout.xaxis
    labels = int((ax.range[1] - max(ax.range[0], 0)) // ax.dtick) + 1
    assert labels <= 17, labels
    assert view.fig.data[0].marker.size * 65 <= 600  # squares fit side by side


def test_dense_actions_are_stems_not_markers_that_hide_each_other():
    """At N = 64 (full) the actions lie under 4 px apart on the action axis: a marker per
    action would sit on its neighbour's (backward's on recompute's); each action is then a
    stem from 0 to its stored units, its kind's colour, with its units on hover."""
    from labkit_widgets import CheckpointView
    from labkit_widgets.checkpoint_view import DENSE_ACTIONS, OP_COLORS

    view = CheckpointView(n_layers=8, strategy="full")
    ops = view.fig.data[3:3 + len(OP_COLORS)]
    assert {d.mode for d in ops} == {"markers"}
    view.set(n_layers=64)
    steps = view.result.steps
    assert len(steps) > DENSE_ACTIONS and {d.mode for d in ops} == {"lines"}
    units = [s.bytes // view.result.unit_bytes for s in steps]
    for d, (op, color) in zip(ops, OP_COLORS.items()):
        assert d.line.color == color and d.name == op
        xs, ys = list(d.x), list(d.y)
        for j in range(0, len(xs), 3):  # (k, 0) → (k, units of action k), then a break
            assert xs[j] == xs[j + 1] and ys[j] == 0 and ys[j + 1] == units[xs[j]]
            assert xs[j + 2] is None and d.text[j + 1].endswith(f", {units[xs[j]]}")
    assert sum(len(d.x) for d in ops) == 3 * len(steps)  # every action, once


def test_two_views_keep_their_own_strategy():
    from labkit_widgets import CheckpointView

    full, sqrt = CheckpointView(n_layers=8, strategy="full"), CheckpointView(n_layers=8,
                                                                             strategy="sqrt")
    assert full.result.schedule.strategy == "full" and sqrt.result.schedule.strategy == "sqrt"


# --------------------------------------------------------------------------- collectives
def test_arrow_lanes_separate_overlapping_vertical_arrows():
    from labkit_widgets.collective_view import arrow_offsets

    # broadcast round 2 on 4 ranks, one chunk column: 0->2 and 1->3 overlap on rows 1-2
    dx = arrow_offsets([(5, 0, 5, 2), (5, 1, 5, 3)])
    assert dx[0] != dx[1]
    # an exchange: both directions on the same rows
    dx = arrow_offsets([(5, 0, 5, 1), (5, 1, 5, 0), (5, 2, 5, 3), (5, 3, 5, 2)])
    assert dx[0] != dx[1] and dx[2] != dx[3]
    # disjoint spans share the centre; arrows between columns are left alone
    assert arrow_offsets([(5, 0, 5, 1), (5, 2, 5, 3)]) == [0.0, 0.0]
    assert arrow_offsets([(1, 0, 6, 1), (2, 1, 7, 0)]) == [0.0, 0.0]


def _segments(frame) -> list:
    return [(a["ax"], a["ay"], a["x"], a["y"]) for a in frame["annotations"]
            if a.get("showarrow")]


def _overlapping(segs) -> list:
    bad = []
    for i, (ax, ay, x, y) in enumerate(segs):
        for bx, by, x2, y2 in segs[i + 1:]:
            if ax == x and bx == x2 and abs(ax - bx) < 1e-9:
                lo1, hi1 = sorted((ay, y))
                lo2, hi2 = sorted((by, y2))
                if min(hi1, hi2) > max(lo1, lo2):
                    bad.append(((ax, ay, x, y), (bx, by, x2, y2)))
    return bad


@pytest.mark.distributed
def test_recorded_single_column_arrows_do_not_overlap(cluster4):
    from labkit.collectives import jobs
    from labkit_widgets.collective_view import collective_frame

    for op, algo in (("broadcast", "tree"), ("all_reduce", "recursive_doubling")):
        rec = jobs.run(cluster4, op, algo, 4).recording
        for step in range(1, rec.steps + 1):
            segs = _segments(collective_frame(rec, step))
            assert segs and not _overlapping(segs), (op, step, segs)


def test_recursive_doubling_label_at_non_power_of_two():
    from labkit.collectives import formula_bytes, formula_text

    assert formula_text("all_reduce", "recursive_doubling", 4) == "log2(N)·S"
    three = formula_text("all_reduce", "recursive_doubling", 3)
    assert "log2(N)·S" not in three and "p=2" in three and "ranks 0–1" in three
    assert [formula_bytes("all_reduce", 3, 24, "recursive_doubling", r)[0]
            for r in range(3)] == [24, 48, 24]  # even S, odd (log2 p + 1)·S, the rest log2 p·S


@pytest.mark.distributed
@pytest.mark.slow
def test_collective_view_follows_a_replaced_cluster_and_says_starting():
    from labkit_widgets import CollectiveView
    from labkit_widgets._pool import STARTING

    a = labkit.Cluster(2, threads_per_rank=1)
    b = None
    try:
        seen: list = []
        view = CollectiveView(a, op="all_reduce", algorithm="recursive_doubling")
        view.status.observe(lambda ch: seen.append(html.unescape(ch["new"])), "value")
        view.set(n=2)  # warm now
        assert not any(STARTING in s for s in seen), seen
        assert "N=2" in seen[-1] and "log2(N)·S" in seen[-1]
        b = labkit.Cluster(2, threads_per_rank=1)  # the notebook's cluster cell, re-run
        seen.clear()
        view.set(op="all_gather")
        assert any(STARTING in s for s in seen), seen  # a cold pool: the click says so
        assert "following the newer cluster" in seen[-1] and "= formula" in seen[-1]
        assert view.result.config.op == "all_gather" and a.replaced and not a.pids
        assert b.state == "warm"  # the view's run started b's ranks
        seen.clear()
        view.rerun()
        assert not any(STARTING in s for s in seen) and "= formula" in seen[-1]
    finally:
        for c in (a, b):
            if c is not None:
                c.close()


# --------------------------------------------------------------------------- tooltips
def _described(widget) -> list:
    """Every control under ``widget`` that shows a description label (a Play button has
    a description but shows no label)."""
    import ipywidgets as W
    from ipywidgets.widgets.widget_description import DescriptionWidget

    out, stack = [], [widget]
    while stack:
        w = stack.pop()
        stack.extend(getattr(w, "children", ()) or ())
        if isinstance(w, DescriptionWidget) and not isinstance(w, W.Play) and w.description:
            out.append(w)
    return out


def test_every_described_control_has_a_tooltip():
    """ipywidgets 8.1 writes the tooltip into the label's ``title``: a control without one
    shows a "null" tooltip on hover (the browser layout test found them)."""
    from labkit_widgets import (CheckpointView, CollectiveView, ContextParallelView,
                                ExpertView, PipelineView, TimelineView)

    views = [CheckpointView(n_layers=4), CollectiveView(run=False),
             ContextParallelView(run=False), ExpertView(), PipelineView(), TimelineView()]
    for view in views:
        controls = _described(view)
        assert controls, type(view).__name__
        missing = [w.description for w in controls if not w.tooltip]
        assert not missing, f"{type(view).__name__}: {missing}"
