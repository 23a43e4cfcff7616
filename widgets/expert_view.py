"""``ExpertView``: where the tokens went in a mixture-of-experts training run, and the
all-to-alls that moved them, replayed from the recorded trace (claim C37).

Left: a heatmap of the choices each rank routed to each expert and kept (the text also
shows the dropped ones as ``(−n)``) for the selected step and layer, with the imbalance
``max/mean`` of the per-expert totals in the title. Right: one all-to-all of that step —
dispatch or combine, forward, backward or recomputed — as a traffic matrix (row = sending
rank, column = receiving rank, colour = bytes) over all ranks, taken from the events
:mod:`labkit.comm` recorded on every rank; ``ep`` groups side by side show as blocks.
``Play`` walks through the step's all-to-alls in the order they ran.

Everything drawn comes from a :func:`labkit.train.run` result (``outputs[r]["routing"]``
and the trace; as plain data: :mod:`labkit_widgets.expert_frames`). Given a warm cluster, the aux-loss weight, capacity factor and top-k
controls re-run that training with the change, and the view updates; :meth:`run` does the
same for any config. ``figure()`` is a static snapshot for nbval and saved notebooks.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.parallel.expert.measure import expert_numel

from . import _style as S
from ._static import StaticFigure, live
from .expert_frames import (  # noqa: F401  (moved; importable from here as before)
    ALL, routing_ranks, expert_load, a2a_frames)

__all__ = ["ExpertView", "expert_load", "a2a_frames", "routing_ranks"]

AUX_WEIGHTS = (0.0, 0.001, 0.01, 0.1, 1.0)
#: capacity factors offered; 0.0 stands for none (a capacity factor is always > 0)
CAPACITIES = (("none", 0.0), ("2.0", 2.0), ("1.5", 1.5), ("1.25", 1.25), ("1.0", 1.0),
              ("0.75", 0.75), ("0.5", 0.5))


def _base_figure() -> go.Figure:
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.16,
                        subplot_titles=("tokens per expert (kept choices)", "all-to-all"))
    fig.add_trace(go.Heatmap(name="load", x=[], y=[], z=[], text=[], texttemplate="%{text}",
                             colorscale="Blues", xgap=2, ygap=2, showscale=False,
                             hovertemplate="%{y} → expert %{x}: %{z} choices<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Heatmap(name="traffic", x=[], y=[], z=[], text=[],
                             texttemplate="%{text}", colorscale="YlOrBr", xgap=2, ygap=2,
                             showscale=False,
                             hovertemplate="%{y} → %{x}: %{z} B<extra></extra>"),
                  row=1, col=2)
    fig.update_layout(template="plotly_white", height=340, margin=dict(l=60, r=20, t=80, b=50),
                      title=dict(text="no run yet", font_size=14))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="expert", row=1, col=1)
    fig.update_yaxes(title_text="routing rank", row=1, col=1)
    fig.update_xaxes(title_text="receiving rank", row=1, col=2)
    return live(fig)


class ExpertView(StaticFigure, W.VBox):
    """Load heatmap + all-to-all replay of a mixture-of-experts training run.

    Args:
        result: a ``RunResult`` of :func:`labkit.train.run` on a MoE model (``None``
            until :meth:`update` or :meth:`run`).
        cluster: a warm :class:`labkit.Cluster`; with it the model controls re-run.

    Attributes:
        step, layer, frame, play: what is shown; aux_weight, capacity, top_k: the model
        knobs that re-run training (``cluster`` needed); fig: the ``LiveFigure``;
        result: the run shown; frames: the selected step's all-to-alls (:func:`a2a_frames`).
    """

    def __init__(self, result=None, cluster=None):
        super().__init__()
        self.result, self.cluster, self.frames, self._quiet = None, cluster, [], False
        self.step = W.IntSlider(value=0, min=0, max=0, description="step",
                                tooltip="training step to show",
                                continuous_update=False, layout=W.Layout(width="260px"))
        self.layer = W.Dropdown(options=[ALL], value=ALL, description="layer",
                                tooltip="MoE layer (all layers: summed)",
                                layout=W.Layout(width="200px"))
        self.frame = W.IntSlider(value=0, min=0, max=0, description="all-to-all",
                                 tooltip="which all-to-all of the step to replay",
                                 continuous_update=False, layout=W.Layout(width="320px"))
        self.play = W.Play(value=0, min=0, max=0, interval=800, description="play",
                           tooltip="play the all-to-alls")
        W.link((self.play, "value"), (self.frame, "value"))
        W.link((self.play, "max"), (self.frame, "max"))
        self.aux_weight = W.Dropdown(options=list(AUX_WEIGHTS), value=0.01,
                                     description="aux weight",
                                     tooltip="load-balancing loss weight (re-runs training)",
                                     layout=W.Layout(width="190px"))
        self.capacity = W.Dropdown(options=list(CAPACITIES), value=0.0,
                                   description="capacity",
                                   tooltip="expert capacity factor; none: no token dropped "
                                           "(re-runs training)",
                                   layout=W.Layout(width="180px"))
        self.top_k = W.IntSlider(value=1, min=1, max=1, description="top-k",
                                 tooltip="experts per token (re-runs training)",
                                 continuous_update=False, layout=W.Layout(width="220px"),
                                 style={"description_width": "initial"})
        self.status, self.info = W.HTML(), W.HTML()
        self.fig = _base_figure()
        self.step.observe(lambda _c: self._on_step(), names="value")
        self.layer.observe(lambda _c: self._redraw(), names="value")
        self.frame.observe(lambda _c: self._redraw(), names="value")
        for w in (self.aux_weight, self.capacity, self.top_k):
            w.observe(lambda _c: None if self._quiet else self.rerun(), names="value")
        knobs = [W.HBox([self.aux_weight, self.capacity, self.top_k])] if cluster else []
        self.children = knobs + [W.HBox([self.step, self.layer]),
                                 W.HBox([self.play, self.frame]), self.status, self.fig,
                                 self.info]
        if result is not None:
            self.update(result)

    # -- running -----------------------------------------------------------------------
    def run(self, config) -> "ExpertView":
        """Train ``config`` (a MoE ``RunConfig``) on the cluster and show the result; a
        refused config or a failed rank is shown in the status line."""
        from labkit import train

        if self.cluster is None:
            self.status.value = S.status_html("no cluster: pass one to ExpertView(result, "
                                              "cluster) to re-run", "error")
            return self
        self.status.value = S.status_html("training …", "busy")
        try:
            result = self.cluster.run(train.run, config)
            routing_ranks(result)
        except Exception as exc:  # noqa: BLE001 - shown in the widget, not raised
            self.status.value = S.status_html(f"{type(exc).__name__}: {exc}", "error")
            return self
        return self.update(result)

    def rerun(self) -> "ExpertView":
        """Re-run the shown run's config with the knobs' aux weight, capacity and top-k."""
        if self.result is None:
            return self
        cfg = self.result.config
        mc = dataclasses.replace(cfg.model_config, aux_loss_weight=self.aux_weight.value,
                                 capacity_factor=self.capacity.value or None, top_k=self.top_k.value)
        return self.run(cfg.replace(model=mc))

    def update(self, result) -> "ExpertView":
        """Show a new run (keeps the step and layer when they still exist).

        Raises:
            ValueError: ``result`` is not a pipeline-free MoE training run
                (:func:`routing_ranks`).
        """
        routing_ranks(result)
        self.result = result
        mc = result.config.model_config
        outs = result.outputs
        steps, n_layers = len(outs[0]["routing"]), len(outs[0]["routing"][0]["kept"])
        self._quiet = True
        try:
            self.step.max = steps - 1
            self.step.value = min(self.step.value, steps - 1)
            keep = self.layer.value
            self.layer.options = [ALL] + list(range(n_layers))
            self.layer.value = keep if keep in self.layer.options else ALL
            if mc.aux_loss_weight not in self.aux_weight.options:
                self.aux_weight.options = sorted(set(self.aux_weight.options)
                                                 | {mc.aux_loss_weight})
            self.aux_weight.value = mc.aux_loss_weight
            cf = mc.capacity_factor or 0.0
            if cf not in [v for _, v in self.capacity.options]:
                self.capacity.options = list(self.capacity.options) + [(f"{cf:g}", cf)]
            self.capacity.value = cf
            self.top_k.max = mc.n_experts
            self.top_k.value = mc.top_k
        finally:
            self._quiet = False
        self._on_step()
        return self

    # -- drawing -----------------------------------------------------------------------
    def _on_step(self) -> None:
        if self._quiet or self.result is None:
            return
        self.frames = a2a_frames(self.result.trace, self.step.value)
        self._quiet = True
        try:
            self.frame.max = max(len(self.frames) - 1, 0)
            self.frame.value = min(self.frame.value, self.frame.max)
        finally:
            self._quiet = False
        self._redraw()

    def _redraw(self) -> None:
        if self._quiet or self.result is None:
            return
        load = expert_load(self.result, self.step.value, self.layer.value)
        n_exp = len(load["totals"])
        fr = self.frames[self.frame.value] if self.frames else None
        with self.fig.batch_update():
            self.fig.data[0].update(x=[f"e{e}" for e in range(n_exp)],
                                    y=[f"rank {r}" for r in load["ranks"]], z=load["z"],
                                    text=load["text"])
            if fr is not None:
                names = [f"rank {r}" for r in fr["ranks"]]
                self.fig.data[1].update(x=names, y=names, z=fr["matrix"],
                                        text=[[("local" if i == j else S.fmt_bytes(b))
                                               for j, b in enumerate(row)]
                                              for i, row in enumerate(fr["matrix"])])
            else:
                self.fig.data[1].update(x=[], y=[], z=[], text=[])
            where = "all layers" if self.layer.value == ALL else f"layer {self.layer.value}"
            self.fig.layout.title.text = (
                f"step {self.step.value} · {where} · imbalance max/mean = "
                f"{load['imbalance']:.2f} · dropped {sum(load['dropped'])}"
                f"<br><sup>{self._frame_text(fr)}</sup>")
            self.fig.layout.annotations[1].text = (
                f"all-to-all: layer {fr['layer']} {fr['phase']} ({fr['pass']})"
                if fr else "all-to-all: none recorded")
        self.status.value = S.status_html(self._summary(load), "ok")

    def _frame_text(self, fr: Optional[dict]) -> str:
        if fr is None:
            return "no token all-to-all in this step's trace (ep=1: the experts are local)"
        micro = f" microbatch {fr['micro']}" if self.result.config.accum_steps > 1 else ""
        # i/last, as the slider reads (0 … last) and as the other views number their steps
        return (f"all-to-all {self.frame.value}/{len(self.frames) - 1}: layer {fr['layer']}"
                f"{micro} {fr['phase']} ({fr['pass']}), {S.fmt_bytes(fr['sent'])} between "
                "ranks (rows send, columns receive)")

    def _summary(self, load: dict) -> str:
        cfg = self.result.config
        mc, ep = cfg.model_config, cfg.parallel.ep
        full = expert_numel(mc)
        return (f"ep={ep} · {mc.n_experts} experts, {mc.n_experts // ep} per rank · top-{mc.top_k}"
                f" · capacity {mc.capacity_factor if mc.capacity_factor else 'none'}"
                f" · aux weight {mc.aux_loss_weight:g} · expert parameters per rank "
                f"{full // ep:,} of {full:,} · tokens per expert {load['totals']}")

    def __repr__(self) -> str:
        if self.result is None:
            return "ExpertView(no run)"
        return (f"ExpertView(step {self.step.value}/{self.step.max}, layer {self.layer.value}, "
                f"all-to-all {self.frame.value}/{len(self.frames) - 1})")
