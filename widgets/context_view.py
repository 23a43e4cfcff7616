"""``ContextParallelView``: context-parallel attention replayed from a run's recorded events.

Pick the method (all-gather K/V, Ulysses, ring), ``cp``, the split (zigzag or contiguous) and
the mask; the view runs one attention forward and backward on the warm cluster
(:func:`labkit.parallel.context.jobs.attention_job`) and steps through what the ranks
recorded — never a scripted animation:

* **who holds what** (top left): step 0 is the split, the sequence chunks each rank holds.
  For the ring, each step shows the K/V block each rank held (colour = the rank it came
  from: the stripes rotate); for all-gather, every chunk after the gather. For Ulysses the
  rows are head groups: sequence-sharded is vertical stripes, and each all-to-all turns them
  into horizontal ones (head-sharded) and back.
* **mask blocks** (top right): the query-chunk × key-chunk grid of causal attention, filled as
  ranks compute it (colour = the rank, ``F`` full, ``D`` diagonal, ``×`` skipped).
* **work** (bottom): unmasked query–key pairs per rank so far, from the ranks' traced
  regions, beside the closed form for the whole pass (diamonds).

Every step is one recorded event per rank: a ``cp.<method>.<phase>`` compute region (its args
name the blocks and the K/V held) or a collective on the ``cp`` axis. ``.figure()`` is a static
snapshot (nbval, saved notebooks).
"""
from __future__ import annotations

import html
from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.parallel.context import METHODS, chunk_ids, jobs
from labkit.parallel.context.report import attention_report

from . import _style as S
from ._static import StaticFigure, live
from .context_frames import color_scale, context_frame, context_frames

__all__ = ["ContextParallelView"]


def _base_figure() -> go.Figure:
    fig = make_subplots(rows=2, cols=2, specs=[[{}, {}], [{"colspan": 2}, None]],
                        row_heights=[0.62, 0.38], vertical_spacing=0.16, horizontal_spacing=0.1,
                        subplot_titles=("who holds what", "mask blocks computed (query × key)",
                                        "work: unmasked query–key pairs × batch × heads"))
    common = dict(coloraxis="coloraxis", xgap=2, ygap=2, texttemplate="%{text}",
                  textfont=dict(size=11), hoverinfo="text", x=[], y=[], z=[], text=[])
    fig.add_trace(go.Heatmap(name="holders", **common), row=1, col=1)
    fig.add_trace(go.Heatmap(name="mask", **common), row=1, col=2)
    fig.add_trace(go.Bar(name="measured so far", x=[], y=[], marker_color="#4C78A8"),
                  row=2, col=1)
    fig.add_trace(go.Scatter(name="closed form (whole pass)", mode="markers", x=[], y=[],
                             marker=dict(symbol="diamond", size=12, color="#C0392B")),
                  row=2, col=1)
    fig.update_layout(template="plotly_white", height=560, margin=dict(l=70, r=20, t=80, b=40),
                      title=dict(text="no run yet", font_size=14), plot_bgcolor="#EEEEEE",
                      legend=dict(orientation="h", y=-0.08))
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=2)
    return live(fig)


