"""Widgets, headless: TimelineView on real cluster traces, Explorer driven by ``set()``.

The Explorer is tested twice: against a fake cluster whose results follow the train job's
per-rank schema (:func:`fake_train_output`), so the widget logic is checked without
training; and against the real ``labkit.jobs.train`` on a 2-rank cluster once
``labkit/train.py`` exists.
"""
from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as W
import pytest
import torch

import labkit
from labkit import comm, jobs
from labkit.cluster import RunResult
from labkit.config import RunConfig
from labkit.trace import Event, Trace

# plotly is imported inside the tests: rank processes import this module to find
# stepped_job, and should not pay for plotly there.
HAVE_TRAIN = (Path(labkit.__file__).parent / "train.py").exists()
needs_train = pytest.mark.skipif(not HAVE_TRAIN, reason="labkit/train.py not written yet")


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
    """One rank's ``jobs.train`` return value, in the schema ``labkit.train`` produces."""
    n_params, dp, micro = 100_000, cfg.parallel.dp, cfg.micro
    pred = {"parameters": 4 * n_params, "gradients": 4 * n_params, "optimizer": 8 * n_params}
    pred["total"] = sum(pred.values())
    peak = {"parameters": 4 * n_params, "gradients": 4 * n_params,
            "optimizer": 8 * n_params, "activations": 30_000 * micro, "other": 1_000}
    comm_bytes = 2 * (dp - 1) / dp * 4 * n_params
    step_s = 0.02 * cfg.accum_steps + 0.001 * (dp - 1)
    flops = 6.0 * n_params * cfg.local_batch * 64
    return {"losses": [4.0 - 0.1 * s + 0.01 * rank for s in range(cfg.steps)],
            "metrics": {
                "rank": rank, "dp": dp, "micro_batch": micro, "accum_steps": cfg.accum_steps,
                "dp_mode": cfg.dp_mode, "bucket_mb": cfg.bucket_mb, "n_params": n_params,
                "tokens_per_step": cfg.global_batch * 64, "step_time_s": step_s,
                "step_times": [step_s] * cfg.steps,
                "memory": {"peak": peak, "peak_total": sum(peak.values()), "allocator_peak": None,
                           "timeline": [["after forward", peak]]},
                "memory_predicted": pred, "flops_per_step": flops, "flops_analytic": flops,
                "peak_flops": 1e11, "mfu": flops / 1e11 / step_s, "hfu": flops / 1e11 / step_s,
                "comm_bytes_per_step": comm_bytes, "comm_bytes_predicted": comm_bytes}}


def test_explorer_defaults_to_the_whole_cluster():
    """Without a base config the explorer's dp is the cluster's world size (the batch of 8
    splits over it), so `Explorer(cluster)` uses every rank."""
    from labkit_widgets import Explorer

    for ws, dp in ((2, 2), (4, 4), (3, 1), (6, 2)):
        fake = type("C", (FakeCluster,), {"world_size": ws})()
        ex = Explorer(fake, run_now=False, timeline=False)
        assert ex.base.parallel.dp == dp and ex.controls["dp"].value == dp, (ws, dp)


class FakeCluster:
    """``world_size`` + ``run(job, cfg)`` like a Cluster, answering from the schema."""

    world_size = 2

    def __init__(self, on_run=None):
        self.configs, self.on_run = [], on_run

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
    from plotly.basewidget import BaseFigureWidget

    from labkit_widgets import TimelineView

    tv = TimelineView(cluster.run(jobs.all_reduce_demo))
    ar = _traces(tv.fig)["all-reduce"]
    assert len(ar.x) == 2 and all(d >= 0 for d in ar.x)
    assert sorted(c[7] for c in ar.customdata) == [0, 1]
    assert ar.customdata[0][3] == "16 B"  # 2(N-1)/N · 16 B sent
    assert list(tv.fig.layout.yaxis.ticktext) == ["rank 0", "comm", "rank 1", "comm"]
    fig = tv.figure()
    assert not isinstance(fig, BaseFigureWidget) and len(fig.data) == len(tv.fig.data)


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
    assert len(tv.fig.data) == 13  # fixed families, not one trace per event
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
def _memory_data(ex):
    return [(tuple(map(tuple, d.x)), tuple(d.y)) for d in ex.figures["memory"].data]


