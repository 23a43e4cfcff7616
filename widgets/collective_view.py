"""``CollectiveView``: watch a collective move chunks, step by step, from a real run.

Pick the op, the algorithm and N; the view runs it on the warm cluster
(``labkit.collectives.jobs.collective`` with ``nranks=N``) and draws the per-step records
the ranks returned (:class:`labkit.collectives.record.Recording`) — never a scripted
animation. Each rank is a row; each chunk of its buffer a cell showing its values. The
left block is what each rank started with, the right block what it holds after the
selected step; arrows are the messages of that step. Cell colour counts how many ranks'
inputs are reduced into the chunk (partial sums darken until complete), or, for
all-to-all, which rank the chunk came from — so the transpose shows as colour: input rows
become output columns. Play/step controls walk the steps; ``figure()`` is a static
snapshot for nbval and saved notebooks.
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

__all__ = ["CollectiveView", "collective_frame"]

_PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2",
            "#9D755D"]
_EMPTY = "—"


#: the collectives whose messages are reduced into their destination
REDUCING = ("all_reduce", "reduce_scatter", "reduce")


def _text(cell) -> str:
    if cell is None:
        return _EMPTY
    vals = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in cell[:4]]
    return ", ".join(vals) + (", …" if len(cell) > 4 else "")


def _origin_scale(n: int) -> list:
    """A stepwise colour scale: value r (0 … n−1) gets palette colour r."""
    scale = []
    for r in range(n):
        c = _PALETTE[r % len(_PALETTE)]
        scale += [[r / n, c], [(r + 1) / n, c]]
    return scale


def arrow_offsets(segments: list, width: float = 0.7) -> list:
    """Horizontal offsets (in chunk columns) that keep vertical arrows apart.

    ``segments`` are ``(x0, y0, x1, y1)``. Arrows inside one column (``x0 == x1``) whose
    row spans overlap — 0→2 beside 1→3 in a binomial tree or recursive doubling, or the
    two directions of one exchange — would be drawn on top of each other; each gets its
    own lane, the lanes spread over ``width`` of the column. Other arrows stay centred.
    """
    out = [0.0] * len(segments)
    columns: dict = {}
    for i, (x0, y0, x1, y1) in enumerate(segments):
        if x0 == x1:
            columns.setdefault(x0, []).append(i)
    for idx in columns.values():
        lanes: list = []  # per lane: the (lo, hi) row spans already in it
        lane_of = {}
        for i in sorted(idx, key=lambda i: (min(segments[i][1], segments[i][3]),
                                            segments[i][1])):
            lo, hi = sorted((segments[i][1], segments[i][3]))
            for k, spans in enumerate(lanes):
                if all(hi <= a or lo >= b for a, b in spans):
                    spans.append((lo, hi))
                    lane_of[i] = k
                    break
            else:
                lanes.append([(lo, hi)])
                lane_of[i] = len(lanes) - 1
        if len(lanes) > 1:
            gap = width / (len(lanes) - 1)
            for i, k in lane_of.items():
                out[i] = -width / 2 + k * gap
    return out


def collective_frame(rec: Recording, step: int, transpose: bool = False) -> dict:
    """Everything drawn for ``step`` of ``rec``, as plain data (cheap to test).

    Returns ``{"inputs": {x, y, z, text}, "state": {x, y, z, text}, "annotations",
    "layout"}``: the two heatmaps (left: inputs; right: after ``step``), one arrow per
    move of the step, and the layout (title, colour axis, axis ticks, height).
    ``transpose`` draws the last step with no arrows (the all-to-all transpose view).
    """
    n, c = rec.world_size, rec.n_chunks
    step = rec.steps if transpose else max(0, min(step, rec.steps))
    a2a = rec.separate_output
    x_in, x_out = list(range(c)), [c + 1 + i for i in range(c)]
    contrib = rec.contributors(step)

    def z_of(ctb, r):
        if ctb is None:
            return None
        return ctb[0] if a2a else len(ctb)

    inputs = {"x": x_in, "y": list(range(n)),
              "z": [[(r if a2a else 1) if v is not None else None for v in rec.inputs[r]]
                    for r in range(n)],
              "text": [[_text(v) for v in rec.inputs[r]] for r in range(n)]}
    state = {"x": x_out, "y": list(range(n)),
             "z": [[z_of(contrib[r][i], r) for i in range(c)] for r in range(n)],
             "text": [[_text(v) for v in rec.snapshots[step][r]] for r in range(n)]}
    arrows = []
    moves = [m for m in ([] if transpose else rec.moves_at(step)) if m.kind != "local"]
    ends = [((x_in[m.src_chunk] if m.from_input else x_out[m.src_chunk]), x_out[m.chunk])
            for m in moves]
    shift = arrow_offsets([(ax, m.src, x, m.dst) for m, (ax, x) in zip(moves, ends)])
    for m, (ax, x), dx in zip(moves, ends, shift):
        arrows.append(dict(x=x + dx, y=m.dst, ax=ax + dx, ay=m.src, xref="x", yref="y",
                           axref="x", ayref="y", showarrow=True, arrowhead=3, arrowsize=1.3,
                           arrowwidth=2, standoff=10, startstandoff=10, text="",
                           arrowcolor="#C0392B" if m.kind == "reduce" else "#333333"))
    phase = rec.phases[step] if step < len(rec.phases) else ""
    right = "output (final)" if transpose else f"after step {step}"
    labels = [dict(x=(c - 1) / 2, y=-0.75, text="<b>inputs</b>", showarrow=False,
                   xref="x", yref="y"),
              dict(x=c + 1 + (c - 1) / 2, y=-0.75, text=f"<b>{right}</b>", showarrow=False,
                   xref="x", yref="y")]
    if a2a:
        what = ("colour = source rank · output[r][i] = input[i][r] (a transpose)"
                if transpose else "colour = source rank")
        cax = dict(colorscale=_origin_scale(n), cmin=0, cmax=n,
                   colorbar=dict(title="from rank", tickvals=[r + 0.5 for r in range(n)],
                                 ticktext=[str(r) for r in range(n)]))
    else:
        what = ("colour = ranks reduced into the chunk" if rec.op in REDUCING else
                "colour = ranks whose input the chunk holds (1: a copy)")
        cax = dict(colorscale="Blues", cmin=0, cmax=max(n, 1),
                   colorbar=dict(title="ranks in it", tickvals=list(range(1, n + 1)),
                                 ticktext=[str(k) for k in range(1, n + 1)]))
    if a2a:  # a2a z values are ranks 0 … n−1; centre each in its colour band
        inputs["z"] = [[None if v is None else v + 0.5 for v in row] for row in inputs["z"]]
        state["z"] = [[None if v is None else v + 0.5 for v in row] for row in state["z"]]
    key = ("red = reduced into the destination" if rec.op in REDUCING
           else "copies, nothing is reduced")
    title = (f"{rec.op} · {rec.algorithm} · N={n} · step {step}/{rec.steps}"
             f"{' · ' + phase if phase else ''}<br><sup>{what}; arrows: messages of this "
             f"step ({key})</sup>")
    ticks = x_in + x_out
    layout = {"title.text": title, "coloraxis": cax,
              "xaxis.tickvals": ticks, "xaxis.ticktext": [f"chunk {i}" for i in range(c)] * 2,
              "xaxis.range": [-0.6, 2 * c + 0.6],
              "yaxis.tickvals": list(range(n)), "yaxis.ticktext": [f"rank {r}" for r in range(n)],
              "yaxis.range": [n - 0.5, -1.2], "height": 190 + 46 * n}
    return {"inputs": inputs, "state": state, "annotations": labels + arrows, "layout": layout}


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