class ContextParallelView(StaticFigure, W.VBox):
    """Controls + one ``LiveFigure`` replaying a context-parallel attention run.

    The problem stays fixed while the controls move: every re-run attends the same
    ``seq_len`` tokens with the same heads (``batch`` sequences, ``n_heads`` query and
    ``n_kv_heads`` key/value heads of size ``head_dim``), so moving ``cp`` changes only how
    the sequence is split, as context parallelism does. :meth:`update` takes the shape of
    the run it shows, so a re-run at the shown settings reproduces its numbers. ``cp`` offers
    the degrees that split that shape for every method: ``2·cp`` chunks dividing ``S``
    (zigzag) and ``cp`` dividing both head counts (Ulysses). The title and the status line
    name ``S`` and the heads.

    Args:
        cluster: a warm :class:`labkit.Cluster` (``None``: show runs passed to
            :meth:`update` only).
        method, cp, zigzag, causal: the first run (``cp`` defaults to the cluster's size).
        run: run at once (default: when a cluster is given).
        seq_len, n_heads, n_kv_heads, head_dim, batch: the attention problem (global
            shapes), fixed across re-runs; the defaults are notebook 07's §4 call.

    Raises:
        ValueError: a given ``cp`` that does not split the problem (or exceeds the cluster).

    Attributes:
        method, cp, zigzag, causal, phase, step, play: the controls (ipywidgets).
        fig: the ``LiveFigure``; result: the last ``RunResult``; report: its
            :func:`labkit.parallel.context.report.attention_report`; frames: its steps.
    """

    def __init__(self, cluster=None, method: str = "ring", cp: Optional[int] = None,
                 zigzag: bool = True, causal: bool = True, run: Optional[bool] = None,
                 seq_len: int = 512, n_heads: int = 4, n_kv_heads: int = 4, head_dim: int = 16,
                 batch: int = 1):
        super().__init__()
        self.cluster, self.result, self.report, self.frames = cluster, None, None, []
        self._quiet = False
        self.shape = dict(batch=batch, n_heads=n_heads, n_kv_heads=n_kv_heads,
                          seq_len=seq_len, head_dim=head_dim, seed=0)
        top = cluster.world_size if cluster is not None else 8
        degrees = self._degrees(top)
        if cp is not None and cp not in degrees:
            raise ValueError(f"cp={cp} does not split S={seq_len}, {n_heads} heads, "
                             f"{n_kv_heads} K/V heads on {top} ranks: choose one of {degrees}")
        self.method = W.Dropdown(options=list(METHODS), value=method, description="method",
                                 tooltip="how the ranks share K/V: all-gather, Ulysses "
                                         "(all-to-all) or ring",
                                 layout=W.Layout(width="200px"))
        self.cp = W.SelectionSlider(options=degrees, value=cp or degrees[-1], description="cp",
                                    tooltip="ranks sharing the sequence (context-parallel "
                                            "degree); the sequence and heads stay fixed",
                                    continuous_update=False, layout=W.Layout(width="220px"),
                                    style={"description_width": "initial"})
        self.zigzag = W.Checkbox(value=zigzag, description="zigzag", indent=False,
                                 tooltip="zigzag chunk order: every rank gets an early and a "
                                         "late chunk (balanced causal work)",
                                 layout=W.Layout(width="90px"))
        self.causal = W.Checkbox(value=causal, description="causal", indent=False,
                                 tooltip="causal mask (blocks above the diagonal skipped)",
                                 layout=W.Layout(width="90px"))
        self.phase = W.ToggleButtons(options=["forward", "backward"], value="forward")
        self.step = W.IntSlider(value=0, min=0, max=0, description="step",
                                tooltip="step of the replay to show",
                                continuous_update=False, layout=W.Layout(width="320px"))
        self.play = W.Play(value=0, min=0, max=0, interval=900, description="play",
                           tooltip="play the replay")
        W.link((self.play, "value"), (self.step, "value"))
        W.link((self.play, "max"), (self.step, "max"))
        self.status, self.info = W.HTML(), W.HTML()
        self.fig = _base_figure()
        for w in (self.method, self.cp, self.zigzag, self.causal):
            w.observe(lambda _c: None if self._quiet else self.rerun(), names="value")
        self.phase.observe(lambda _c: self._load_frames(), names="value")
        self.step.observe(lambda _c: self._redraw(), names="value")
        self.children = [W.HBox([self.method, self.cp, self.zigzag, self.causal]),
                         W.HBox([self.phase, self.play, self.step]), self.status, self.fig,
                         self.info]
        if run if run is not None else cluster is not None:
            self.rerun()

    def _degrees(self, top: int) -> list:
        """The cp degrees (at most ``top``) that split the fixed problem for every method."""
        sh = self.shape
        return [c for c in range(1, max(top, 1) + 1) if sh["seq_len"] % (2 * c) == 0
                and sh["n_heads"] % c == 0 and sh["n_kv_heads"] % c == 0]

    def problem(self) -> str:
        """The fixed attention problem in words: ``"S = 512, 4 heads (4 K/V) of 16, B = 1"``."""
        sh = self.shape
        return (f"S = {sh['seq_len']}, {sh['n_heads']} heads ({sh['n_kv_heads']} K/V) of "
                f"{sh['head_dim']}, B = {sh['batch']}")

    def set(self, **values) -> "ContextParallelView":
        """Set several of ``method``, ``cp``, ``zigzag``, ``causal`` with one re-run, then
        ``phase`` and ``step``."""
        self._quiet = True
        try:
            for k in ("method", "cp", "zigzag", "causal"):
                if k in values:
                    getattr(self, k).value = values[k]
        finally:
            self._quiet = False
        if {"method", "cp", "zigzag", "causal"} & set(values):
            self.rerun()
        if "phase" in values:
            self.phase.value = values["phase"]
        if "step" in values:
            self.step.value = values["step"]
        return self

    def rerun(self) -> None:
        """Run one attention forward and backward with the chosen settings on the cluster."""
        if self.cluster is None:
            self.status.value = S.status_html("no cluster: pass one to ContextParallelView(...)"
                                              " or show a run with update()", "error")
            return
        cp = self.cp.value
        case = jobs.AttentionCase(method=self.method.value, cp=cp, zigzag=self.zigzag.value,
                                  causal=self.causal.value, **self.shape)
        self.status.value = S.status_html(f"running {case.method} on {cp} ranks …", "busy")
        try:
            result = jobs.run(self.cluster, case)
        except Exception as exc:  # noqa: BLE001 - shown in the widget, not raised
            self.status.value = S.status_html(f"{type(exc).__name__}: {exc}", "error")
            return
        self.update(result)

    def update(self, result) -> "ContextParallelView":
        """Show a ``RunResult`` of :func:`labkit.parallel.context.jobs.attention_job`; its
        shape becomes the fixed problem of later re-runs and the controls show its settings."""
        self.result, self.report = result, attention_report(result)
        case = result.config
        self.shape = dict(batch=case.batch, n_heads=case.n_heads, n_kv_heads=case.n_kv_heads,
                          seq_len=case.seq_len, head_dim=case.head_dim, seed=case.seed)
        self._quiet = True
        try:
            top = self.cluster.world_size if self.cluster is not None else 8
            self.cp.options = sorted(set(self._degrees(top)) | {self.report["cp"]})
            self.cp.value = self.report["cp"]
            self.method.value, self.zigzag.value = case.method, case.zigzag
            self.causal.value = case.causal
        finally:
            self._quiet = False
        self.status.value = S.status_html(self._summary(), "ok")
        self._load_frames()
        return self

    def _load_frames(self) -> None:
        if self.result is None:
            return
        self.frames = context_frames(self.result, self.phase.value)
        self._quiet = True
        try:
            self.step.max = len(self.frames) - 1
            self.step.value = 0
        finally:
            self._quiet = False
        self._redraw()

    def _summary(self) -> str:
        rep = self.report
        sent = ", ".join(S.fmt_bytes(b["forward"] + b["backward"]) for b in rep["bytes"])
        exact = "= formula" if rep["bytes"] == rep["bytes_formula"] else "≠ formula!"
        work = "= closed form" if rep["work"] == rep["work_formula"] else "≠ closed form!"
        split = "zigzag" if rep["zigzag"] else "contiguous"
        line = (f"{rep['method']} · cp={rep['cp']} · {self.problem()} · {split}"
                f" · {'causal' if rep['causal'] else 'no mask'} · sent per rank [{sent}] {exact}"
                f" · work {work}, imbalance {rep['imbalance']:.3f}")
        if rep["cp"] == 1:  # one rank holds the whole sequence: no ring, nothing to hide
            line += " · cp=1: no communication (one rank holds every key and value)"
        elif rep["overlap"]:
            hid = sum(o["forward"] for o in rep["overlap"]) / len(rep["overlap"])
            line += f" · ring send/recv hidden under compute (forward): {hid:.0%}"
        return line

    def _draw_into(self, fig, i: int) -> None:
        case = self.result.config
        cp = self.report["cp"]
        chunks = tuple(chunk_ids(r, cp, case.zigzag) for r in range(cp))
        fr = context_frame(self.frames, i, case.method, cp, chunks, self.report["work_formula"])
        fig.data[0].update(fr["holders"])
        fig.data[1].update(fr["mask"])
        fig.data[2].update(fr["work"])
        fig.data[3].update(fr["formula"])
        fig.update_layout(title_text=f"{case.method} · cp={cp} · {self.problem()} · "
                                     f"{self.phase.value}<br>{fr['title']}",
                          coloraxis=dict(colorscale=color_scale(cp), cmin=0, cmax=cp + 1,
                                         colorbar=dict(title="rank", tickvals=[
                                             r + 0.5 for r in range(cp + 1)],
                                             ticktext=[str(r) for r in range(cp)] + ["all"])))

    def _redraw(self) -> None:
        if self._quiet or not self.frames:
            return
        i = min(self.step.value, len(self.frames) - 1)
        with self.fig.batch_update():
            self._draw_into(self.fig, i)
        self.info.value = self._messages(i)

    def _messages(self, i: int) -> str:
        """The step's communication from the trace: for the ring, the messages posted
        before its computation; otherwise the collective itself."""
        f = self.frames[i]
        lines = []
        for r, e in sorted(f["ranks"].items()):
            if f["event"] == "compute" and "ring_step" in e.args:
                for m in self.result.trace.events:
                    if m.rank == e.rank and m.cat == "p2p" and m.op == "send" \
                            and m.args.get("ring_step") == e.args["ring_step"] \
                            and m.args.get("phase") == self.phase.value:
                        lines.append(f"rank {r} → global rank {m.peers[0]}: "
                                     f"{m.args.get('what')} {S.fmt_bytes(m.bytes_sent)}")
            elif f["event"] != "compute":
                lines.append(f"rank {r}: {e.op} sent {S.fmt_bytes(e.bytes_sent)}")
        body = "<br>".join(html.escape(x) for x in lines) or "(no messages at this step)"
        return f"<div style='font-family:monospace;font-size:12px'>{body}</div>"

    def figure(self, step: Optional[int] = None) -> go.Figure:
        """A static ``go.Figure`` of the current (or the given) step."""
        fig = go.Figure(self.fig)
        if step is not None and self.frames:
            self._draw_into(fig, min(step, len(self.frames) - 1))
        return fig

    def __repr__(self) -> str:
        what = (f"{self.report['method']}, cp={self.report['cp']}" if self.report else "no run")
        return f"ContextParallelView({what}, step {self.step.value}/{self.step.max})"