def test_explorer_fake_headless():
    from labkit_widgets import Explorer

    busy = []
    fake = FakeCluster(on_run=lambda cfg: busy.append(ex.controls["dp"].disabled))
    ex = Explorer(fake, RunConfig(global_batch=8, steps=2), job=jobs.train, run_now=False)
    assert list(ex.controls["dp"].options) == [1, 2]
    assert all(not c.continuous_update for k, c in ex.controls.items()
               if isinstance(c, W.SelectionSlider))
    assert ex.set(dp=1) is not None
    mem1 = _memory_data(ex)
    assert list(ex.controls["micro_batch"].options) == [1, 2, 4, 8]
    ex.set(dp=2)
    assert _memory_data(ex) != mem1 and len(ex.history) == 2
    assert list(ex.controls["micro_batch"].options) == [1, 2, 4]  # recomputed for dp=2
    assert ex.controls["micro_batch"].value == 4 and fake.configs[-1].micro == 4
    assert busy == [True, True] and not ex.controls["dp"].disabled  # disabled while running
    assert ex.last_latency_s > 0 and ex.last_result.config.parallel.dp == 2
    assert "re-run took" in _text(ex.status.value)
    comm_fig = ex.figures["comm"]
    assert list(comm_fig.data[1].y) == pytest.approx([2 * 0.5 * 4e5 / 2 ** 20] * 2)
    assert ex.figures["mfu"].data[0].value == pytest.approx(ex.history[-1]["mfu_pct"])
    assert "<table" in ex.history_html.value and ex.history_html.value.count("<tr") == 3
    # a slider change runs through observe, exactly like a user drag
    ex.controls["dp_mode"].value = "naive"
    assert len(ex.history) == 3 and fake.configs[-1].dp_mode == "naive"
    ex.set(micro_batch=2, bucket_mb=0.01)
    assert (fake.configs[-1].micro, fake.configs[-1].bucket_mb) == (2, 0.01)
    assert len(fake.configs) == 4  # one run per set(), however many controls it changed


def test_explorer_invalid_shows_error_not_exception():
    from labkit_widgets import Explorer

    ex = Explorer(FakeCluster(), RunConfig(global_batch=8, steps=2), run_now=True)
    assert len(ex.history) == 1
    for bad in ({"dp": 3}, {"micro_batch": 3}, {"dp_mode": "zero9"}, {"global_batch": 3, "dp": 2}):
        assert ex.set(**bad) is None, bad
        status = _text(ex.status.value)
        assert "labkit-status-error" in status and "invalid configuration" in status, bad
        assert isinstance(ex.last_error, ValueError)
    assert "global_batch=3" in status and "not divisible" in status
    assert len(ex.history) == 1 and not ex.controls["dp"].disabled
    with pytest.raises(TypeError):
        ex.set(dpp=2)  # a typo is a programming error, not a configuration to show
    ex.set(global_batch=8)  # recovers
    assert ex.last_error is None and len(ex.history) == 2


def test_explorer_static_figures():
    import plotly.graph_objects as go
    from plotly.basewidget import BaseFigureWidget

    from labkit_widgets import Explorer

    ex = Explorer(FakeCluster(), RunConfig(global_batch=4, steps=1))
    for name, live in ex.figures.items():
        snap = ex.figure(name)
        assert isinstance(live, BaseFigureWidget) and not isinstance(snap, BaseFigureWidget)
        assert isinstance(snap, go.Figure)
        assert snap.to_dict()["data"] == live.to_dict()["data"]
    assert set(ex.figures) == {"memory", "mfu", "comm", "bubble", "timeline"}
    assert list(ex.figure().data[0].x[1][:2]) == ["measured", "predicted"]


@needs_train
def test_explorer_real_train(cluster):
    from labkit_widgets import Explorer

    ex = Explorer(cluster, RunConfig(steps=2, global_batch=8), run_now=False)
    ex.set(dp=1)
    assert ex.last_error is None, ex.last_error
    mem1 = _memory_data(ex)
    ex.set(dp=2)
    assert ex.last_error is None, ex.last_error
    assert _memory_data(ex) != mem1 and len(ex.history) == 2
    m = ex.last_result.metrics
    assert len(m) == 2 and m[0]["comm_bytes_per_step"] > 0 and ex.history[-1]["comm_bytes"] > 0
    assert len(_traces(ex.figures["timeline"])["backward"].x) > 0
    assert 0 < ex.last_latency_s < 60
    print(f"Explorer tiny-model re-run latency: {ex.last_latency_s:.3f} s")


def test_explorer_checkpoint_policy_reruns(cluster):
    """The recompute control re-runs with the policy: HFU rises above MFU, activations fall."""
    from labkit_widgets import Explorer

    ex = Explorer(cluster, RunConfig(steps=3, global_batch=8).replace(dp=2), run_now=False)
    ex.set(checkpoint="none")
    plain = ex.last_result.metrics[0]
    ex.set(checkpoint="full")
    assert ex.last_error is None, ex.last_error
    full = ex.last_result.metrics[0]
    assert ex.history[-1]["checkpoint"] == "full"
    assert full["hfu"] > full["mfu"] and plain["hfu"] == plain["mfu"]
    assert full["memory"]["peak"]["activations"] < plain["memory"]["peak"]["activations"]
    ex.set(checkpoint="sometimes")
    assert "sometimes" in ex.status.value and ex.last_error is not None


