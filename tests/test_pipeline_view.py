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
    _check_legends_and_labels(v, 8)


def _check_legends_and_labels(v, m):
    """Kinds keyed by pattern on one grey, a colour key per microbatch, the data bars out of
    the legend, labels never rotated (and hidden where they do not fit)."""
    from labkit_widgets.pipeline_view import KIND_SWATCH, N_DATA, PALETTE

    data, keys = v.fig.data[:N_DATA], v.fig.data[N_DATA:]
    assert not any(t.showlegend for t in data)
    assert all(t.textangle == 0 for t in data)
    assert v.fig.layout.uniformtext.mode == "hide"
    kinds = [t for t in keys if t.legend in (None, "legend")]
    assert [t.name for t in kinds] == ["idle", "F forward", "B input-grad", "W weight-grad",
                                       "BW full backward"]
    assert {t.marker.color for t in kinds[1:]} == {KIND_SWATCH}
    assert len({t.marker.pattern.shape for t in kinds[1:]}) == 4  # told apart by pattern
    mbs = [t for t in keys if t.legend == "legend2" and t.visible is not False]
    assert [t.name for t in mbs] == [str(i) for i in range(m)]
    assert [t.marker.color for t in mbs] == PALETTE[:m]


def test_flush_bubbles_and_status_table():
    """Two identical flushes: each flush's bubble is the report's; the status table names
    the three bubbles and the spread."""
    from labkit.parallel.pipeline.bubble import measure_bubble
    from labkit.trace import Event
    from labkit_widgets.pipeline_view import flush_bubbles, status_table

    sched = build("1f1b", 2, 4)
    sim = simulate(sched, {"F": 1.0, "B": 2.0, "W": 0.0}, comm=0.1)
    ev = [Event(sp.rank, sp.action.kind, "compute", sp.start + 100 * st, sp.end + 100 * st,
                step=st, args={"stage": sp.action.stage, "microbatch": sp.action.microbatch,
                               "flush": 0}) for st in (1, 2) for sp in sim.spans]
    rep = measure_bubble(ev, sched)
    assert flush_bubbles(rep) == pytest.approx([sim.bubble, sim.bubble])
    html = status_table(rep, [{"peak_activation_bytes": 2**20, "peak_inflight": 2}] * 2)
    for text in ("measured", "simulated on this machine", "unit costs (lecture)",
                 "2 flushes: 30.0 % – 30.0 %" if round(sim.bubble, 3) == 0.3 else "2 flushes",
                 "1.00 MiB"):
        assert text in html, text
    assert "labkit-status-ok" in html and "#2E7D32" not in html  # not a green wall of text
    assert "idle per rank, ms (mean over 2 flushes)" in html  # not the drawn flush's idle


def test_the_drawn_flush_title_gives_that_flush_length_and_idle():
    """The measured panel draws one flush; its title gives that flush's own length and idle
    per rank (the status table's are means over flushes): checked against the simulator's
    makespan and idle for the same spans."""
    from labkit_widgets.pipeline_view import drawn_flush

    sim = simulate(build("gpipe", 2, 4), {"F": 1.0, "B": 2.0, "W": 0.0}, comm=0.1)
    text = drawn_flush(sim.spans, 2, scale=1.0, unit="units")
    want = ", ".join(f"{i:.1f}" for i in sim.idle)
    assert text == f"one flush: {sim.makespan:.1f} units, idle per rank {want} units"
    # ranks idle for different times: rank 0 loses its first span (makespan − its busy)
    first = min((sp for sp in sim.spans if sp.rank == 0), key=lambda sp: sp.start)
    spans = [sp for sp in sim.spans if sp is not first]
    idle = [sim.makespan - sum(sp.end - sp.start for sp in spans if sp.rank == r)
            for r in (0, 1)]
    assert idle[0] > idle[1]
    assert drawn_flush(spans, 2, scale=1.0, unit="units").endswith(
        f"idle per rank {idle[0]:.1f}, {idle[1]:.1f} units")


