"""Widgets, headless: TimelineView on real cluster traces; the Explorer driven by ``set()``
and by its controls' observe path.

The Explorer is tested against a fake cluster whose results follow the training job's
per-rank schema (:func:`fake_train_output`), so the widget logic (controls → config,
validate's reasons, one batch per run, history, memory reuse, the cluster hooks) is
checked without training; and against the real ``labkit.jobs.train`` on a 2-rank cluster.
"""
from __future__ import annotations

import html
import json
import time
import os
import re

import ipywidgets as W
import plotly.graph_objects as go
import plotly.io as pio
import pytest
import torch

import labkit
from labkit import comm, jobs
from labkit.cluster import RunResult
from labkit.config import RunConfig
from labkit.trace import Event, Trace

# plotly is imported inside the tests: rank processes import this module to find
# stepped_job, and should not pay for plotly there.


# --------------------------------------------------------------------------- helpers
def stepped_job(ctx, steps=3) -> int:
    """A real traced job with compute regions and a gradient all-reduce per step."""
    x = torch.randn(64, 64, device=ctx.device)
    for s in range(steps or 3):
        ctx.tracer.step = s
        with ctx.tracer.region("forward"):
            y = x @ x
        with ctx.tracer.region("backward"):
            g = y @ x
        comm.all_reduce(g, group=ctx.group, axis="dp")
        with ctx.tracer.region("optimizer"):
            x = x - 1e-3 * g
    return steps


