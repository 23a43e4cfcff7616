"""``PipelineView``: a pipeline run's F/B/W spans per rank, beside the simulated schedule.

Top panel: what the ranks did — every ``F``/``B``/``W``/``BW`` span of one flush from the
run's trace (the last flush measured: of the last step not run under the memory tracker,
its last flush when the step runs several; the panel's title names the step and flush),
coloured by microbatch (pattern by kind: ``F`` solid, ``B`` hatched, ``W``
crossed, ``BW`` dotted), with the idle time between them drawn as grey bubbles. Bottom
panel: the same schedule simulated on this machine — the run's measured per-stage costs,
message time and executor time per action
(:func:`labkit.parallel.pipeline.bubble.measure_bubble`) — on the same millisecond axis.
Without a cluster only the simulation (unit costs) is drawn. Two legends: the kinds (grey
swatches told apart by pattern) and the microbatch colours. Labels are drawn only on bars
wide enough to read them unrotated; hover a bar for its action and times.

The status is a small table: the bubble measured (the mean over the run's measured
flushes, with their spread: one reading on shared cores can move by several points),
simulated on this machine, and with unit costs (the lecture's number), and the terms.

Controls: schedule, P, M, V re-run on the warm cluster; ``Play`` sweeps a time cursor
across the run, showing each span once it has started, on the whole run's axes: every
rank keeps its row at any frame (frame 0, where ``Stop`` puts the cursor, shows the empty
rows). ``.figure()`` is a static snapshot.
A refused choice (M below 2P for ``dualpipe-v``, more stages than layers) runs nothing: the
controls go back to the values the figure shows, and the red status line names the refused
value beside the one kept, so the controls and the line never disagree
(:mod:`labkit_widgets.pipeline_controls`); the figure's table stays below that line.
"""
from __future__ import annotations

from typing import Optional

import ipywidgets as W

from labkit import jobs
from labkit.config import RunConfig
from labkit.parallel.pipeline.bubble import BubbleReport, measure_bubble
from labkit.parallel.pipeline.presets import PP_TINY
from labkit.parallel.pipeline.report import pipeline_trace
from labkit.parallel.pipeline.schedules import SCHEDULES
from labkit.parallel.pipeline.simulate import simulate

from . import _style as S
from ._static import StaticFigure, live
from .pipeline_controls import LABELS, V_OPTIONS, PipelineControls  # noqa: F401

__all__ = ["PipelineView", "gantt_data", "measured_spans", "flush_bubbles", "status_table",
           "drawn_flush", "pick_flush", "flush_name"]

from .pipeline_gantt import (  # noqa: F401  (moved; importable from here as before)
    KINDS, PATTERNS, PALETTE, IDLE, KIND_SWATCH, KIND_NAMES, N_DATA, FRAMES, measured_spans,
    gantt_data, drawn_flush, flush_bubbles, status_table, SHARED_AXIS_RATIO, _base_figure,
    pick_flush, flush_name)