@pytest.mark.distributed
def test_real_run_rerun_and_play(cluster4):
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(cluster4, schedule="1f1b", pp=4, microbatches=4)
    assert v.report is not None and "measured" in v.status.value
    assert v.report.flushes == 3 and "3 flushes" in v.status.value  # the spread is shown
    _check_legends_and_labels(v, 4)
    measured = sum(len(v.fig.data[i].x) for i in range(1, 5))
    assert measured == 2 * 4 * 4  # F and BW
    assert len(v.fig.data[0].x) > 0  # idle bubbles drawn
    assert all(" ms, lasts %{x:.2f} ms" in t.hovertemplate for t in v.fig.data[:10])
    v.set(schedule="zb-v", pp=2, microbatches=2)
    assert sum(len(v.fig.data[i].x) for i in range(1, 5)) == 3 * 4 * 2  # 4 stages on 2 ranks
    v.time.value = 10  # the play control drives this slider
    assert sum(len(v.fig.data[i].x) for i in range(1, 5)) < 3 * 4 * 2
    v.set(schedule="gpipe", microbatches=16)  # batch 8 does not split in 16: doubled to 32
    assert v.result.config.global_batch == 32
    _check_legends_and_labels(v, 16)
    bundle = v._repr_mimebundle_()
    assert "application/vnd.plotly.v1+json" in bundle


def test_a_refused_value_goes_back_and_the_title_names_what_is_shown():
    """V=4 on P=4 needs 16 stages of an 8-layer model: refused before running; the slider
    returns to the shown V, and neither the refusal nor a later frame renames the figure."""
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(None, schedule="interleaved", pp=4, microbatches=8, virtual_stages=2)
    assert v.fig.layout.title.text == "interleaved: P=4, M=8, V=2"
    v.controls["virtual_stages"].value = 4
    assert v.controls["virtual_stages"].value == 2
    assert "n_layers=8" in v.status.value and "the figure shows interleaved: P=4, M=8, V=2" \
        in v.status.value
    assert "V=4 refused" in v.status.value and "back on the last valid V=2" in v.status.value
    v.time.value = 10
    assert v.fig.layout.title.text == "interleaved: P=4, M=8, V=2"
    v.set(schedule="1f1b")  # no virtual stages: the title says none
    assert v.fig.layout.title.text == "1f1b: P=4, M=8"
    assert v.controls["virtual_stages"].disabled
    idle = [t for d in v.fig.data for t in (d.text or ()) if str(t).startswith("idle")]
    assert idle and all(t.endswith(" units") for t in idle)  # simulated: unit costs
    from labkit_widgets.pipeline_view import N_DATA
    hovers = {d.hovertemplate for d in v.fig.data[:N_DATA]}  # every bar's times name the unit
    assert hovers == {"%{text}<br>starts at %{base:.2f} units, lasts %{x:.2f} units"
                      "<extra></extra>"}


def test_a_run_far_longer_than_its_simulation_gets_its_own_time_axis():
    """A run stretched by a busy machine (here 15x its simulation) would squeeze the
    simulated panel into a sliver of a shared axis: each panel then has its own axis, fully
    used, and its title says so; comparable lengths share one axis again."""
    from labkit.parallel.pipeline.simulate import Span
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(schedule="1f1b", pp=4, microbatches=4)
    sim = v.sim_spans
    sim_end = max(sp.end for sp in sim)
    for stretch, own in ((15.0, True), (1.2, False)):
        v.spans = [Span(sp.rank, sp.action, sp.start * stretch, sp.end * stretch)
                   for sp in sim]
        v._draw()
        lay = v.fig.layout
        if own:
            assert lay.xaxis.matches is None and lay.xaxis.showticklabels
            assert tuple(lay.xaxis.range) == pytest.approx((0, sim_end * stretch * v._scale))
            assert tuple(lay.xaxis2.range) == pytest.approx((0, sim_end * v._scale))
            assert "(own time axis)" in lay.annotations[0].text
            assert f"one flush: {sim_end * stretch * v._scale:.1f} " \
                in lay.annotations[0].text
            assert "(own time axis)" in lay.annotations[1].text
        else:
            assert lay.xaxis.matches == "x2" and lay.xaxis.showticklabels is False
            assert tuple(lay.xaxis.range) == tuple(lay.xaxis2.range)
            assert "own" not in lay.annotations[1].text