def test_explorer_zero_controls_without_running():
    """The ZeRO controls: HSDP options follow dp, prefetch only at stage 3, the job picked."""
    from labkit.parallel.zero_jobs import zero_train
    from labkit_widgets import Explorer

    ex = Explorer(FakeCluster(), RunConfig(global_batch=8, steps=2).replace(dp=2),
                  run_now=False)
    c = ex.controls
    assert list(c["zero_stage"].options) == [0, 1, 2, 3] and c["zero_stage"].value == 0
    assert [v for _, v in c["hsdp_replicas"].options] == [1, 2] and c["prefetch"].disabled
    assert ex.job_config()[0] is jobs.train and not c["dp_mode"].disabled
    c["dp"].value = 1  # the slider path (re-runs the train job on the fake cluster)
    assert [v for _, v in c["hsdp_replicas"].options] == [1]
    job, cfg = ex.job_config(zero_stage=3, prefetch=False, hsdp_replicas=1)
    assert job is zero_train and (cfg.zero_stage, cfg.prefetch, cfg.hsdp_replicas) == (3, False, 1)
    assert ex.set(dp=2, zero_stage=0, hsdp_replicas=2) is None  # stage 0 has no HSDP
    assert "hsdp_replicas=2 needs zero_stage 1-3" in _text(ex.status.value)
    assert c["dp"].value == 1  # nothing changed


def test_explorer_zero_stages_real(cluster):
    """dp=2: stage 0 → 3 re-runs the ZeRO job; the parameters bar halves; bytes per
    collective measured beside predicted; prefetch and HSDP re-run; bad combos are shown."""
    from labkit.parallel.zero_config import ZeroConfig
    from labkit_widgets import Explorer

    ex = Explorer(cluster, RunConfig(steps=3, global_batch=8).replace(dp=2), run_now=False)
    ex.set(zero_stage=0)
    assert ex.last_error is None and isinstance(ex.last_result.config, RunConfig)
    mem0, params0 = _memory_data(ex), ex.figures["memory"].data[0].y[0]  # rank 0 measured
    ex.set(zero_stage=3)
    assert ex.last_error is None, ex.last_error
    cfg = ex.last_result.config
    assert isinstance(cfg, ZeroConfig) and (cfg.zero_stage, cfg.prefetch) == (3, True)
    assert _memory_data(ex) != mem0
    params3 = ex.figures["memory"].data[0].y[0]
    assert 1.9 < params0 / params3 < 2.1  # parameters sharded over K=2 ranks
    meas, pred = ex.figures["comm"].data
    assert set(meas.x[1]) == {"reduce_scatter", "all_gather"}
    assert list(meas.y) == pytest.approx(list(pred.y))  # counted bytes == the formula
    row = ex.history[-1]
    assert (row["zero_stage"], row["prefetch"], row["replicas"]) == (3, True, 1)
    assert row["overlap_pct"] is not None and "AG hidden" in ex.history_html.value
    assert not ex.controls["prefetch"].disabled and ex.controls["dp_mode"].disabled
    assert len(_traces(ex.figures["timeline"])["blocked"].x) > 0  # all-gather waits
    print(f"Explorer ZeRO-3 (tiny, dp=2) re-run latency: {ex.last_latency_s:.3f} s")
    assert 0 < ex.last_latency_s < 60
    ex.controls["prefetch"].value = False  # the observe path, like a click
    assert len(ex.history) == 3 and ex.last_result.config.prefetch is False
    assert ex.history[-1]["prefetch"] is False
    ex.set(zero_stage=3, prefetch=False, hsdp_replicas=2)
    assert ex.last_error is None, ex.last_error
    assert ex.last_result.config.hsdp_replicas == 2 and ex.history[-1]["replicas"] == 2
    assert "all_reduce" in ex.figures["comm"].data[0].x[1]  # across the replica groups
    n = len(ex.history)
    assert ex.set(hsdp_replicas=3) is None
    status = _text(ex.status.value)
    assert "invalid configuration" in status and "hsdp_replicas=3" in status and "dp=2" in status
    assert ex.set(zero_stage=4) is None and "got 4" in _text(ex.status.value)
    assert len(ex.history) == n and ex.controls["hsdp_replicas"].value == 2
    ex.set(zero_stage=1, hsdp_replicas=1)
    assert ex.last_error is None and ex.controls["prefetch"].disabled
    assert set(ex.last_result.metrics[0]["comm_bytes_by_op"]) == {"reduce_scatter", "all_gather"}
    ex.set(zero_stage=0)
    assert isinstance(ex.last_result.config, RunConfig) and not ex.controls["dp_mode"].disabled