class PipelineView(PipelineControls, StaticFigure, W.VBox):
    """Measured vs simulated pipeline schedule, with controls that re-run on a cluster.

    Args:
        cluster: a warm :class:`labkit.Cluster` (``None``: simulation only).
        schedule, pp, microbatches, virtual_stages: the starting run.
        config: a :class:`~labkit.config.RunConfig` whose other fields (model, batch,
            steps) are kept; default ``PP_TINY``, 5 steps (step 0 warms up, the last runs
            under the memory tracker: 3 measured flushes show the spread).
        result: show this ``RunResult`` of :func:`labkit.jobs.train` instead of running.

    Attributes:
        controls: ``schedule``/``pp``/``microbatches``/``virtual_stages`` widgets; ``play``
            and ``time`` (0 … 40, fraction of the makespan) linked; ``status``; ``fig``;
            ``report`` (the :class:`~labkit.parallel.pipeline.bubble.BubbleReport`);
            ``table``: the status HTML of the figure shown (kept under a refusal's line).
    """

    def __init__(self, cluster=None, schedule: str = "1f1b", pp: int = 4,
                 microbatches: int = 4, virtual_stages: int = 2, *,
                 config: Optional[RunConfig] = None, result=None,
                 interval_ms: int = 150, **kwargs):
        super().__init__(**kwargs)
        self.cluster, self.result, self.report = cluster, None, None
        self.shown: Optional[RunConfig] = None  # the configuration the figure shows
        self.base = config or RunConfig(model=PP_TINY, steps=5, count_flops=False)
        self._quiet, self.spans, self.sim_spans, self._scale = False, [], [], 1e3
        self.drawn: Optional[tuple] = None  # (step, flush, flushes) of the measured panel
        self.table = ""  # the status of the figure shown: a refusal keeps it below its line
        self._v_chosen = virtual_stages  # the V slider's value while a schedule fixes V
        max_p = cluster.world_size if cluster is not None else 8
        # a slider wide enough to drag (the row wraps on a narrow cell instead of
        # squeezing four controls into one line)
        opts = dict(continuous_update=False, style={"description_width": "30px"},
                    layout=W.Layout(width="210px"))
        self.controls = {
            "schedule": W.Dropdown(options=list(SCHEDULES), value=schedule,
                                   description="schedule", tooltip="pipeline schedule"),
            "pp": W.SelectionSlider(options=[p for p in (2, 4, 8) if p <= max_p] or [1],
                                    value=pp, description="P",
                                    tooltip="pipeline stages (one rank each)", **opts),
            "microbatches": W.SelectionSlider(options=[1, 2, 4, 8, 16], value=microbatches,
                                              description="M",
                                              tooltip="microbatches per step", **opts),
            "virtual_stages": W.SelectionSlider(options=V_OPTIONS, value=virtual_stages,
                                                description="V",
                                                tooltip="virtual stages per rank "
                                                        "(interleaved schedules)", **opts)}
        self.play = W.Play(min=0, max=FRAMES, value=FRAMES, step=1, interval=interval_ms)
        self.time = W.IntSlider(min=0, max=FRAMES, value=FRAMES, description="frame",
                                tooltip=f"how far into the step, in {FRAMES}ths of it "
                                        f"({FRAMES}: the whole step)",
                                style={"description_width": "60px"})
        W.link((self.play, "value"), (self.time, "value"))
        self.status = W.HTML(S.status_html("ready"))
        self.fig = live(_base_figure())
        for c in self.controls.values():
            c.observe(self._on_control, names="value")
        self.time.observe(lambda ch: self._draw(), names="value")
        self._show_v(schedule)
        self.children = [W.HBox(list(self.controls.values()),
                                layout=W.Layout(flex_flow="row wrap")),
                         W.HBox([self.play, self.time]),
                         self.status, self.fig]
        if result is not None:
            self.update(result)
        else:
            self.rerun()

    def config(self) -> RunConfig:
        c = {k: w.value for k, w in self.controls.items()}
        v = c["virtual_stages"] if c["schedule"] == "interleaved" else None
        m = c["microbatches"]
        batch = self.base.global_batch if self.base.global_batch % m == 0 else 2 * m
        return self.base.replace(schedule=c["schedule"], pp=c["pp"], microbatches=m,
                                 virtual_stages=v, global_batch=batch)

    def rerun(self) -> "PipelineView":
        """Run the controls' config on the cluster (or simulate it) and draw it."""
        self._show_v(self.controls["schedule"].value)  # before reading V from the slider
        cfg = self.config()
        try:
            cfg.validate(self.cluster.world_size if self.cluster is not None else None)
        except ValueError as exc:  # a refused value: the controls go back to what is shown
            # the figure stays, so its table stays too, under the red line
            self.status.value = S.status_html(self._refusal(exc), "error") + self.table
            return self
        if self.cluster is None:
            sim = simulate(cfg.build_schedule())
            self.spans, self.sim_spans, self.report, self.drawn = [], sim.spans, None, None
            self.status.value = self.table = S.status_html(
                f"simulated only (no cluster), unit costs: {sim.summary()}", "info")
            self._scale, self.shown = 1.0, cfg  # unit costs: the axis is in cost units
            self._draw()
            return self
        self.status.value = S.status_html(f"running {cfg.schedule} P={cfg.parallel.pp} "
                                          f"M={cfg.flush_microbatches} …", "busy")
        return self.update(self.cluster.run(jobs.train, cfg), cfg)

    def update(self, result, cfg: Optional[RunConfig] = None) -> "PipelineView":
        """Show a ``RunResult`` of :func:`labkit.jobs.train` with ``pp > 1`` (with data
        parallelism, its first pipeline)."""
        cfg = cfg or result.config
        self.result, sched = result, cfg.build_schedule()
        lat = max((m.get("p2p_latency_s") or 0.0) for m in result.metrics)
        trace = pipeline_trace(result.trace, cfg.mesh)
        self.report = rep = measure_bubble(trace, sched, comm=lat)
        # the panel's title names the flush these spans are (a step may run several)
        self.drawn = pick_flush(trace)
        self.spans = measured_spans(trace, *self.drawn[:2]) if self.drawn else []
        self.sim_spans = rep.predicted.spans
        self.status.value = self.table = status_table(
            rep, [result.metrics[g] for g in cfg.mesh.group(0, "pp")])
        self._scale, self.shown = 1e3, cfg  # seconds → ms
        ran = {"schedule": cfg.schedule, "pp": cfg.parallel.pp,
               "microbatches": cfg.flush_microbatches}
        if all(ran[k] in self.controls[k].options for k in ran):  # a result given: its values
            self._show_controls(cfg)
        self._draw()
        return self

    def _draw(self) -> None:
        cfg = self.shown or self.config()
        pp = cfg.parallel.pp
        ends = [max((sp.end for sp in spans), default=0.0)
                for spans in (self.spans, self.sim_spans)]
        end = max(ends)
        # one time axis while the two lengths are comparable; a run stretched by a busy
        # machine (or a simulation far off) would squeeze the shorter panel into a sliver
        # of the shared axis, so each panel then gets its own axis, and its title says so
        own = min(ends) > 0 and min(ends) < SHARED_AXIS_RATIO * end
        frac = self.time.value / FRAMES
        unit = "ms" if self._scale == 1e3 else "units"
        hover = (f"%{{text}}<br>starts at %{{base:.2f}} {unit}, lasts %{{x:.2f}} {unit}"
                 "<extra></extra>")
        with self.fig.batch_update():
            for panel, spans in enumerate((self.spans, self.sim_spans)):
                until = (ends[panel] if own else end) * frac
                cols = gantt_data(spans, pp, until, self._scale)
                for i, kind in enumerate(("idle",) + KINDS):
                    c = cols[kind]
                    self.fig.data[panel * (1 + len(KINDS)) + i].update(
                        x=c["x"], base=c["base"], y=c["y"], text=c["text"],
                        marker=dict(color=c["color"]), hovertemplate=hover)
            self.fig.layout.xaxis2.title.text = unit
            sim = "simulated on this machine" if unit == "ms" else "simulated, unit costs"
            meas = ("measured, " + drawn_flush(self.spans, pp, self._scale, unit,
                                                       flush_name(self.drawn))
                    if self.spans else "measured: nothing ran (no cluster)")
            lay = self.fig.layout
            if own:
                lengths = [f"{e * self._scale:.4g} {unit}" for e in ends]
                meas += " (own time axis)"
                sim += f": {lengths[1]} (own time axis)"
                lay.xaxis.update(matches=None, showticklabels=True,
                                 range=[0, ends[0] * self._scale])
                lay.xaxis2.range = [0, ends[1] * self._scale]
            else:
                lay.xaxis.update(matches="x2", showticklabels=False)
                lay.xaxis.range = lay.xaxis2.range = [0, end * self._scale]
            lay.annotations[1].text, lay.annotations[0].text = sim, meas
            # every rank keeps its row at any frame: the rows come from the ranks, not from
            # the bars drawn so far (at frame 0, where Play's stop puts the cursor, no bar has
            # started, and an axis read from the data collapsed to one centred "rank 0")
            rows = [f"rank {r}" for r in range(pp)]
            for axis in (lay.yaxis, lay.yaxis2):
                axis.update(type="category", categoryorder="array", categoryarray=rows,
                            autorange=False, range=[pp - 0.5, -0.5])  # rank 0 on top
            self.fig.layout.yaxis.visible = bool(self.spans)
            m = cfg.flush_microbatches
            self.fig.layout.title.text = self._name()
            for i in range(len(PALETTE)):  # one colour key per microbatch
                self.fig.data[N_DATA + 1 + len(KINDS) + i].visible = i < m

    def _on_control(self, _change) -> None:
        if not self._quiet:
            self.rerun()

    def __repr__(self) -> str:
        c = self.config()
        return f"PipelineView({c.schedule!r}, P={c.parallel.pp}, M={c.flush_microbatches})"