def _from_the_browser(slider, value) -> list:
    """Move ``slider`` as the front end does (it sends the option's index), recording every
    state the kernel sends back: ``[state dict]``."""
    sent = []
    slider.comm.send = lambda data=None, buffers=None, **kw: sent.append(data.get("state", {}))
    slider.set_state({"index": list(slider.options).index(value)})
    return sent


def test_a_refused_m_is_named_beside_the_value_the_slider_went_back_to():
    """DualPipeV refuses M below 2P. Dragging M from 4 to 2 at P=2 runs nothing: the slider
    goes back to 4 in the browser too (the kernel sends the index of 4), and the red line
    names M=2 as refused and M=4 as the value kept, the value the slider reads; the figure
    still shows the run with M=4."""
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(None, schedule="dualpipe-v", pp=2, microbatches=4)
    m = v.controls["microbatches"]
    sent = _from_the_browser(m, 2)
    assert m.value == 4 and sent and sent[-1].get("index") == list(m.options).index(4)
    status = v.status.value
    assert "labkit-status-error" in status
    assert "M=2 refused: dualpipe-v needs microbatches &gt;= 2 x pp = 4" in status
    assert f"the controls are back on the last valid M={m.value} " in status
    assert "(the figure shows dualpipe-v: P=2, M=4, V=2)" in status
    assert v.fig.layout.title.text == "dualpipe-v: P=2, M=4, V=2"
    # a valid value afterwards runs, and the line is no longer red
    _from_the_browser(m, 8)
    assert m.value == 8 and v.fig.layout.title.text == "dualpipe-v: P=2, M=8, V=2"
    assert "labkit-status-error" not in v.status.value


def test_refused_starting_values_stay_on_the_controls():
    """Nothing shown yet: there is no valid value to go back to, so the controls keep the
    refused values, the ones the line names."""
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(None, schedule="dualpipe-v", pp=2, microbatches=2)
    assert v.controls["microbatches"].value == 2 and v.shown is None
    assert "got microbatches=2 with pp=2; nothing is drawn yet" in v.status.value
    assert "back on" not in v.status.value


def test_the_status_says_the_panel_title_is_one_flush_and_the_table_a_mean():
    """The measured panel's title gives the drawn flush's idle, the table the mean over the
    flushes: one line in the table says which is which, with the number of flushes; a
    single flush needs no such line."""
    from labkit.parallel.pipeline.bubble import measure_bubble
    from labkit.trace import Event
    from labkit_widgets.pipeline_view import status_table

    sched = build("1f1b", 2, 4)
    sim = simulate(sched, {"F": 1.0, "B": 2.0, "W": 0.0}, comm=0.1)

    def report(steps):
        ev = [Event(sp.rank, sp.action.kind, "compute", sp.start + 100 * st,
                    sp.end + 100 * st, step=st,
                    args={"stage": sp.action.stage, "microbatch": sp.action.microbatch,
                          "flush": 0}) for st in steps for sp in sim.spans]
        return measure_bubble(ev, sched)

    line = ("the measured panel&#x27;s title is the drawn flush alone (the last); this "
            "table&#x27;s bubble and idle per rank are the mean over the 3 measured flushes, "
            "so the two idles differ by the flushes&#x27; spread")
    assert line in status_table(report((1, 2, 3)))
    assert "drawn flush" not in status_table(report((1,)))