def test_explorer_pipeline_real(cluster):
    """pp=2 runs the pipeline job: bubble measured beside simulated (figure and history),
    activation memory per rank, MFU; dp/ZeRO are off and combining them is refused in the
    status line; pp=1 runs data parallelism again."""
    from labkit.parallel.pipeline import PipelineConfig
    from labkit_widgets import Explorer

    ex = Explorer(cluster, RunConfig(steps=2, global_batch=8).replace(dp=2), run_now=False)
    c = ex.controls
    assert list(c["pp"].options) == [1, 2] and list(c["microbatches"].options) == [1, 2, 4, 8]
    assert c["microbatches"].disabled and c["schedule"].disabled and not c["dp"].disabled
    ex.set(pp=2, microbatches=4)
    assert ex.last_error is None, ex.last_error
    cfg = ex.last_result.config
    assert isinstance(cfg, PipelineConfig)
    assert (cfg.pp, cfg.microbatches, cfg.schedule) == (2, 4, "1f1b")
    assert c["dp"].value == 1 and c["dp"].disabled and c["zero_stage"].disabled
    assert not c["microbatches"].disabled and not c["schedule"].disabled
    meas, sim = ex.figures["bubble"].data
    assert list(meas.x) == list(sim.x) == ["all ranks", "rank 0", "rank 1"]
    assert all(0 < y < 100 for y in list(meas.y) + list(sim.y))
    title = ex.figures["bubble"].layout.title.text
    assert "measured" in title and "simulated" in title and "1f1b P=2 M=4" in title
    row = ex.history[-1]
    assert (row["pp"], row["schedule"], row["microbatches"]) == (2, "1f1b", 4)
    assert row["bubble_pct"] == pytest.approx(meas.y[0])
    assert row["bubble_sim_pct"] == pytest.approx(sim.y[0])
    assert "bubble % meas" in ex.history_html.value and "bubble % sim" in ex.history_html.value
    mem = _traces(ex.figures["memory"])
    peaks = [m["peak_activation_bytes"] / 2 ** 20 for m in ex.last_result.metrics]
    assert list(mem["activations"].y) == pytest.approx(peaks) and min(peaks) > 0
    assert all(y > 0 for y in mem["parameters"].y)
    assert row["mfu_pct"] > 0 and ex.figures["mfu"].data[0].value == pytest.approx(row["mfu_pct"])
    assert "ceiling" in ex.figures["mfu"].layout.title.text
    print(f"Explorer pp=2 1F1B re-run latency: {ex.last_latency_s:.3f} s")
    assert 0 < ex.last_latency_s < 60
    ex.controls["schedule"].value = "gpipe"  # the observe path: GPipe holds all M on rank 0
    assert ex.last_error is None and ex.last_result.config.schedule == "gpipe"
    assert [m["peak_inflight"] for m in ex.last_result.metrics] == [4, 4]
    print(f"Explorer pp=2 warm re-run (schedule change) latency: {ex.last_latency_s:.3f} s")
    n = len(ex.history)
    for bad, words in (({"dp": 2}, ["N-D composition is not available yet", "dp=2"]),
                       ({"zero_stage": 3}, ["N-D composition", "zero_stage=3"]),
                       ({"microbatches": 3}, ["microbatches=3", "global_batch=8"]),
                       ({"schedule": "dualpipe"}, ["unknown schedule 'dualpipe'"])):
        assert ex.set(**bad) is None, bad
        status = _text(ex.status.value)
        assert "invalid configuration" in status and all(w in status for w in words), status
    assert len(ex.history) == n and c["pp"].value == 2 and c["schedule"].value == "gpipe"
    ex.set(pp=1, dp=2)
    assert ex.last_error is None and isinstance(ex.last_result.config, RunConfig)
    assert ex.last_result.config.parallel.dp == 2 and ex.history[-1]["pp"] == 1
    assert "no pipeline" in ex.figures["bubble"].layout.title.text
    assert not c["dp"].disabled and c["microbatches"].disabled
    c["pp"].value = 2  # the slider path: dp goes to 1 quietly, the pipeline runs
    assert ex.last_error is None and isinstance(ex.last_result.config, PipelineConfig)
    assert c["dp"].value == 1 and len(ex.history) == n + 2
