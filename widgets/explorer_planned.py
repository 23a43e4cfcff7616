"""The :class:`~labkit_widgets.explorer.Explorer`'s **planned** panel: the layout its controls
describe, scaled to a real model on a real cluster (the rule of
:mod:`~labkit_widgets.planned_scaling`, shown under the panel's dropdowns) and computed by
:mod:`labkit.plan` — a formula, beside the measured run; no rank runs for it.

The panel shows the fullest GPU's memory by category against the GPU's memory, the step time
split into the pipeline's busy time, its bubble, the exposed data-parallel traffic, what the
network adapter adds and the optimizer step, and the bubble, MFU and HFU — every number the
planner's own :class:`~labkit.plan.Plan`. A layout the rule or the planner refuses shows the
reason instead of numbers; a layout that does not fit the GPU's memory keeps its numbers and
says so.
"""
from __future__ import annotations

import html
from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.plan import CLUSTERS, MEMORY_CATEGORIES, GiB, cluster_preset, estimate, plan_model

from . import _style as S
from ._static import StaticFigure, live
from .planned_scaling import MODELS, MOE_MODELS, RUNTIME, gpu_counts, rule_text, scale

__all__ = ["PlannedPanel", "planned_figure", "draw_planned", "step_parts", "STEP_PARTS",
           "MODELS", "MOE_MODELS", "RUNTIME", "scale", "gpu_counts", "rule_text"]

#: the step time's parts, stacked: they add up to the planner's step time
STEP_PARTS = ("pipeline busy", "bubble", "exposed DP", "network-bound", "optimizer step")
#: none of them a memory category's colour: the two stacks share one legend
_STEP_COLORS = ("#1B9E77", "#E6C229", "#B279A2", "#17BECF", "#6F4E37")
_MEM_COLORS = {**S.MEMORY_COLORS, "comm_buffers": S.MEMORY_COLORS["other"]}


