"""``CollectiveView``: watch a collective move chunks, step by step, from a real run.

Pick the op, the algorithm and N; the view runs it on the warm cluster
(``labkit.collectives.jobs.collective`` with ``nranks=N``) and draws the per-step records
the ranks returned (:class:`labkit.collectives.record.Recording`) — never a scripted
animation. Each rank is a row; each chunk of its buffer a cell showing its values. The
left block is what each rank started with, the right block what it holds after the
selected step; arrows are the messages of that step. Cell colour counts how many ranks'
inputs are reduced into the chunk (partial sums darken until complete), or, for
all-to-all, which rank the chunk came from — so the transpose shows as colour: input rows
become output columns (a step as plain data: :mod:`labkit_widgets.collective_frames`).
Play/step controls walk the steps; ``figure()`` is a static snapshot for nbval and saved
notebooks.
"""
from __future__ import annotations

import html
from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go

from labkit.collectives import ALGORITHMS, HAND_BUILT, OPS, formula_text
from labkit.collectives.record import Recording

from . import _style as S
from ._pool import prepare
from ._static import StaticFigure, live
from .collective_frames import (  # noqa: F401  (moved; importable from here as before)
    _PALETTE, _EMPTY, REDUCING, _text, _origin_scale, arrow_offsets, collective_frame)

__all__ = ["CollectiveView", "collective_frame"]


def _base_figure() -> go.Figure:
    common = dict(coloraxis="coloraxis", xgap=3, ygap=3, texttemplate="%{text}",
                  textfont=dict(size=11), hoverinfo="text", x=[], y=[], z=[], text=[])
    return go.Figure(
        data=[go.Heatmap(name="inputs", **common), go.Heatmap(name="state", **common)],
        layout=dict(template="plotly_white", plot_bgcolor="#EEEEEE", height=300,
                    margin=dict(l=70, r=20, t=70, b=30), title=dict(text="no run yet",
                                                                    font_size=14),
                    xaxis=dict(showgrid=False, zeroline=False, tickmode="array",
                               tickangle=0, tickfont_size=10),
                    yaxis=dict(showgrid=False, zeroline=False, tickmode="array")))