def _drawn_bars(v) -> list:
    """The measured panel's bars: ``[(rank label, action, start, length)]`` in ms, sorted."""
    from labkit_widgets.pipeline_view import KINDS

    return sorted((y, t, b, x) for d in v.fig.data[1:1 + len(KINDS)]
                  for y, t, b, x in zip(d.y, d.text, d.base, d.x))


def _flush_bars(events, step: int, flush: int) -> list:
    """The bars one flush's raw trace events should draw, from the events alone: ms from
    that flush's first start."""
    ev = [e for e in events if e.cat == "compute" and e.step == step
          and e.args.get("flush") == flush]
    t0 = min(e.start for e in ev)
    return sorted((f"rank {e.rank}", f"{e.args['stage']}{e.name}{e.args['microbatch']}",
                   1e3 * (e.start - t0), 1e3 * e.duration) for e in ev)


def _named_flush(title: str) -> tuple:
    """``(step, flush index from 0, flushes, length ms)`` the measured panel's title names."""
    import re

    m = re.search(r"last flush \(step (\d+), flush (\d+) of (\d+)\): "
                  r"([0-9.]+) ms", title)
    assert m, title
    return int(m[1]), int(m[2]) - 1, int(m[3]), float(m[4])


def test_with_several_flushes_per_step_the_title_names_the_flush_drawn():
    """Gradient accumulation across flushes: micro_batch=1, 4 microbatches a step in flushes
    of M=2, so every step runs 2 flushes, each its own length here. The measured panel
    draws the last flush measured (step 2: step 3 ran under the memory tracker) and its
    title names it: the bars are that flush's events, to the microsecond, its length the
    title's; they are not flush 1 of the step, whose bars differ."""
    from types import SimpleNamespace

    from labkit.config import RunConfig
    from labkit.parallel.pipeline.presets import PP_TINY
    from labkit.trace import Event, Trace
    from labkit_widgets.pipeline_view import PipelineView

    cfg = RunConfig(model=PP_TINY, parallel=dict(pp=2), schedule="1f1b", microbatches=2,
                    micro_batch=1, global_batch=4, steps=4)
    cfg.validate(2)
    assert cfg.flushes == 2
    sim = simulate(cfg.build_schedule(), {"F": 1e-3, "B": 2e-3, "W": 0.0}, comm=1e-4)
    ev, t = [], 0.0
    for st in range(4):
        for fl in range(2):
            stretch = 1.0 + 0.25 * (2 * st + fl)  # every flush its own length
            for sp in sim.spans:
                ev.append(Event(sp.rank, sp.action.kind, "compute", t + sp.start * stretch,
                                t + sp.end * stretch, st, args=dict(
                                    stage=sp.action.stage, microbatch=sp.action.microbatch,
                                    flush=fl, **({"instrumented": "memory"} if st == 3
                                                 else {}))))
            t += sim.makespan * stretch + 1e-3
    metrics = [{"p2p_latency_s": 1e-4, "peak_activation_bytes": 1, "peak_inflight": 1}] * 2
    v = PipelineView(None, result=SimpleNamespace(config=cfg, trace=Trace(ev),
                                                  metrics=metrics))
    # the controls read the run shown (V: 1f1b's own, on the disabled slider)
    assert {k: (w.value, w.disabled) for k, w in v.controls.items()} == {
        "schedule": ("1f1b", False), "pp": (2, False), "microbatches": (2, False),
        "virtual_stages": (1, True)}
    title = v.fig.layout.annotations[0].text
    step, flush, flushes, length = _named_flush(title)
    assert (step, flush, flushes) == (2, 1, 2)
    want = _flush_bars(ev, step, flush)
    got = _drawn_bars(v)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    times = lambda bars: [t for *_, b, x in bars for t in (b, x)]  # noqa: E731
    assert times(got) == pytest.approx(times(want), abs=1e-9)
    assert length == pytest.approx(max(b + x for *_, b, x in want), abs=0.05)
    # the case is adversarial: the step's first flush draws other bars
    assert times(_flush_bars(ev, step, 0)) != pytest.approx(times(want), abs=1e-6)


