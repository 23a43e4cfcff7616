"""``CheckpointView``: a checkpoint schedule, run for real and replayed step by step.

The schedule (:mod:`labkit.parallel.checkpoint`) is executed on a real layer stack by
:func:`labkit.parallel.checkpoint.exec.run_schedule`; what the view animates is that run's
record — after every action, which stored tensors were alive (from the saved-tensor hooks) and
how many bytes they held. Nothing is drawn from a script.

One ``LiveFigure`` (a plotly figure that is a widget) with two panels:

* top: the chain. Column ``j`` is ``A_j`` (the activation entering layer ``j+1``) in the lower
  row and ``s_j`` (what layer ``j`` saved inside: ``silu(A_{j-1})``) in the upper row; a filled
  square is stored now. A triangle marks the layer the current action touches, coloured by
  kind (forward, recompute, backward, free).
* bottom: stored units after each action (1 unit = one ``(B, H)`` fp32 tensor), with the
  actions marked by kind and a cursor on the current step; the dotted line is the closed-form
  peak.

Controls: N (layers), strategy, C (layers per checkpoint/segment; used by "every" and
"segment") re-run the schedule; ``Play`` steps through it. For the strategies that fix C
themselves (``sqrt``: ⌈√N⌉, ``full``: N) the greyed C slider shows the C they use, and your
own C comes back when you switch to ``every`` or ``segment``. ``.figure()`` is a static
snapshot. At large N the chain's tick labels thin out and its squares shrink so that every
number stays readable.
"""
from __future__ import annotations

from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.parallel.checkpoint import STRATEGIES, Schedule, formula_counts, make_schedule
from labkit.parallel.checkpoint.exec import ExecResult, run_schedule

from . import _style as S
from ._static import StaticFigure, live

__all__ = ["CheckpointView", "OP_COLORS"]

OP_COLORS = {"forward": S.COMPUTE_COLORS["forward"], "recompute": "#B279A2",
             "backward": S.COMPUTE_COLORS["backward"], "free": "#9D9D9D"}
ALIVE, EMPTY = "#E45756", "#EEEEEE"
N_OPTIONS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: above this many actions, the ~760 px action axis puts per-action markers under 4 px
#: apart (one kind's then hide another's): each action is drawn as a stem from 0 instead
DENSE_ACTIONS = 190
_OP_HOVER = "step %{x}: %{text}, %{y} units<extra></extra>"
_DENSE_HOVER = "step %{x}: %{text} units<extra></extra>"
_CODE_OP = {"F": "forward", "R": "recompute", "B": "backward", "D": "free"}


def _op(code: str) -> str:
    return _CODE_OP[code[0]]


def _layer_of(code: str) -> int:
    return int("".join(ch for ch in code[1:] if ch.isdigit()))


