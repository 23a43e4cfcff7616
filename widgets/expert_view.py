"""``ExpertView``: where the tokens went in an expert-parallel run, and the all-to-alls that
moved them, replayed from the recorded trace (claim C37).

Left: a heatmap of the tokens each rank routed to each expert (kept choices; the text also
shows the dropped ones) for the selected step and layer, with the imbalance ``max/mean``
of the per-expert totals in the title. Right: one all-to-all of that step — dispatch or
combine, forward or backward — as a traffic matrix (row = sending rank, column = receiving
rank, colour = bytes), taken from the events :mod:`labkit.comm` recorded on every rank.
``Play`` walks through the step's all-to-alls in the order they ran. Everything drawn comes
from the run's result (:func:`labkit.parallel.expert.jobs.train`) and its trace; ``update``
shows a new run; ``figure()`` is a static snapshot for nbval and saved notebooks.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.parallel.expert.measure import imbalance

from . import _style as S
from ._static import StaticFigure

__all__ = ["ExpertView", "expert_load", "a2a_frames"]

ALL = "all layers"


def expert_load(result, step: int, layer=ALL) -> dict:
    """The left heatmap as plain data: ``{"z": [rank][expert] kept choices, "dropped":
    [rank][layer-summed dropped], "text", "imbalance", "totals"}`` for ``step`` and ``layer``
    (an index or :data:`ALL`, the sum over layers)."""
    outs = result.outputs
    n_layers = len(outs[0]["routing"][step]["kept"])
    layers = range(n_layers) if layer == ALL else [int(layer)]
    z, text, dropped = [], [], []
    for o in outs:
        rec = o["routing"][step]
        row = [sum(rec["kept"][li][e] for li in layers) for e in range(len(rec["kept"][0]))]
        wanted = [sum(rec["counts"][li][e] for li in layers) for e in range(len(row))]
        z.append(row)
        text.append([f"{k}" + (f" (−{w - k})" if w > k else "") for k, w in zip(row, wanted)])
        dropped.append(sum(rec["dropped"][li] for li in layers))
    totals = [sum(col) for col in zip(*z)]
    return {"z": z, "text": text, "dropped": dropped, "totals": totals,
            "imbalance": imbalance(totals)}


def a2a_frames(trace, step: int) -> list:
    """The step's token all-to-alls (dispatch/combine, forward/backward) in the order they
    ran: ``[{"layer", "phase", "pass", "ranks", "matrix" [i][j] bytes i → j, "sent"}]``.

    Every rank records its part of each all-to-all; the ``n``-th event of a rank pairs with
    the ``n``-th of every other rank of its group (collectives run in one order everywhere).
    """
    per_group: dict = defaultdict(lambda: defaultdict(list))
    for ev in trace.events:  # sorted by start time
        if (ev.op == "all_to_all" and ev.step == step
                and ev.args.get("phase") in ("dispatch", "combine")):
            per_group[tuple(ev.peers)][ev.rank].append(ev)
    frames = []
    for peers, by_rank in per_group.items():
        for calls in zip(*(by_rank[r] for r in peers if r in by_rank)):
            ranks = list(peers)
            first = calls[0]
            matrix = [[0.0] * len(ranks) for _ in ranks]
            for ev in calls:
                matrix[ranks.index(ev.rank)] = [float(b) for b in ev.args["bytes_to"]]
            frames.append({"layer": first.args.get("layer"), "phase": first.args["phase"],
                           "pass": first.args.get("pass", "forward"), "ranks": ranks,
                           "matrix": matrix, "sent": sum(map(sum, matrix)),
                           "start": min(ev.start for ev in calls)})
    frames.sort(key=lambda f: f["start"])
    return frames


def _base_figure() -> go.FigureWidget:
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.16,
                        subplot_titles=("tokens per expert (kept choices)", "all-to-all"))
    fig.add_trace(go.Heatmap(name="load", x=[], y=[], z=[], text=[], texttemplate="%{text}",
                             colorscale="Blues", xgap=2, ygap=2, showscale=False,
                             hovertemplate="rank %{y} → expert %{x}: %{z} tokens<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Heatmap(name="traffic", x=[], y=[], z=[], text=[],
                             texttemplate="%{text}", colorscale="YlOrBr", xgap=2, ygap=2,
                             showscale=False,
                             hovertemplate="rank %{y} → rank %{x}: %{z} B<extra></extra>"),
                  row=1, col=2)
    fig.update_layout(template="plotly_white", height=330, margin=dict(l=60, r=20, t=80, b=50),
                      title=dict(text="no run yet", font_size=14))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="expert", row=1, col=1)
    fig.update_yaxes(title_text="sending rank", row=1, col=1)
    fig.update_xaxes(title_text="receiving rank", row=1, col=2)
    return go.FigureWidget(fig)


class ExpertView(StaticFigure, W.VBox):
    """Load heatmap + all-to-all replay of an expert-parallel run.

    Args:
        result: a ``RunResult`` of :func:`labkit.parallel.expert.jobs.train` (or ``None``
            until :meth:`update`).

    Attributes:
        step, layer, frame, play: the controls; fig: the ``go.FigureWidget``; result: the
        run shown; frames: the selected step's all-to-alls (:func:`a2a_frames`).
    """

    def __init__(self, result=None):
        super().__init__()
        self.result, self.frames, self._quiet = None, [], False
        self.step = W.IntSlider(value=0, min=0, max=0, description="step",
                                continuous_update=False, layout=W.Layout(width="260px"))
        self.layer = W.Dropdown(options=[ALL], value=ALL, description="layer",
                                layout=W.Layout(width="200px"))
        self.frame = W.IntSlider(value=0, min=0, max=0, description="all-to-all",
                                 continuous_update=False, layout=W.Layout(width="320px"))
        self.play = W.Play(value=0, min=0, max=0, interval=800, description="play")
        W.link((self.play, "value"), (self.frame, "value"))
        W.link((self.play, "max"), (self.frame, "max"))
        self.status, self.info = W.HTML(), W.HTML()
        self.fig = _base_figure()
        self.step.observe(lambda _c: self._on_step(), names="value")
        self.layer.observe(lambda _c: self._redraw(), names="value")
        self.frame.observe(lambda _c: self._redraw(), names="value")
        self.children = [W.HBox([self.step, self.layer]), W.HBox([self.play, self.frame]),
                         self.status, self.fig, self.info]
        if result is not None:
            self.update(result)

    def update(self, result) -> "ExpertView":
        """Show a new run (keeps the step and layer when they still exist)."""
        self.result = result
        outs = result.outputs
        steps, n_layers = len(outs[0]["routing"]), len(outs[0]["routing"][0]["kept"])
        self._quiet = True
        try:
            self.step.max = steps - 1
            self.step.value = min(self.step.value, steps - 1)
            keep = self.layer.value
            self.layer.options = [ALL] + list(range(n_layers))
            self.layer.value = keep if keep in self.layer.options else ALL
        finally:
            self._quiet = False
        self._on_step()
        return self

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
        n_ranks, n_exp = len(load["z"]), len(load["totals"])
        fr = self.frames[self.frame.value] if self.frames else None
        with self.fig.batch_update():
            self.fig.data[0].update(x=[f"e{e}" for e in range(n_exp)],
                                    y=[f"rank {r}" for r in range(n_ranks)], z=load["z"],
                                    text=load["text"])
            if fr is not None:
                names = [f"rank {r}" for r in fr["ranks"]]
                self.fig.data[1].update(x=names, y=names, z=fr["matrix"],
                                        text=[[("local" if i == j else S.fmt_bytes(b))
                                               for j, b in enumerate(row)]
                                              for i, row in enumerate(fr["matrix"])])
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
            return "no token all-to-all in this step's trace"
        return (f"all-to-all {self.frame.value + 1}/{len(self.frames)}: layer {fr['layer']} "
                f"{fr['phase']} ({fr['pass']}), {S.fmt_bytes(fr['sent'])} between ranks "
                "(rows send, columns receive)")

    def _summary(self, load: dict) -> str:
        outs = self.result.outputs
        info = outs[0]["info"]
        return (f"ep={info['ep']} · {info['n_experts']} experts, {info['n_local']} per rank · "
                f"expert bytes per rank {S.fmt_bytes(info['expert_bytes'])} of "
                f"{S.fmt_bytes(info['full_expert_numel'] * outs[0]['elem_bytes'])} · "
                f"tokens per expert {load['totals']}")

    def __repr__(self) -> str:
        if self.result is None:
            return "ExpertView(no run)"
        return (f"ExpertView(step {self.step.value}/{self.step.max}, layer {self.layer.value}, "
                f"all-to-all {self.frame.value + 1}/{len(self.frames)})")