@pytest.mark.distributed
def test_a_real_run_with_two_flushes_a_step_draws_the_flush_its_title_names(cluster2):
    """The same on a run: micro_batch=1 and a batch of 4 at M=2 run 2 flushes a step; the
    bars drawn are the trace's events of the flush the title names, the last measured
    (step 1: step 0 warms up, step 2 runs under the memory tracker)."""
    from labkit.config import RunConfig
    from labkit.parallel.pipeline.presets import PP_TINY
    from labkit_widgets.pipeline_view import PipelineView

    base = RunConfig(model=PP_TINY, steps=3, micro_batch=1, global_batch=4,
                     count_flops=False)
    v = PipelineView(cluster2, schedule="1f1b", pp=2, microbatches=2, config=base)
    assert v.result.config.flushes == 2 and v.report.flushes == 2  # steps 1's two flushes
    step, flush, flushes, length = _named_flush(v.fig.layout.annotations[0].text)
    assert (step, flush, flushes) == (1, 1, 2)
    want = _flush_bars(v.result.trace.events, step, flush)
    got = _drawn_bars(v)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    times = lambda bars: [t for *_, b, x in bars for t in (b, x)]  # noqa: E731
    assert times(got) == pytest.approx(times(want), abs=1e-9)
    assert length == pytest.approx(max(b + x for *_, b, x in want), abs=0.05)


def _state_sent(widget) -> dict:
    """Record the state the kernel sends ``widget``'s front end from now on, merged:
    what the browser shows after the messages."""
    sent: dict = {}
    widget.comm.send = lambda data=None, buffers=None, **kw: sent.update(
        data.get("state", {}))
    return sent


def test_the_disabled_v_slider_reads_the_v_the_schedule_runs():
    """A schedule with its own V disables the V slider: it then reads that V (1 for 1f1b,
    gpipe, zb-h1; 2 for zb-v, dualpipe-v), the V the title names and the run used, in the
    browser too; interleaved brings back the V chosen (4), which the slider then sets."""
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(None, schedule="interleaved", pp=2, microbatches=8, virtual_stages=4)
    slider = v.controls["virtual_stages"]
    assert (slider.value, slider.disabled) == (4, False)
    assert v.fig.layout.title.text == "interleaved: P=2, M=8, V=4"
    browser = _state_sent(slider)
    for schedule, used in (("1f1b", 1), ("zb-v", 2), ("gpipe", 1), ("dualpipe-v", 2),
                           ("zb-h1", 1)):
        _from_the_browser(v.controls["schedule"], schedule)  # the dropdown, in the page
        assert v.shown.schedule == schedule and v.shown.stages_per_rank == used
        assert (slider.value, slider.disabled) == (used, True), schedule
        assert browser["disabled"] and browser["_options_labels"][browser["index"]] \
            == str(used), (schedule, browser)
        assert v.fig.layout.title.text == f"{schedule}: P=2, M=8" + (
            f", V={used}" if used > 1 else "")
    _from_the_browser(v.controls["schedule"], "interleaved")
    assert (slider.value, slider.disabled) == (4, False) and v.shown.stages_per_rank == 4
    assert not browser["disabled"] and browser["_options_labels"][browser["index"]] == "4"
    assert v.fig.layout.title.text == "interleaved: P=2, M=8, V=4"
    _from_the_browser(slider, 2)  # chosen in the page: kept across a fixed-V schedule
    v.set(schedule="zb-v")
    assert (slider.value, slider.disabled) == (2, True)
    v.set(schedule="interleaved")
    assert slider.value == 2 and v.fig.layout.title.text == "interleaved: P=2, M=8, V=2"