def chain_ticks(n: int) -> tuple:
    """``(dtick, marker size)`` for a chain of ``n`` layers: at most ~17 tick labels and
    squares that do not run into each other in an ~800 px wide plot."""
    dtick = next(d for d in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100)
                 if (n + 1) / d <= 17) if n < 1600 else max(1, n // 16)
    return dtick, max(4, min(14, int(560 / (n + 1))))


def _base_figure() -> go.Figure:
    fig = make_subplots(rows=2, cols=1, row_heights=[0.42, 0.58], vertical_spacing=0.2,
                        subplot_titles=("stored now", "stored units after each action"))
    fig.add_trace(go.Scatter(name="stored", mode="markers", x=[], y=[], showlegend=False,
                             marker=dict(symbol="square", size=14, color=[],
                                         line=dict(width=1, color="#BBBBBB")),
                             hovertemplate="%{text}<extra></extra>", text=[]), row=1, col=1)
    fig.add_trace(go.Scatter(name="action", mode="markers+text", x=[], y=[], text=[],
                             textposition="top center", showlegend=False,
                             marker=dict(symbol="triangle-down", size=16, color=[]),
                             hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Scatter(name="stored units", mode="lines", x=[], y=[],
                             line=dict(color="#555555", width=1.5, shape="hv"),
                             hoverinfo="skip"), row=2, col=1)
    for op, color in OP_COLORS.items():
        fig.add_trace(go.Scatter(name=op, mode="markers", x=[], y=[], text=[],
                                 marker=dict(color=color, size=6), line=dict(color=color,
                                                                             width=1),
                                 hovertemplate=_OP_HOVER),
                      row=2, col=1)
    fig.add_trace(go.Scatter(name="formula peak", mode="lines", x=[], y=[],
                             line=dict(color=ALIVE, dash="dot", width=1), hoverinfo="skip"),
                  row=2, col=1)
    fig.add_trace(go.Scatter(name="now", mode="markers", x=[], y=[], showlegend=False,
                             marker=dict(symbol="circle-open", size=14, color="black",
                                         line=dict(width=2)), hoverinfo="skip"), row=2, col=1)
    fig.update_layout(template="plotly_white", height=460, margin=dict(l=60, r=20, t=60, b=40),
                      title=dict(text="", font_size=14), legend=dict(orientation="h", y=-0.12))
    fig.update_yaxes(tickmode="array", tickvals=[0, 1], ticktext=["A_j", "s_j"],
                     range=[-0.6, 2.3], row=1, col=1)
    fig.update_xaxes(dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="action", row=2, col=1)
    fig.update_yaxes(title_text="units", rangemode="tozero", row=2, col=1)
    return fig


class CheckpointView(StaticFigure, W.VBox):
    """Replay a checkpoint schedule executed on a real chain of layers.

    Args:
        n_layers, strategy, every: the starting schedule (``every`` = C).
        schedule: show this :class:`~labkit.parallel.checkpoint.Schedule` instead.
        batch, hidden: shape of each stored tensor ``(B, H)`` in the executed chain.
        interval_ms: Play speed.

    Attributes:
        controls: ``n_layers`` / ``strategy`` / ``every`` widgets; ``play`` (``W.Play``) and
            ``step`` (``W.IntSlider``) linked together; ``status`` (``W.HTML``).
        fig: the ``LiveFigure`` (created from the first drawn schedule);
            ``result``: the :class:`ExecResult` on display.
    """

    def __init__(self, n_layers: int = 8, strategy: str = "sqrt", every: int = 2, *,
                 schedule: Optional[Schedule] = None, batch: int = 2, hidden: int = 8,
                 interval_ms: int = 400, **kwargs):
        super().__init__(**kwargs)
        self.batch, self.hidden, self.result = batch, hidden, None
        self._quiet = False
        opts = dict(continuous_update=False, style={"description_width": "24px"})
        n_opts = sorted(set(N_OPTIONS) | {int(n_layers)})
        self._user_every = min(max(1, int(every)), int(n_layers))
        self.controls = {
            "n_layers": W.SelectionSlider(options=n_opts, value=int(n_layers), description="N",
                                          tooltip="layers in the chain", **opts),
            "strategy": W.Dropdown(options=list(STRATEGIES), value=strategy,
                                   description="strategy", tooltip="checkpointing strategy",
                                   style={"description_width": "60px"},
                                   layout=W.Layout(width="200px")),
            "every": W.IntSlider(min=1, max=int(n_layers), value=self._user_every,
                                 description="C", tooltip="layers per checkpoint or segment "
                                 "(every, segment; sqrt and full fix their own)", **opts)}
        self.play = W.Play(min=0, max=0, value=0, step=1, interval=interval_ms,
                           description="play")
        self.step = W.IntSlider(min=0, max=0, value=0, description="step",
                                tooltip="action of the schedule to show",
                                style={"description_width": "40px"},
                                layout=W.Layout(width="420px"))
        W.link((self.play, "value"), (self.step, "value"))
        self.status = W.HTML(S.status_html("ready"))
        self.fig = _base_figure()
        for c in self.controls.values():
            c.observe(self._on_control, names="value")
        self.step.observe(self._on_step, names="value")
        if schedule is not None:
            self.update(schedule)
        else:
            self.rerun()
        self.fig = live(self.fig)  # the widget starts from the drawn figure
        self.children = [W.HBox(list(self.controls.values())), W.HBox([self.play, self.step]),
                         self.status, self.fig]

    # -- running -------------------------------------------------------------------
    def set(self, **values) -> "CheckpointView":
        """Set controls (``n_layers``, ``strategy``, ``every``) at once, then re-run once."""
        self._quiet = True
        try:
            if "n_layers" in values:
                n = int(values["n_layers"])
                c = self.controls["n_layers"]
                if n not in c.options:
                    c.options = sorted(set(c.options) | {n})
                c.value = n
            for k in ("strategy", "every"):
                if k in values:
                    self.controls[k].value = values[k]
            if "every" in values:
                self._user_every = int(values["every"])
        finally:
            self._quiet = False
        return self.rerun()

    def rerun(self) -> "CheckpointView":
        """Build the schedule the controls describe, execute it, show step 0."""
        n = self.controls["n_layers"].value
        self._quiet = True
        try:
            self.controls["every"].max = n  # clamps C to N
        finally:
            self._quiet = False
        strategy = self.controls["strategy"].value
        own_c = strategy in ("every", "segment")
        self.controls["every"].disabled = not own_c
        every = min(self._user_every, n)
        try:
            sched = make_schedule(strategy, n, every if own_c else None)
        except ValueError as exc:
            self.status.value = S.status_html(str(exc), "error")
            return self
        return self.update(sched)

    def update(self, schedule) -> "CheckpointView":
        """Show a :class:`Schedule` (executed here) or an :class:`ExecResult`."""
        res = schedule if isinstance(schedule, ExecResult) else run_schedule(
            schedule, batch=self.batch, hidden=self.hidden)
        self.result = res
        sched = res.schedule
        self._quiet = True
        try:
            c = self.controls
            if sched.n_layers not in c["n_layers"].options:
                c["n_layers"].options = sorted(set(c["n_layers"].options) | {sched.n_layers})
            c["n_layers"].value = sched.n_layers
            c["every"].max = sched.n_layers
            c["strategy"].value = sched.strategy
            c["every"].disabled = sched.strategy not in ("every", "segment")
            if sched.every is not None:  # greyed for sqrt/full: the C they use
                c["every"].value = sched.every
            last = len(res.steps) - 1
            self.play.max = self.step.max = last
            self.step.value = 0
        finally:
            self._quiet = False
        want = formula_counts(sched.strategy, sched.n_layers, sched.every)
        ok = want == res.counts
        cnt = res.counts
        c_txt = f", C={sched.every}" if sched.every is not None else ""
        self.status.value = S.status_html(
            f"{sched.strategy} N={sched.n_layers}{c_txt}: {cnt.layer_calls} layer forward calls "
            f"({cnt.recompute} recomputes{f', {cnt.ew_recompute} element-wise' if cnt.ew_recompute else ''}), "
            f"peak {cnt.peak_units} units = {S.fmt_bytes(res.peak_bytes)} — formula: "
            f"{want.layer_calls} calls, {want.peak_units} units "
            f"{'(equal)' if ok else '(DIFFERENT)'}", "ok" if ok else "error")
        self._draw_schedule(want.peak_units)
        self.show_step(0)
        return self

    # -- drawing -------------------------------------------------------------------
    def _draw_schedule(self, formula_peak: int) -> None:
        res, unit = self.result, self.result.unit_bytes
        xs = list(range(len(res.steps)))
        ys = [s.bytes // unit for s in res.steps]
        by_op = {op: ([], [], []) for op in OP_COLORS}
        for k, s in enumerate(res.steps):
            x, y, t = by_op[_op(s.action)]
            x.append(k), y.append(ys[k]), t.append(s.action)
        n = res.schedule.n_layers
        with self.fig.batch_update():
            self.fig.data[2].update(x=xs, y=ys)
            dense = len(xs) > DENSE_ACTIONS
            for i, op in enumerate(OP_COLORS):
                x, y, t = by_op[op]
                if dense:  # markers under 4 px apart hide each other: a stem per action
                    t = [v for a, u in zip(t, y) for v in (f"{a}, {u}", f"{a}, {u}", None)]
                    x = [v for k in x for v in (k, k, None)]
                    y = [v for u in y for v in (0, u, None)]
                self.fig.data[3 + i].update(x=x, y=y, text=t,
                                            mode="lines" if dense else "markers",
                                            hovertemplate=_DENSE_HOVER if dense else _OP_HOVER)
            self.fig.data[7].update(x=[0, max(len(xs) - 1, 1)], y=[formula_peak] * 2)
            dtick, size = chain_ticks(n)
            self.fig.layout.xaxis.range = [-0.7, n + 0.7]
            self.fig.layout.xaxis.dtick = dtick
            self.fig.data[0].marker.size = size
            self.fig.data[1].marker.size = max(size, 8)
            self.fig.layout.title.text = (f"{res.schedule.strategy}: N = {n}, "
                                          f"{len(xs)} actions")

    def _on_control(self, change) -> None:
        if self._quiet:
            return
        if change["owner"] is self.controls["every"]:
            self._user_every = int(change["new"])
        self.rerun()

    def _on_step(self, change) -> None:
        if not self._quiet:
            self.show_step(change["new"])

    def show_step(self, k: int) -> None:
        """Draw the state after action ``k`` (0-based)."""
        res = self.result
        k = max(0, min(int(k), len(res.steps) - 1))
        st = res.steps[k]
        alive = set(st.alive)
        n = res.schedule.n_layers
        xs, ys, colors, text = [], [], [], []
        for j in range(n + 1):
            for row, kind in ((0, "A"), (1, "s")):
                if kind == "s" and j == 0:
                    continue
                label = f"{kind}{j}"
                xs.append(j), ys.append(row)
                colors.append(ALIVE if label in alive else EMPTY)
                text.append(f"{label}: {'stored' if label in alive else 'not stored'}")
        op, layer = _op(st.action), _layer_of(st.action)
        unit = res.unit_bytes
        with self.fig.batch_update():
            self.fig.data[0].update(x=xs, y=ys, text=text, marker=dict(color=colors))
            self.fig.data[1].update(x=[layer], y=[1.6], text=[st.action],
                                    marker=dict(color=[OP_COLORS[op]]))
            self.fig.data[8].update(x=[k], y=[st.bytes // unit])
            self.fig.layout.annotations[0].text = (
                f"after step {k}: {st.action} ({op}) — {len(alive)} stored, "
                f"{S.fmt_bytes(st.bytes)}")

    def __repr__(self) -> str:
        s = self.result.schedule if self.result else None
        return (f"CheckpointView({s.strategy!r}, N={s.n_layers}, C={s.every}, "
                f"step={self.step.value})" if s else "CheckpointView()")