def fake_train_output(cfg: RunConfig, rank: int) -> dict:
    """One rank's ``jobs.train`` return value, in the schema ``labkit.train.run`` returns
    (data parallelism only: the fake does not pipeline)."""
    n_params, dp, micro = 100_000, cfg.parallel.dp, cfg.micro
    k = dp if cfg.zero_stage else 1
    state = {"parameters": 4 * n_params // (k if cfg.zero_stage == 3 else 1),
             "gradients": 4 * n_params // (k if cfg.zero_stage >= 2 else 1),
             "optimizer": 8 * n_params // k}
    peak = {**state, "gradients": 0, "activations": 30_000 * micro, "other": 1_000}
    sent = 2 * (dp - 1) / dp * 4 * n_params
    by_axis = {"dp": {"all_reduce": sent}} if dp > 1 else {}
    step_s = 0.02 * cfg.accum_steps + 0.001 * (dp - 1)
    flops = 6.0 * n_params * cfg.local_batch * 64
    out = {"losses": [4.0 - 0.1 * s for s in range(cfg.steps)],
           "metrics": {
               "rank": rank, "dp": dp, "pp": 1, "zero_stage": cfg.zero_stage,
               "micro_batch": micro, "accum_steps": cfg.accum_steps, "n_params": n_params,
               "step_time_s": step_s, "step_times": [step_s] * (cfg.steps - 1),
               "memory_predicted": {**state, "total": sum(state.values())},
               "flops_per_step": flops, "peak_flops": 1e11, "mfu": flops / 1e11 / step_s,
               "hfu": flops / 1e11 / step_s * (1.3 if cfg.checkpoint != "none" else 1.0),
               "comm_bytes_by_axis": by_axis, "comm_predicted_by_axis": by_axis,
               "comm_bytes_per_step": sent, "comm_bytes_predicted": sent}}
    if cfg.measure_memory:
        out["metrics"]["memory"] = {"peak": peak, "peak_total": sum(peak.values()),
                                    "model_state": state, "working_set": {}}
    return out


class FakeCluster:
    """``world_size`` + ``run(job, cfg)`` like a Cluster, answering from the schema."""

    world_size = 2

    def __init__(self, on_run=None, world_size=None):
        self.configs, self.on_run = [], on_run
        if world_size is not None:
            self.world_size = world_size

    def run(self, job, cfg):
        cfg.validate(self.world_size)
        if self.on_run:
            self.on_run(cfg)
        self.configs.append(cfg)
        dp = cfg.parallel.dp
        events = [Event(r, n, "compute", s + i * 0.01, s + i * 0.01 + 0.004, s)
                  for r in range(dp) for s in range(cfg.steps)
                  for i, n in enumerate(("forward", "backward", "optimizer"))]
        return RunResult(cfg, [fake_train_output(cfg, r) for r in range(dp)], Trace(events),
                         0.01, "fake")


def _text(widget_html: str) -> str:
    return html.unescape(widget_html)


def _traces(fig) -> dict:
    return {t.name: t for t in fig.data}


@pytest.fixture(scope="module")
def cluster():
    c = labkit.Cluster(2, threads_per_rank=1)
    yield c
    c.close()


# --------------------------------------------------------------------------- timeline
def test_timeline_real_all_reduce(cluster):
    from labkit_widgets import TimelineView

    tv = TimelineView(cluster.run(jobs.all_reduce_demo))
    ar = _traces(tv.fig)["all-reduce"]
    assert len(ar.x) == 2 and all(d >= 0 for d in ar.x)
    assert sorted(c[7] for c in ar.customdata) == [0, 1]
    assert ar.customdata[0][3] == "16 B"  # 2(N-1)/N · 16 B sent
    assert list(tv.fig.layout.yaxis.ticktext) == ["rank 0", "comm", "rank 1", "comm"]
    fig = tv.figure()
    assert type(fig) is go.Figure and len(fig.data) == len(tv.fig.data)


def test_timeline_compute_comm_and_step_filter(cluster):
    from labkit_widgets import TimelineView
    from labkit_widgets.timeline import COMM_OFFSET

    tv = TimelineView(cluster.run(stepped_job, 3))
    t = _traces(tv.fig)
    for name in ("forward", "backward", "optimizer"):
        assert len(t[name].x) == 6  # 3 steps x 2 ranks
    assert len(t["all-reduce"].x) == 6
    assert sorted(t["all-reduce"].y) == pytest.approx([COMM_OFFSET] * 3 + [1 + COMM_OFFSET] * 3)
    assert {y for y in t["forward"].y} == {0, 1}
    assert [v for _, v in tv.step_selector.options] == ["all", 0, 1, 2]
    all_x = list(t["backward"].x)
    tv.step_selector.value = 1  # the observe path
    t = _traces(tv.fig)
    assert len(t["backward"].x) == 2 and {c[1] for c in t["backward"].customdata} == {1}
    assert list(t["backward"].x) != all_x and "step 1" in tv.fig.layout.title.text
    tv.update(Trace())  # an empty run: no crash, selector back to all steps
    assert tv.step is None and sum(len(d.x) for d in tv.fig.data) == 0
    assert tv.fig.layout.title.text == "no events recorded"


def test_timeline_many_events_few_traces():
    from labkit_widgets import TimelineView

    events = [Event(r, n, "compute" if n != "all_reduce" else "comm", s * 1e-3 + i * 1e-4,
                    s * 1e-3 + (i + 1) * 1e-4, s, op="all_reduce" if n == "all_reduce" else None)
              for r in range(4) for s in range(250)
              for i, n in enumerate(("forward", "backward", "all_reduce", "optimizer", "data"))]
    tv = TimelineView(Trace(events))
    assert len(tv.fig.data) == 14  # fixed families, not one trace per event
    assert sum(len(d.x) for d in tv.fig.data) == len(events) == 5000
    assert "application/vnd.plotly.v1+json" in tv._repr_mimebundle_()


def test_timeline_blocked_waits_have_their_own_family():
    """FSDP's "wait" events (the compute thread blocked on an all-gather) are "blocked",
    on the compute row, not grey "other" on the comm lane."""
    from labkit_widgets import TimelineView

    events = [Event(0, "forward", "compute", 0.0, 0.010, 0),
              Event(0, "all_gather", "comm", 0.001, 0.004, 0, op="all_gather", bytes_sent=64),
              Event(0, "wait all_gather", "wait", 0.002, 0.004, 0,
                    args={"unit": "layers.0", "phase": "forward"})]
    t = _traces(TimelineView(Trace(events)).fig)
    blocked = t["blocked"]
    assert list(blocked.y) == [0.0] and blocked.x[0] == pytest.approx(2.0)
    assert blocked.showlegend and blocked.legendgroup == "compute"
    assert (blocked.customdata[0][2], blocked.customdata[0][8]) == ("layers.0", "forward")
    comm_other = [d for d in TimelineView(Trace(events)).fig.data if d.name == "other"][-1]
    assert len(comm_other.x) == 0 and len(t["all-gather"].x) == 1


def test_timeline_labels_tagged_collectives_by_layer():
    """A collective tagged with its layer (tensor parallelism) is labelled L<layer> on its
    bar and names layer, site and phase on hover; a site outside the blocks is labelled by
    its first word; an untagged call gets no label. Re-drawing one step swaps the labels."""
    from labkit_widgets import TimelineView

    def ar(t, step, **args):
        return Event(0, "all_reduce", "comm", t, t + 1e-3, step, op="all_reduce", axis="tp",
                     bytes_sent=64, args=args)

    events = [ar(0.000, 0, site="emb_out", phase="forward"),
              ar(0.002, 0, layer=0, site="attn_out", phase="forward"),
              ar(0.004, 0, layer=0, site="mlp_out", phase="forward"),
              ar(0.006, 1, layer=1, site="mlp_in", phase="backward"),
              ar(0.008, 1)]
    tv = TimelineView(Trace(events))
    bars = _traces(tv.fig)["all-reduce"]
    got = sorted(zip(bars.base, bars.text, bars.hovertext))
    assert [(t, h) for _, t, h in got] == [
        ("emb", "<br>emb_out · forward"), ("L0", "<br>layer 0 · attn_out · forward"),
        ("L0", "<br>layer 0 · mlp_out · forward"), ("L1", "<br>layer 1 · mlp_in · backward"),
        ("", "")]
    assert "%{hovertext}" in bars.hovertemplate
    tv.step = 1
    bars = _traces(tv.fig)["all-reduce"]
    assert sorted(bars.text) == ["", "L1"] and len(bars.hovertext) == 2


# --------------------------------------------------------------------------- explorer
def _plain(widget_html: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", widget_html))).strip()


def _data(fig) -> str:
    """Everything a figure shows (data and layout), as one comparable string."""
    return fig.to_json()


def _explorer(cluster=None, base=None, **kw):
    from labkit_widgets import Explorer

    return Explorer(cluster or FakeCluster(), base or RunConfig(global_batch=8, steps=3),
                    **{"run_now": False, **kw})


def test_explorer_defaults_to_the_whole_cluster():
    """Without a base config the explorer's dp is the cluster's world size (the batch of 8
    splits over it), so `Explorer(cluster)` uses every rank."""
    from labkit_widgets import Explorer

    for ws, dp in ((2, 2), (4, 4), (3, 1), (6, 2)):
        ex = Explorer(FakeCluster(world_size=ws), run_now=False, timeline=False)
        assert ex.base.parallel.dp == dp and ex.controls["dp"].value == dp, (ws, dp)


#: for each control: a non-default value, where it applies and where it does not (None:
#: it always applies)
MAPPING = {"model": ("tiny-moe", {}, None), "dp": (2, {}, None), "micro_batch": (2, {}, None),
           "zero_stage": (3, {"dp": 2}, None),
           "hsdp_replicas": (2, {"dp": 2, "zero_stage": 1}, {"zero_stage": 0}),
           "prefetch": (False, {"dp": 2, "zero_stage": 3}, {"zero_stage": 2}),
           "dp_mode": ("naive", {"dp": 2}, {"zero_stage": 1}),
           "bucket_mb": (0.01, {"dp": 2}, {"dp_mode": "naive"}), "pp": (2, {"dp": 1}, None),
           "schedule": ("gpipe", {"pp": 2, "dp": 1}, {"pp": 1}),
           "microbatches": (2, {"pp": 2, "dp": 1}, {"pp": 1}),
           "virtual_stages": (1, {"pp": 2, "dp": 1}, {"pp": 1}),
           "checkpoint": ("full", {}, None), "precision": ("bf16", {}, None),
           "tp": (2, {}, None), "sequence_parallel": (True, {"tp": 2}, {"tp": 1}),
           "cp": (2, {}, None), "cp_method": ("ulysses", {"cp": 2}, {"cp": 1}),
           "cp_zigzag": (False, {"cp": 2}, {"cp": 1}), "ep": (2, {"dp": 2}, None)}


def _field(cfg, name):
    return getattr(cfg.parallel if name in ("dp", "tp", "pp", "cp", "ep") else cfg, name)


def test_every_control_maps_to_its_config_field():
    """Each control sets its RunConfig field (degrees into parallel, "auto" = None) where it
    applies, and leaves the field at its default where validate would call it ignored."""
    from labkit_widgets.explorer_controls import DEFAULTS
    from labkit_widgets.explorer_controls import NAMES

    ex = _explorer(base=RunConfig(global_batch=8, steps=3).replace(dp=2))
    assert set(ex.controls) == set(NAMES) == set(MAPPING)
    for name, (value, where, elsewhere) in MAPPING.items():
        cfg = ex.config(**where, **{name: value})
        assert _field(cfg, name) == value, (name, _field(cfg, name))
        if elsewhere is not None:  # where the knob does not apply its field stays default
            off = ex.config(**{**where, **elsewhere}, **{name: value})
            assert _field(off, name) == _field(DEFAULTS, name), name
    assert ex.config(micro_batch=None).micro_batch is None
    assert ex.config(pp=2, dp=1, microbatches=None).microbatches is None
    # the available ones, through set() on the fake cluster (the observe path's twin)
    fake = FakeCluster()
    ex = _explorer(fake, base=RunConfig(global_batch=8, steps=3).replace(dp=2))
    for name in ("micro_batch", "zero_stage", "dp_mode", "bucket_mb", "checkpoint",
                 "precision"):
        value, where, _ = MAPPING[name]
        assert ex.set(**where, **{name: value}) is not None, (name, ex.last_error)
        assert _field(fake.configs[-1], name) == value and ex.controls[name].value == value
        ex.set(**{name: _field(RunConfig(), name) if name != "micro_batch" else None})
    ex.set(zero_stage=1, hsdp_replicas=2)
    assert fake.configs[-1].hsdp_replicas == 2
    ex.set(zero_stage=3, hsdp_replicas=1, prefetch=False)
    assert (fake.configs[-1].zero_stage, fake.configs[-1].prefetch) == (3, False)


def test_applies_mirrors_validate():
    """A knob is greyed exactly where validate refuses a non-default value of it as having
    "no effect here" (labkit.validate's composition rules), over a grid of contexts."""
    from itertools import product

    from labkit_widgets import explorer_controls as C

    rules = [n for n in C.NAMES if n in C._APPLIES]
    for name, pp, zero, mode, other in product(rules, (1, 2), (0, 1, 2, 3), ("ddp", "naive"),
                                               (1, 2)):
        # tp / cp > 1 are refused before the composition rules: vary them for their knobs
        tp = other if name == "sequence_parallel" else 1
        cp = other if name in ("cp_method", "cp_zigzag") else 1
        vals = {**C.initial_values(RunConfig()), "dp": 2, "pp": pp, "zero_stage": zero,
                "dp_mode": mode if zero == 0 else "ddp", "tp": tp, "cp": cp}
        alt = next(v for v in C.BY_NAME[name].values(8, RunConfig())
                   if C.to_field(name, v) != getattr(RunConfig(), name))
        cfg = C.compose(RunConfig(), vals)[0]
        try:
            cfg.replace(**{name: C.to_field(name, alt)}).validate()
            ignored = False
        except ValueError as exc:
            ignored = str(exc).startswith(f"{name}=") and "has no effect here" in str(exc)
        assert ignored == (not C.applies(name, vals)), (name, vals)


def test_only_values_validate_accepts_are_offered_and_the_rest_say_why():
    from labkit_widgets import explorer_controls as C

    ex = _explorer(FakeCluster(world_size=4), RunConfig(global_batch=8).replace(dp=4))
    c = ex.controls
    assert [v for _, v in c["pp"].options] == [1] and c["pp"].disabled
    assert [v for _, v in c["dp"].options] == [1, 2, 4]  # dp=3 does not split the batch
    note = _plain(ex.unavailable.value)
    for refused in (RunConfig(global_batch=8).replace(dp=4, pp=2),
                    RunConfig(global_batch=8).replace(dp=3),
                    RunConfig(global_batch=8).replace(dp=4, micro_batch=4)):
        with pytest.raises(ValueError) as why:
            refused.validate(4)
        assert str(why.value) in note, str(why.value)
    assert "pp=2" in note and "8 ranks" in note and "world_size=4" in note
    # tensor, context and expert degrees are offered where the model and mesh allow them
    # and refused in validate's words where not (the tiny GPT is dense: no ep)
    assert [v for _, v in c["tp"].options] == [1] and "ep=2 needs a mixture-of-experts" in note
    assert "prefetch" in note and "ZeRO-3" in note  # greyed, in validate's words
    assert c["prefetch"].disabled and c["schedule"].disabled
    ex.set(dp=2)
    assert [v for _, v in c["pp"].options] == [1, 2] and not c["pp"].disabled
    assert [v for _, v in c["tp"].options] == [1, 2] and [v for _, v in c["cp"].options] == [1, 2]
    # everything offered validates (changing that control alone); nothing else is offered
    for vals in (ex.values, {**ex.values, "pp": 2}, {**ex.values, "zero_stage": 3}):
        avail = C.availability(ex.base, vals, 4)
        for name, a in avail.items():
            for v in a["offer"]:
                assert C.check(C.compose(ex.base, {**vals, name: v})[0], 4) is None, (name, v)
            for v, why in a["refused"].items():
                assert why == C.check(C.compose(ex.base, {**vals, name: v})[0], 4)


def test_invalid_set_shows_the_reason_and_raises_nothing():
    ex = _explorer(FakeCluster(world_size=4), RunConfig(global_batch=8).replace(dp=4),
                   run_now=True)
    assert len(ex.history) == 1
    before = dict(ex.values)
    for bad, words in (({"dp": 3}, "global_batch=8 is not divisible by dp=3"),
                       ({"micro_batch": 3}, "micro_batch"),
                       ({"dp_mode": "zero9"}, "dp_mode must be one of"),
                       ({"global_batch": 3}, "global_batch=3"),
                       ({"pp": 2}, "= 8 ranks but the cluster has world_size=4"),
                       ({"tp": 3, "dp": 1}, "n_heads=4 does not divide by tp=3"),
                       ({"ep": 2}, "ep=2 needs a mixture-of-experts model"),
                       ({"zero_stage": 4}, "got 4"),
                       ({"zero_stage": 1, "hsdp_replicas": 3}, "hsdp_replicas=3 does not "
                                                                "divide dp=4"),
                       ({"dp": "2"}, "positive int")):
        assert ex.set(**bad) is None, bad
        status = _plain(ex.status.value)
        assert "labkit-status-error" in ex.status.value and "invalid configuration" in status
        assert words in status, (bad, status)
        assert isinstance(ex.last_error, ValueError) and ex.values == before
        assert all(ex.controls[k].value == v for k, v in before.items())
    assert len(ex.history) == 1 and not ex.controls["dp"].disabled
    with pytest.raises(TypeError):
        ex.set(dpp=2)  # a typo is a programming error, not a configuration to show
    assert ex.set(dp=2) is not None and ex.last_error is None and len(ex.history) == 2


def test_a_rerun_sends_each_changed_figure_once(monkeypatch):
    """A run redraws every figure it changed (memory bars, gauge, bytes, timeline) in one
    pass after the job: each changed figure sends its whole new state once (the widget's
    ``outputs``), a figure the run did not change sends nothing."""
    busy = []
    fake = FakeCluster(on_run=lambda cfg: busy.append(
        (ex.controls["dp"].disabled, "running" in ex.status.value)))
    ex = _explorer(fake, RunConfig(global_batch=8, steps=3).replace(dp=2))
    sent: list = []
    for name, fig in ex.figures.items():
        fig.observe(lambda ch, _n=name: sent.append(_n), "outputs")

    def one_batch(change) -> set:
        """Run ``change``; check each figure that changed sent itself once and the others
        sent nothing; return their names."""
        before = {name: _data(fig) for name, fig in ex.figures.items()}
        sent.clear()
        change()
        changed = {n for n, fig in ex.figures.items() if _data(fig) != before[n]}
        assert sorted(sent) == sorted(changed), sent
        for n in changed:
            assert _shown(ex.figures[n]) == json.loads(pio.to_json(ex.figures[n],
                                                                   validate=False)), n
        return changed

    # the bubble panel says "no pipeline at pp=1" from the start (the real pipeline test
    # sees it change)
    everything = {"memory", "mfu", "comm", "timeline"}
    assert one_batch(lambda: ex.set(dp=1)) == everything
    assert one_batch(lambda: setattr(ex.controls["dp"], "value", 2)) == everything  # a drag
    assert busy == [(True, True), (True, True)] and not ex.controls["dp"].disabled
    assert fake.configs[-1].parallel.dp == 2 and len(ex.history) == 2
    assert ex.figures["mfu"].data[0].value == pytest.approx(ex.history[-1]["mfu_pct"])
    assert ex.last_latency_s > 0 and "figures sent" in _plain(ex.status.value)
    # more ranks than cores: the status says the times do not compare across rank counts
    for cores, shares in ((1, True), (2, False)):
        monkeypatch.setattr(os, "cpu_count", lambda c=cores: c)
        ex.rerun()
        assert ("its 2 ranks share 1 CPU core:" in _plain(ex.status.value)) == shares


def _shown(fig) -> dict:
    """The plotly figure a LiveFigure's widget state holds: its first output (the second
    shows the widget that draws later figures in place; with no page here, it never does)."""
    out, view = fig.outputs
    assert view["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] \
        == fig.inplace.model_id
    assert fig.shown() is out["data"][PLOTLY]
    return out["data"][PLOTLY]


PLOTLY = "application/vnd.plotly.v1+json"


def test_a_figure_goes_in_place_once_the_page_says_ready_and_back_when_it_fails(monkeypatch):
    """After the page's view says ``ready`` (for the output now shown), a changed figure
    travels in the in-place widget and ``outputs`` stays as drawn; a ``failed`` draw, or a
    draw not acknowledged within ACK_TIMEOUT_S, sends the next figure by replacing the
    output again (a new generation, whose view must say ``ready`` anew)."""
    from labkit_widgets import _inplace

    ex = _explorer(FakeCluster(), RunConfig(global_batch=8, steps=3).replace(dp=2))
    fig = ex.figures["mfu"]
    replaced: list = []
    fig.observe(lambda ch: replaced.append(1), "outputs")
    ip = fig.inplace
    ip._on_front(ip, {"event": "ready", "gen": ip.gen - 1}, [])  # an old view: ignored
    ex.set(dp=1)
    assert len(replaced) == 1 and ip.seq == 0
    ip._on_front(ip, {"event": "ready", "gen": ip.gen}, [])
    ex.set(dp=2)
    assert not replaced[1:] and ip.seq == 1  # drawn in place: no output sent ...
    assert ip.figure == json.loads(pio.to_json(fig, validate=False))
    assert _shown(fig) == ip.figure  # ... and the kernel's output follows (a reload sees it)
    assert fig.get_state()["outputs"][0]["data"][PLOTLY] == ip.figure
    ip._on_front(ip, {"event": "drawn", "seq": 1}, [])
    assert ip._unacked == {}
    ex.set(dp=1)  # sent in place, never acknowledged ...
    now = time.monotonic()
    monkeypatch.setattr(_inplace.time, "monotonic", lambda: now + _inplace.ACK_TIMEOUT_S + 1)
    gen = ip.gen
    ex.set(dp=2)  # ... so this one replaces the output
    assert len(replaced) == 2 and ip.seq == 0 and ip.gen == gen + 1 and ip.figure == {}
    assert _shown(fig) == json.loads(pio.to_json(fig, validate=False))
    ip._on_front(ip, {"event": "ready", "gen": ip.gen}, [])
    ex.set(dp=1)
    assert len(replaced) == 2 and ip.seq == 1
    ip._on_front(ip, {"event": "failed", "seq": 1, "error": "Error: no plot"}, [])
    ex.set(dp=2)  # the same figure the output held before the in-place draw: sent again
    assert len(replaced) == 3 and ip.errors == ["Error: no plot"]
    assert _shown(fig) == json.loads(pio.to_json(fig, validate=False))


def test_figure_widgets_open_with_the_first_run(monkeypatch):
    """Every figure of an explorer that ran at construction opens holding that run (the
    widget's opening state, not an update after it), and every later run replaces the whole
    figure in that state: the browser draws what the kernel holds."""
    import copy

    from labkit_widgets._static import LiveFigure

    opened = {}
    real_open = W.Widget.open

    def spy(self):
        if isinstance(self, LiveFigure):
            opened[id(self)] = copy.deepcopy(self.get_state()["outputs"])
        real_open(self)

    monkeypatch.setattr(W.Widget, "open", spy)
    ex = _explorer(FakeCluster(), RunConfig(global_batch=8, steps=3).replace(dp=2),
                   run_now=True)
    assert len(ex.history) == 1 and set(ex.figures) == {"memory", "mfu", "comm", "bubble",
                                                        "timeline"}
    for name, fig in ex.figures.items():
        assert isinstance(fig, LiveFigure) and isinstance(fig, W.DOMWidget), name
        assert opened[id(fig)] == fig.outputs and _shown(fig)["data"], name
        assert _shown(fig) == json.loads(pio.to_json(fig, validate=False)), name
    assert _shown(ex.figures["mfu"])["data"][0]["value"] == pytest.approx(
        ex.history[0]["mfu_pct"])
    assert "dp AR" in _shown(ex.figures["comm"])["data"][0]["x"][1]
    assert ex.timeline.fig is ex.figures["timeline"] and ex.timeline in ex.children
    assert len(_traces(ex.figures["timeline"])["forward"].x) == 2 * 2  # 2 ranks x 2 timed steps
    sent = {name: [] for name in ex.figures}
    for name, fig in ex.figures.items():
        fig.observe(lambda ch, name=name: sent[name].append(ch["new"]), "outputs")
    ex.set(dp=1)  # a later run: each figure it changed sends its whole new state once
    assert {k: len(v) for k, v in sent.items()} == {"memory": 1, "mfu": 1, "comm": 1,
                                                    "timeline": 1, "bubble": 0}
    for name, fig in ex.figures.items():
        assert _shown(fig) == json.loads(pio.to_json(fig, validate=False)), name
    assert _shown(ex.figures["mfu"])["data"][0]["value"] == pytest.approx(
        ex.history[-1]["mfu_pct"])
    assert _shown(ex.figures["comm"])["layout"]["annotations"][0]["text"] \
        == "no communication at dp=1"


def test_figures_say_what_they_show():
    ex = _explorer(FakeCluster(), RunConfig(global_batch=8, steps=3).replace(dp=2))
    ex.set(dp=1)
    comm_fig, bubble = ex.figures["comm"], ex.figures["bubble"]
    assert [a.text for a in comm_fig.layout.annotations] == ["no communication at dp=1"]
    assert comm_fig.layout.xaxis.visible is False
    assert [a.text for a in bubble.layout.annotations] == ["no pipeline at pp=1"]
    assert bubble.layout.showlegend is False  # no key for bars that are not there
    assert ex.figures["mfu"].data[0].mode == "gauge+number"  # no delta after one run
    ex.set(dp=2)
    assert not comm_fig.layout.annotations and comm_fig.layout.xaxis.visible
    meas, pred = comm_fig.data
    assert list(meas.x[1]) == ["dp AR", "dp AR"] and list(meas.y) == list(pred.y)
    assert ex.figures["mfu"].data[0].mode == "gauge+number+delta"
    assert "HFU" in ex.figures["mfu"].layout.title.text
    mem = ex.figures["memory"]
    assert list(mem.data[0].x[1]) == ["peak", "state", "pred."] * 2
    grads = {t.name: t for t in mem.data}["gradients"]
    assert grads.y[0] == 0 and grads.y[1] > 0 and grads.y[2] == grads.y[1]  # peak vs state
    assert "gradients may not exist yet" in mem.layout.title.text


def test_history_rows_and_table():
    from labkit_widgets.explorer_figures import HISTORY_COLUMNS, knobs_string, layout_string

    ex = _explorer(FakeCluster(world_size=4), RunConfig(global_batch=8).replace(dp=4))
    ex.set(dp=2)
    ex.set(zero_stage=3, prefetch=False)
    ex.set(zero_stage=0, checkpoint="full")
    rows = ex.history
    assert [r["layout"] for r in rows] == ["dp2", "dp2·Z3", "dp2"]
    assert rows[1]["knobs"] == "no-prefetch" and rows[2]["knobs"] == "ckpt full"
    assert [r["run"] for r in rows] == [1, 2, 3] and all(r["latency_s"] > 0 for r in rows)
    assert all(r["loss"] == pytest.approx(3.9) and r["bubble_pct"] is None for r in rows)
    table = ex.history_html.value
    assert all(f">{h}<" in html.unescape(table) for h, _k, _f in HISTORY_COLUMNS)
    assert table.index("ckpt full") < table.index("no-prefetch")  # newest first
    assert table.count("<tr") == 4 and "max-width:100%" in table
    cfg = RunConfig(global_batch=8).replace(dp=2, pp=2, zero_stage=3, microbatches=4)
    assert layout_string(cfg) == "dp2·pp2·Z3·1f1b M4"
    assert layout_string(cfg.replace(schedule="interleaved", zero_stage=1, hsdp_replicas=2)) \
        == "dp2·pp2·Z1·HSDP2·interleaved M4 V2"
    # two lab models' runs of one layout read differently in the table
    assert knobs_string(RunConfig(model="tiny-moe", global_batch=8).replace(dp=2)) == "tiny-moe"
    assert knobs_string(cfg) == ""


def test_a_measured_configuration_reuses_its_memory():
    """Back to a configuration already run: the memory-tracked step is skipped and the
    figure shows the memory measured then, naming that run."""
    fake = FakeCluster()
    ex = _explorer(fake, RunConfig(global_batch=8, steps=5).replace(dp=2))
    ex.set(dp=1)
    ex.set(dp=2)
    assert [c.measure_memory for c in fake.configs] == [True, True]
    assert all(c.steps == 3 for c in fake.configs)  # max_steps: warm-up, timed, memory
    mem2 = ex.figures["memory"].to_dict()["data"]
    ex.set(dp=1)
    assert fake.configs[-1].measure_memory is False
    assert "memory from run #1" in _plain(ex.status.value)
    assert "measured in run #1" in ex.figures["memory"].layout.title.text
    assert ex.last_metrics[0]["memory"]["peak_total"] > 0
    ex.set(dp=2)
    assert ex.figures["memory"].to_dict()["data"] == mem2
    assert fake.configs[-1].measure_memory is False
    assert "measured in run #2" in ex.figures["memory"].layout.title.text


def test_follows_a_replaced_cluster_and_says_starting():
    seen = []

    class Pool(FakeCluster):
        current = None
        warm = True

        def ready(self):
            return self.warm

    old, new = Pool(), Pool(on_run=lambda cfg: seen.append(_plain(ex.status.value)))
    ex = _explorer(old, RunConfig(global_batch=8).replace(dp=2))
    old.current, new.warm = new, False  # a re-run Cluster(...) cell replaced the pool
    assert ex.set(dp=1) is not None and ex.cluster is new and new.configs and not old.configs
    assert seen == ["⏳ starting ranks… (a fresh pool imports torch on every rank: a few "
                    "seconds, once)"]
    status = _plain(ex.status.value)
    assert "following the newer cluster" in status and "ranks were started first" in status
    assert ex._is_warm(type("C", (), {"__repr__": lambda s: "Cluster(..., closed)"})()) is False


def test_static_rendering(monkeypatch):
    from labkit_widgets._static import LiveFigure

    ex = _explorer(FakeCluster(), RunConfig(global_batch=4, steps=1), run_now=True)
    for name, live in ex.figures.items():
        snap = ex.figure(name)
        assert isinstance(live, LiveFigure) and type(snap) is go.Figure
        assert snap.to_dict()["data"] == live.to_dict()["data"]
    assert set(ex.figures) == {"memory", "mfu", "comm", "bubble", "timeline"}
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    ex.static()
    assert sum(isinstance(o, go.Figure) for o in shown) == 6   # five measured, one planned
    assert any("runs tried" in getattr(o, "data", "") or "labkit-history" in
               getattr(o, "data", "") for o in shown)


def test_pipeline_action_spans_are_coloured_by_kind():
    from labkit_widgets import _style as S

    assert [S.compute_family(n) for n in ("F", "B", "W", "BW", "layers.0.forward", "data")] \
        == ["forward", "backward", "backward", "backward", "forward", "other"]


def test_explorer_real_dp_and_zero(cluster):
    """On the real job: dp 1 → 2 changes the memory and bytes; ZeRO-3 shards the
    parameters (model state measured equals predicted) and its bytes per collective
    equal the formula; a revisited configuration reuses its memory."""
    ex = _explorer(cluster, RunConfig(steps=3, global_batch=8))
    ex.set(dp=1)
    assert ex.last_error is None, ex.last_error
    mem1 = _data(ex.figures["memory"])
    ex.set(dp=2)
    assert ex.last_error is None, ex.last_error
    assert _data(ex.figures["memory"]) != mem1 and len(ex.history) == 2
    meas, pred = ex.figures["comm"].data
    assert list(meas.x[1]) == ["dp AR", "dp AR"] and list(meas.y) == pytest.approx(list(pred.y))
    dp2_memory = [r["memory"] for r in ex.last_metrics]
    ex.set(zero_stage=3)
    assert ex.last_error is None, ex.last_error
    m = ex.last_metrics
    assert all(r["memory"]["model_state"]["parameters"] == r["memory_predicted"]["parameters"]
               for r in m)
    meas, pred = ex.figures["comm"].data
    assert set(meas.x[1]) == {"dp RS", "dp AG"} and list(meas.y) == list(pred.y)
    assert ex.history[-1]["layout"] == "dp2·Z3"
    assert len(_traces(ex.figures["timeline"])["blocked"].x) > 0  # all-gather waits
    ex.set(zero_stage=0)
    assert ex.last_result.config.measure_memory is False and ex.last_error is None
    assert [r["memory"] for r in ex.last_metrics] == dp2_memory
    print(f"Explorer tiny re-run latency (dp=2, revisit): {ex.last_latency_s:.3f} s")


def test_explorer_real_pipeline(cluster):
    """pp = 2 runs the pipeline: bubble measured beside simulated per rank (and the
    executor band), compute spans coloured forward/backward, a history bubble %; pp back
    to 1 says "no pipeline at pp=1" again. A deepened model is said in the status."""
    ex = _explorer(cluster, RunConfig(steps=3, global_batch=8))
    c = ex.controls
    ex.set(dp=1)
    assert [v for _, v in c["pp"].options] == [1, 2]
    c["pp"].value = 2  # the slider path
    assert ex.last_error is None, ex.last_error
    cfg = ex.last_result.config
    assert (cfg.parallel.pp, cfg.schedule) == (2, "1f1b") and not c["schedule"].disabled
    meas, sim, executor = ex.figures["bubble"].data
    assert list(meas.x) == list(sim.x) == ["all ranks", "rank 0", "rank 1"]
    # measured idle is timing (a loaded machine can hide a rank's wait); the simulator's
    # 1F1B at P=2 always idles
    assert all(0 <= y < 100 for y in meas.y) and all(0 < y < 100 for y in sim.y)
    assert ex.history[-1]["bubble_pct"] == pytest.approx(meas.y[0])
    assert "simulated" in ex.figures["bubble"].layout.title.text
    assert not ex.figures["bubble"].layout.annotations
    t = _traces(ex.figures["timeline"])
    assert len(t["forward"].x) > 0 and len(t["backward"].x) > 0
    assert not any(cd[0] in ("F", "B", "BW", "W") for cd in t["other"].customdata)
    assert list(ex.figures["comm"].data[0].x[1]) == ["pp send", "pp send"]
    ex.set(schedule="interleaved")
    assert ex.last_error is None, ex.last_error
    assert "deepened from 2 to 4 layers" in _plain(ex.status.value)
    assert ex.history[-1]["layout"] == "dp1·pp2·interleaved M4 V2"
    c["pp"].value = 1
    assert ex.last_error is None and [a.text for a in ex.figures["bubble"].layout.annotations] \
        == ["no pipeline at pp=1"]
    assert c["schedule"].disabled and c["schedule"].value == "interleaved"  # kept, greyed
    print(f"Explorer pp=2 re-run latency: {ex.history[-2]['latency_s']:.3f} s")