def test_a_v_given_beside_a_fixed_v_schedule_waits_for_interleaved():
    """Built (or set) with a V its schedule does not take, the slider reads the schedule's
    own V; the V given is the one interleaved then runs. A V refused there (16 stages of an
    8-layer model) is not brought back by choosing interleaved again."""
    from labkit_widgets.pipeline_view import PipelineView

    v = PipelineView(None, schedule="zb-v", pp=2, microbatches=4, virtual_stages=4)
    slider = v.controls["virtual_stages"]
    assert (slider.value, slider.disabled) == (2, True)
    assert v.fig.layout.title.text == "zb-v: P=2, M=4, V=2"
    v.set(schedule="interleaved")
    assert (slider.value, slider.disabled) == (4, False)
    assert v.fig.layout.title.text == "interleaved: P=2, M=4, V=4"
    v = PipelineView(None, schedule="1f1b", pp=4, microbatches=8, virtual_stages=4)
    v.set(schedule="interleaved")  # P=4 x V=4 = 16 stages: refused
    assert "schedule=interleaved, V=4 refused" in v.status.value
    assert (slider := v.controls["virtual_stages"]).value == 1 and slider.disabled
    assert v.controls["schedule"].value == "1f1b" == v.shown.schedule
    v.set(schedule="interleaved")
    assert (slider.value, slider.disabled) == (2, False)
    assert v.fig.layout.title.text == "interleaved: P=4, M=8, V=2"
    with pytest.raises(ValueError, match=r"virtual_stages=3: the V slider offers \(2, 4\)"):
        v.set(virtual_stages=3)


def _fake_run_view(schedule="dualpipe-v", pp=2, m=4):
    """A view on a made-up two-step run (simulated spans as the trace): a real table."""
    from types import SimpleNamespace

    from labkit.config import RunConfig
    from labkit.parallel.pipeline.presets import PP_TINY
    from labkit.trace import Event, Trace
    from labkit_widgets.pipeline_view import PipelineView

    cfg = RunConfig(model=PP_TINY, parallel=dict(pp=pp), schedule=schedule, microbatches=m,
                    global_batch=m, steps=3)
    cfg.validate(pp)
    sim = simulate(cfg.build_schedule(), {"F": 1e-3, "B": 1e-3, "W": 1e-3}, comm=1e-4)
    ev = [Event(sp.rank, sp.action.kind, "compute", sp.start + st, sp.end + st, st,
                args=dict(stage=sp.action.stage, microbatch=sp.action.microbatch, flush=0))
          for st in (1, 2) for sp in sim.spans]
    metrics = [{"p2p_latency_s": 1e-4, "peak_activation_bytes": 1, "peak_inflight": 1}] * pp
    return PipelineView(None, result=SimpleNamespace(config=cfg, trace=Trace(ev),
                                                     metrics=metrics))


def test_a_refusal_keeps_the_table_of_the_figure_shown():
    """A refused M runs nothing and the figure stays: its table stays too, under the red
    line, the same table as before the refusal (not the refusal alone)."""
    v = _fake_run_view()
    table = v.status.value
    assert "idle per rank, ms" in table and "labkit-status-error" not in table
    title = v.fig.layout.title.text
    sent = _from_the_browser(v.controls["microbatches"], 2)
    assert sent and v.controls["microbatches"].value == 4
    status = v.status.value
    assert "labkit-status-error" in status and "M=2 refused" in status
    assert status.index("M=2 refused") < status.index(table)  # the line, then the table
    assert v.fig.layout.title.text == title and v.table == table