class CollectiveView(StaticFigure, W.VBox):
    """Controls + one ``LiveFigure`` that animates a collective's recorded steps.

    Args:
        cluster: a warm :class:`labkit.Cluster` (``None``: show runs passed to
            :meth:`update` only).
        op, algorithm, n: what to run first; ``algorithm=None`` picks the op's hand-built
            one; ``n=None`` all of the cluster's ranks.
        run: run at once (default True when a cluster is given).
        transpose: start in the transpose view (all-to-all only).
        **run_kwargs: passed to :func:`labkit.collectives.jobs.run` (``inputs``,
            ``dtype``, ``reduce``, ``root``, ``m``).

    Attributes:
        op, algorithm, n, step, play, transpose: the controls (ipywidgets).
        fig: the ``LiveFigure``; result: the last ``CollectiveRun``; recording: its
            :class:`~labkit.collectives.record.Recording`.
    """

    def __init__(self, cluster=None, op: str = "all_reduce", algorithm: Optional[str] = None,
                 n: Optional[int] = None, run: Optional[bool] = None, transpose: bool = False,
                 **run_kwargs):
        super().__init__()
        self.cluster, self.run_kwargs = cluster, run_kwargs
        self.result, self.recording, self._quiet = None, None, False
        max_n = cluster.world_size if cluster is not None else 8
        n = max_n if n is None else n
        short = {"description_width": "36px"}  # labels fit; the default 80 px clips none
        self.op = W.Dropdown(options=list(OPS), value=op, description="op", style=short,
                             tooltip="the collective to run",
                             layout=W.Layout(width="200px"))
        self.algorithm = W.Dropdown(options=list(ALGORITHMS[op]),
                                    value=algorithm or HAND_BUILT[op], description="algorithm",
                                    tooltip="native (torch.distributed) or hand-built",
                                    style={"description_width": "68px"},
                                    layout=W.Layout(width="260px"))
        self.n = W.IntSlider(value=n, min=2, max=max(max_n, 2), description="N", style=short,
                             tooltip="ranks taking part",
                             continuous_update=False, layout=W.Layout(width="220px"))
        self.step = W.IntSlider(value=0, min=0, max=0, description="step", style=short,
                                tooltip="round of messages to show",
                                continuous_update=False, layout=W.Layout(width="300px"))
        self.play = W.Play(value=0, min=0, max=0, interval=900, description="play")
        W.link((self.play, "value"), (self.step, "value"))
        W.link((self.play, "max"), (self.step, "max"))
        self.prev_button = W.Button(description="◀", layout=W.Layout(width="40px"))
        self.next_button = W.Button(description="▶", layout=W.Layout(width="40px"))
        self.prev_button.on_click(lambda _b: self._nudge(-1))
        self.next_button.on_click(lambda _b: self._nudge(+1))
        self.transpose = W.Checkbox(value=False, description="transpose view",
                                    tooltip="inputs beside the final outputs",
                                    indent=False, layout=W.Layout(width="150px"))
        self.status = W.HTML()
        self.info = W.HTML()
        self.fig = _base_figure()
        for w in (self.op, self.algorithm, self.n):
            w.observe(self._on_config, names="value")
        self.step.observe(lambda _c: self._redraw(), names="value")
        self.transpose.observe(lambda _c: self._redraw(), names="value")
        self._sync_transpose()
        if transpose and op == "all_to_all":
            self.transpose.value = True
        if run if run is not None else cluster is not None:
            self.rerun()
        self.fig = live(self.fig)  # the widget starts from the drawn figure
        self.children = [W.HBox([self.op, self.algorithm, self.n]),
                         W.HBox([self.play, self.prev_button, self.step, self.next_button,
                                 self.transpose]),
                         self.status, self.fig, self.info]

    # -- controls ------------------------------------------------------------------
    def set(self, **values) -> "CollectiveView":
        """Set several controls (``op``, ``algorithm``, ``n``, ``step``) with one re-run."""
        self._quiet = True
        try:
            if "op" in values:
                self.op.value = values["op"]
                self._sync_algorithms(values.get("algorithm"))
            if "algorithm" in values:
                self.algorithm.value = values["algorithm"]
            if "n" in values:
                self.n.value = values["n"]
        finally:
            self._quiet = False
        if {"op", "algorithm", "n"} & set(values):
            self.rerun()
        if "step" in values:
            self.step.value = values["step"]
        return self

    def _sync_algorithms(self, wanted: Optional[str] = None) -> None:
        opts = list(ALGORITHMS[self.op.value])
        keep = wanted if wanted in opts else (
            self.algorithm.value if self.algorithm.value in opts else HAND_BUILT[self.op.value])
        self.algorithm.options = opts
        self.algorithm.value = keep
        self._sync_transpose()

    def _sync_transpose(self) -> None:
        self.transpose.layout.display = None if self.op.value == "all_to_all" else "none"
        if self.op.value != "all_to_all":
            self.transpose.value = False

    def _on_config(self, change) -> None:
        if self._quiet:
            return
        if change["owner"] is self.op:
            self._quiet = True
            try:
                self._sync_algorithms()
            finally:
                self._quiet = False
        self.rerun()

    def _nudge(self, delta: int) -> None:
        self.step.value = max(0, min(self.step.max, self.step.value + delta))

    # -- data in -------------------------------------------------------------------
    def rerun(self) -> None:
        """Run the selected op on the warm cluster and show its record (last step)."""
        if self.cluster is None:
            self.status.value = S.status_html("no cluster: pass one to CollectiveView(...) "
                                              "or show a run with update()", "error")
            return
        from labkit.collectives import jobs

        try:
            cluster, note = prepare(self.cluster, self.status,
                                    f"running {self.op.value} ({self.algorithm.value}) on "
                                    f"{self.n.value} ranks …")
            result = jobs.run(cluster, self.op.value, self.algorithm.value, self.n.value,
                              **self.run_kwargs)
        except Exception as exc:  # noqa: BLE001 - shown in the widget, not raised
            self.status.value = S.status_html(f"{type(exc).__name__}: {exc}", "error")
            return
        self.update(result)
        if note:
            self.status.value = S.status_html(f"{self._summary()} ({note})", "ok")

    def update(self, run) -> "CollectiveView":
        """Show a ``CollectiveRun`` (from :func:`labkit.collectives.jobs.run`) or a bare
        :class:`Recording`; jumps to the last step."""
        rec = run if isinstance(run, Recording) else run.recording
        self.result, self.recording = (None if isinstance(run, Recording) else run), rec
        self._quiet = True
        try:
            self.step.max = rec.steps if rec else 0
            self.step.value = self.step.max
        finally:
            self._quiet = False
        self.status.value = S.status_html(self._summary(), "ok")
        self._redraw()
        return self

    def _summary(self) -> str:
        r, rec = self.result, self.recording
        if r is None:
            return f"{rec.op} · {rec.algorithm} · N={rec.world_size}" if rec else "no run"
        n = r.config.nranks
        sent = ", ".join(S.fmt_bytes(b) for b in r.bytes_sent)
        ok = "= formula" if r.bytes_match else "≠ formula!"
        return (f"{r.config.op} · {r.config.algorithm} · N={n} · S = {S.fmt_bytes(r.message_bytes)}"
                f" · sent per rank [{sent}] {ok} ({formula_text(r.config.op, r.config.algorithm, n)})"
                f" · {r.time_s * 1e3:.2f} ms")

    # -- drawing -------------------------------------------------------------------
    def _redraw(self) -> None:
        if self._quiet or self.recording is None:
            return
        frame = collective_frame(self.recording, self.step.value, self.transpose.value)
        with self.fig.batch_update():
            self.fig.data[0].update(frame["inputs"])
            self.fig.data[1].update(frame["state"])
            self.fig.layout.annotations = frame["annotations"]
            self.fig.update_layout(frame["layout"])
        lines = self.recording.describe(self.step.value) if not self.transpose.value else []
        body = "<br>".join(html.escape(x) for x in lines) or "(no messages at this step)"
        self.info.value = (f"<div style='font-family:monospace;font-size:12px'>{body}</div>")

    def figure(self, step: Optional[int] = None) -> go.Figure:
        """A static ``go.Figure`` of the current (or the given) step."""
        if step is None or self.recording is None:
            return go.Figure(self.fig)
        fig = go.Figure(self.fig)
        frame = collective_frame(self.recording, step, self.transpose.value)
        fig.data[0].update(frame["inputs"])
        fig.data[1].update(frame["state"])
        fig.layout.annotations = frame["annotations"]
        fig.update_layout(frame["layout"])
        return fig

    def __repr__(self) -> str:
        rec = self.recording
        what = f"{rec.op}/{rec.algorithm}, N={rec.world_size}" if rec else "no run"
        return f"CollectiveView({what}, step {self.step.value}/{self.step.max})"