# --------------------------------------------------------------------------- figure
def planned_figure() -> go.Figure:
    """Memory of the fullest GPU by category (GiB, stacked, the HBM limit dashed) and the
    step time by part (seconds, stacked)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.16,
                        subplot_titles=["memory per GPU, GiB", "step time, s"])
    for c in MEMORY_CATEGORIES:
        name = c.replace("_", " ")
        fig.add_bar(name=name, x=["fullest GPU"], y=[None], marker_color=_MEM_COLORS[c],
                    legendgroup="memory", hovertemplate=f"{name}: %{{y:.2f}} GiB<extra></extra>",
                    row=1, col=1)
    for part, colour in zip(STEP_PARTS, _STEP_COLORS):
        fig.add_bar(name=part, x=["step"], y=[None], marker_color=colour, legendgroup="time",
                    hovertemplate=f"{part}: %{{y:.3f}} s<extra></extra>", row=1, col=2)
    fig.update_layout(template="plotly_white", width=820, height=360, barmode="stack",
                      margin=dict(l=52, r=10, t=92, b=30),
                      legend=dict(font_size=10, x=1.0, xanchor="left"),
                      title=dict(text="planned (formula)", font_size=13, x=0.01,
                                 xanchor="left"))
    for a in fig.layout.annotations:
        a.font.size = 11
    return fig


def step_parts(plan) -> list:
    """Seconds of :data:`STEP_PARTS`; they add up to ``plan.step_time``: the pipeline
    ``(m + (p−1)/V)·t_mb`` split into busy and bubble, the exposed data-parallel traffic,
    what the network adapter adds beyond them, the optimizer."""
    pipe, opt = plan.terms["t.pipeline"].value, plan.terms["t.optimizer"].value
    dp = plan.comm["dp"].exposed
    nic = max(0.0, plan.step_time - opt - pipe - dp)
    return [pipe * (1 - plan.bubble), pipe * plan.bubble, dp, nic, opt]


def draw_planned(fig, plan, reason: Optional[str], title: str) -> None:
    """Paint ``plan`` (a :class:`labkit.plan.Plan`) on :func:`planned_figure`, or, when the
    planner refused the layout, empty bars and ``reason``."""
    n = len(MEMORY_CATEGORIES)
    mem_axes, time_axes = fig.data[:n], fig.data[n:]
    titles = [a for a in fig.layout.annotations if a.name != "reason"][:2]
    for ax in (fig.layout.xaxis, fig.layout.yaxis, fig.layout.xaxis2, fig.layout.yaxis2):
        ax.visible = plan is not None
    if plan is None:
        for tr in fig.data:
            tr.y = [None]
        fig.layout.shapes = []
        fig.layout.annotations = titles + [dict(
            name="reason", text="not planned:<br>" + "<br>".join(_wrap(reason or "", 70)),
            x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
            font=dict(size=13, color=S.ERROR_RED))]
        fig.layout.title.text = (f"planned (formula): {title}<br><sup>not planned: "
                                 f"{html.escape(reason or '')}</sup>")
        return
    fig.layout.annotations = titles
    for tr, c in zip(mem_axes, MEMORY_CATEGORIES):
        tr.y = [plan.memory[c] / GiB]
    for tr, v in zip(time_axes, step_parts(plan)):
        tr.y = [v]
    limit = plan.memory_limit / GiB
    fig.layout.shapes = [dict(type="line", xref="x domain", yref="y", x0=0, x1=1, y0=limit,
                              y1=limit, line=dict(color=S.ERROR_RED, dash="dash", width=1))]
    fig.layout.yaxis.range = [0, 1.08 * max(limit, plan.memory["total"] / GiB)]
    fits = ("fits" if plan.fits else "does not fit: " + "; ".join(plan.reasons))
    fig.layout.title.text = (
        f"planned (formula): {title}<br><sup>step {plan.step_time:.3g} s · bubble "
        f"{100 * plan.bubble:.1f} % · MFU {100 * plan.mfu:.1f} % · HFU {100 * plan.hfu:.1f} %"
        f"<br>memory {plan.memory['total'] / GiB:.1f} GiB of {limit:.0f} GiB (dashed) on "
        f"pipeline rank {plan.memory_rank}: {html.escape(fits)}</sup>")


# --------------------------------------------------------------------------- panel
class PlannedPanel(StaticFigure, W.VBox):
    """The planned panel: dropdowns for the model, the cluster and its GPU count; the
    scaling rule with its numbers; one figure (:func:`planned_figure`).

    Args:
        cfg: the ``RunConfig`` the explorer's controls describe now.
        model: a preset of :data:`MODELS` (any :data:`labkit.plan.PLAN_MODELS` name works).
            The dropdown follows the lab model's kind: dense presets for a dense lab model,
            :data:`MOE_MODELS` for a mixture of experts (its ``ep`` is then planned); each
            kind keeps the user's last choice. A dense ``model`` given for an MoE lab model
            is kept for when the lab model is dense again.
        cluster: a :data:`labkit.plan.CLUSTERS` preset.
        gpus: GPUs to fill (default: 1,024, or the whole cluster when smaller).

    Attributes:
        plan: the :class:`labkit.plan.Plan` shown, or ``None`` when refused;
            ``planned_layout`` its :class:`~labkit.plan.Layout` (``None`` when the rule
            refused); ``reason`` the refusal or ``None``; ``notes`` where the plan differs
            from the lab.
        numbers: what the panel shows, straight from the plan: ``memory`` (bytes by
            category and ``total``), ``memory_limit``, ``memory_rank``, ``step_time_s``,
            ``bubble``, ``mfu``, ``hfu``, ``fits``, ``reasons``; empty when refused.
        fig: the ``LiveFigure``; ``rule`` the rule's HTML; ``model``, ``cluster``,
            ``gpus`` the dropdowns.

    Raises:
        ValueError: an unknown model or cluster preset, a GPU count the cluster lacks.
    """

    def __init__(self, cfg, model: str = "llama3-8b", cluster: str = "llama3-24k",
                 gpus: Optional[int] = None, **kwargs):
        super().__init__(**kwargs)
        plan_model(model)
        counts = gpu_counts(cluster)
        gpus = gpus if gpus is not None else (1024 if 1024 in counts else counts[-1])
        if gpus not in counts:
            raise ValueError(f"gpus={gpus!r}: {cluster} offers {counts}")
        style = {"description_width": "initial"}
        moe = _lab_moe(cfg)
        self._choice = {plan_model(model).moe: model}   # the last choice per kind
        model = self._choice.setdefault(moe, _DEFAULT[moe])
        self.model = W.Dropdown(options=_options(moe, model), value=model,
                                description="model", style=style,
                                tooltip="the planned model: dense presets for a dense lab "
                                        "model, mixture-of-experts presets for tiny-moe",
                                layout=W.Layout(width="215px"))   # "qwen1.5-moe-a2.7b"
        self.cluster = W.Dropdown(options=list(CLUSTERS), value=cluster, description="cluster",
                                  style=style, layout=W.Layout(width="200px"))
        self.gpus = W.Dropdown(options=_count_options(counts), value=gpus, description="GPUs",
                               style=style, layout=W.Layout(width="150px"))
        self.rule = W.HTML()
        self.cfg, self.plan, self.planned_layout, self.reason = cfg, None, None, None
        self.notes: list = []
        self.numbers: dict = {}
        self._quiet = False
        fig = planned_figure()
        self.fig = fig
        self.refresh()
        self.fig = live(fig)
        for w in (self.model, self.cluster, self.gpus):
            w.observe(self._on_change, names="value")
        self.children = [
            W.HTML("<b>planned (formula)</b>: the layout of the controls above on a real "
                   "model and cluster, by <code>labkit.plan</code>; no rank runs for it"),
            W.HBox([self.model, self.cluster, self.gpus],
                   layout=W.Layout(flex_flow="row wrap", width="100%")),
            self.rule, self.fig]

    def update(self, cfg) -> None:
        """Plan ``cfg`` (the explorer's new configuration) and redraw; a lab model of the
        other kind (dense / mixture of experts) swaps the model dropdown to that kind's
        presets, at the last one chosen there."""
        self.cfg = cfg
        moe = _lab_moe(cfg)
        if plan_model(self.model.value).moe != moe:
            self._choice[not moe] = self.model.value
            model = self._choice.setdefault(moe, _DEFAULT[moe])
            self._quiet = True
            try:
                self.model.options = _options(moe, model)
                self.model.value = model
            finally:
                self._quiet = False
        self.refresh()

    def set(self, model: Optional[str] = None, cluster: Optional[str] = None,
            gpus: Optional[int] = None) -> None:
        """Choose the model, cluster and GPU count (as the dropdowns do), then redraw once.

        Raises:
            ValueError: an unknown preset or a GPU count the cluster does not offer.
        """
        model = self.model.value if model is None else model
        cluster = self.cluster.value if cluster is None else cluster
        plan_model(model)
        counts = gpu_counts(cluster)
        gpus = gpus if gpus is not None else _nearest(counts, self.gpus.value)
        if gpus not in counts:
            raise ValueError(f"gpus={gpus!r}: {cluster} offers {counts}")
        self._choice[plan_model(model).moe] = model
        self._quiet = True
        try:
            if model not in self.model.options:
                self.model.options = sorted(set(self.model.options) | {model}, key=_order)
            self.model.value = model
            self.cluster.value = cluster
            self.gpus.options = _count_options(counts)
            self.gpus.value = gpus
        finally:
            self._quiet = False
        self.refresh()

    def _on_change(self, change) -> None:
        if self._quiet:
            return
        if change["owner"] is self.cluster:
            self.set(cluster=change["new"])
        else:
            self.refresh()

    def refresh(self) -> None:
        """Scale, plan and redraw from the current configuration and dropdowns."""
        n, model, cluster = self.gpus.value, self.model.value, self.cluster.value
        self.plan = self.planned_layout = self.reason = None
        self.numbers, self.notes = {}, []
        try:
            self.planned_layout, self.notes = scale(self.cfg, n)
            self.plan = estimate(model, cluster, self.planned_layout, RUNTIME)
        except ValueError as exc:
            self.reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - a panel shows every failure, never crashes
            self.reason = f"{type(exc).__name__}: {exc}"
        if self.plan is not None:
            p = self.plan
            self.numbers = {"memory": dict(p.memory), "memory_limit": p.memory_limit,
                            "memory_rank": p.memory_rank, "step_time_s": p.step_time,
                            "bubble": p.bubble, "mfu": p.mfu, "hfu": p.hfu, "fits": p.fits,
                            "reasons": list(p.reasons)}
        gpu = cluster_preset(cluster).gpu.name
        with self.fig.batch_update():
            draw_planned(self.fig, self.plan, self.reason,
                         f"{model} on {n:,} {gpu} ({cluster})")
        text = rule_text(self.cfg, self.planned_layout, n, model)
        extra = (" <b>Differs from the lab</b>: " + "; ".join(html.escape(x) for x in self.notes)
                 + "." if self.notes else "")
        refused = (f"<div style='color:{S.ERROR_RED};font-weight:bold'>not planned: "
                   f"{html.escape(self.reason)}</div>" if self.reason else "")
        self.rule.value = (f"<div class='labkit-planned-rule' style='font-size:11px;"
                           f"color:{S.MUTED};max-width:820px'><b>scaling rule</b>: "
                           f"{html.escape(text)}{extra}</div>{refused}")


def _wrap(text: str, width: int) -> list:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + [line] if line else lines


def _order(name: str) -> tuple:
    known = MODELS + MOE_MODELS
    return (known.index(name) if name in known else len(known), name)


#: the planned model first shown for a dense / a mixture-of-experts lab model
_DEFAULT = {False: "llama3-8b", True: MOE_MODELS[0]}


def _lab_moe(cfg) -> bool:
    """The lab's model is a mixture of experts."""
    return bool(getattr(cfg.model_config, "n_experts", 0))


def _options(moe: bool, model: str) -> list:
    """The dropdown's presets for a lab model of this kind, with ``model`` among them."""
    return sorted(set(MOE_MODELS if moe else MODELS) | {model}, key=_order)


def _nearest(counts: list, want: int) -> int:
    """The count closest to ``want`` (a cluster change keeps the GPU count when it can)."""
    return min(counts, key=lambda c: (abs(c - want), c))


def _count_options(counts: list) -> list:
    return [(f"{c:,}", c) for c in counts]