def test_every_bar_and_its_label_stay_inside_the_plot_area():
    """A bar's label is drawn inside the bar, unclipped (cliponaxis off: a label a browser
    draws a little wider than plotly measured keeps its letters), so every bar must lie
    inside its panel's x range: shared axis or own axes, whole flush or mid-play; the BW
    bars' dots are fainter than their legend key's, under a label."""
    from labkit_widgets.pipeline_view import FRAMES, KINDS, N_DATA

    v = _fake_run_view("dualpipe-v", 4, 8)
    assert all(t.cliponaxis is False for t in v.fig.data[:N_DATA])
    per_panel = 1 + len(KINDS)
    meas = list(v.spans)
    for stretch in (1.0, 15.0):  # shared axis; a run far longer than its simulation
        v.spans = [type(sp)(sp.rank, sp.action, sp.start * stretch, sp.end * stretch)
                   for sp in meas]
        for frame in (FRAMES, FRAMES // 3):
            v.time.value = frame
            v._draw()
            lay = v.fig.layout
            for panel, axis in enumerate((lay.xaxis, lay.xaxis2)):
                lo, hi = axis.range
                bars = [(b, b + x) for t in v.fig.data[panel * per_panel:(panel + 1) * per_panel]
                        for b, x in zip(t.base, t.x)]
                assert bars, (stretch, frame, panel)
                assert all(lo - 1e-9 <= a and b <= hi + 1e-9 for a, b in bars), \
                    (stretch, frame, panel, (lo, hi), max(b for _, b in bars))
    bw = [t for t in v.fig.data if t.name == "BW"]
    key = [t for t in v.fig.data if t.name == "BW full backward"]
    assert len(bw) == 2 and len(key) == 1
    assert all(t.marker.pattern.shape == key[0].marker.pattern.shape == "." for t in bw)
    assert all(t.marker.pattern.fgopacity < 0.5 and t.marker.pattern.solidity < 0.3
               for t in bw)  # plotly's defaults, which the key keeps
    assert key[0].marker.pattern.fgopacity is None and key[0].marker.pattern.solidity is None


def _axes(v) -> dict:
    """Both panels' axes as the figure holds them (what a redraw sends to the browser)."""
    lay = v.fig.layout
    return {name: getattr(lay, name).to_plotly_json()
            for name in ("xaxis", "xaxis2", "yaxis", "yaxis2")}


def test_frame_0_keeps_every_rank_row_and_the_axes():
    """Play's stop puts the cursor on frame 0, where no span has started yet: both panels
    keep a row per rank (rank 0 on top) and the full frame's axes, empty, instead of an
    axis read from no data (one centred "rank 0", the others gone)."""
    from labkit_widgets.pipeline_view import FRAMES, KINDS, PipelineView

    for v in (_fake_run_view("dualpipe-v", 4, 8), PipelineView(schedule="1f1b", pp=4)):
        pp = v.shown.parallel.pp
        assert v.time.value == FRAMES
        full = _axes(v)
        v.play.value = 0  # the play control drives the frame slider
        assert v.time.value == 0
        panel = v.fig.data[1 + len(KINDS):2 * (1 + len(KINDS))]  # simulated: always drawn
        assert not any(x for t in panel for x in t.x)  # at frame 0 every bar is empty
        assert _axes(v) == full
        for axis in (v.fig.layout.yaxis, v.fig.layout.yaxis2):
            assert axis.type == "category" and axis.categoryorder == "array"
            assert list(axis.categoryarray) == [f"rank {r}" for r in range(pp)]
            assert tuple(axis.range) == (pp - 0.5, -0.5) and axis.autorange is False


def test_the_measured_time_axis_is_the_same_at_every_frame():
    """The time cursor moves the bars only: at every frame the measured panel's x axis
    (shared with the simulated panel, or its own: ticks, range, matching) and both panels'
    rows are the full frame's."""
    from labkit.parallel.pipeline.simulate import Span
    from labkit_widgets.pipeline_view import FRAMES

    v = _fake_run_view("dualpipe-v", 4, 8)
    meas = list(v.spans)
    for stretch, own in ((1.0, False), (15.0, True)):  # shared axis; own axes
        v.spans = [Span(sp.rank, sp.action, sp.start * stretch, sp.end * stretch)
                   for sp in meas]
        v.time.value = FRAMES
        v._draw()
        full = _axes(v)
        assert (full["xaxis"].get("matches") is None) == own
        assert full["xaxis"]["showticklabels"] is own  # shared: the bottom panel's ticks
        for frame in range(FRAMES + 1):
            v.time.value = frame
            assert _axes(v) == full, (stretch, frame)
