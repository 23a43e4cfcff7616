"""``TimelineView``: what every rank did, when — compute and communication side by side.

Each rank gets a row: compute spans (forward, backward, optimizer, other) on the row itself
and collectives (all-reduce, all-gather, …) on a thinner lane just below it, so a gradient
all-reduce running under backward shows as two overlapping bars. Point-to-point calls
(a pipeline's send/recv) get a third lane, "p2p", when the run has any: an asynchronous send
spans from its issue to its completion, often the whole step, and on the collectives' lane
it covered the tensor-parallel all-gathers and reduce-scatters it overlapped. Time the
compute thread sat *blocked* on a collective (trace events of category ``"wait"``, e.g.
FSDP issuing or waiting for an all-gather, :mod:`labkit.parallel.zero.fsdp`) is drawn as a
narrower dark "blocked" bar on top of the compute row: the part of the span not hidden.
Times are milliseconds from the run's first event (``trace.t0``). Hovering a bar shows its
name, step, op, axis and group (the group's ranks, or the peer of a send/recv), the
algorithmic bytes it sent and received, and its duration. A call left in flight (bucketed
DDP's all-reduces, a pipeline's sends) is drawn as a faint thin line from its issue to the
return of its ``wait()`` and, over it, a bar of its own: a collective from the lane's
previous completion to the backend's, a send/recv (no completion time on gloo) hatched
over the time its caller waited (:func:`_drawn_spans`); its hover gives issue, finish and
wait times. Consecutive
calls in one communication lane alternate in shade, so twenty back-to-back all-reduces read
as twenty bars, not one. A call that tagged where in the model it ran (tensor parallelism
tags ``layer``, ``site`` and ``phase``) is labelled on its bar, ``L0``, ``L1`` … (or its
site, e.g. ``emb``, ``loss``), so a layer's collectives can be counted by eye; labels that
do not fit their bar are hidden.

The step selector shows one step at a time; the title gives that step's own length (first
start to last end of its events). A step the job flagged as instrumented
(:func:`labkit.trace.flag_step`; the memory tracker flags the step it measures, which runs
several times slower) is shaded and labelled in the figure and named in the selector, so
its long spans are not mistaken for the step time.

The figure has a fixed set of traces — one per compute family and one per comm op family —
whatever the run, so thousands of events cost a few arrays, not thousands of traces, and
an update is a data swap inside one ``batch_update()``.
"""
from __future__ import annotations

from typing import Optional, Union

import ipywidgets as W
import plotly.graph_objects as go

from labkit.trace import Trace

from ._static import StaticFigure, live

__all__ = ["TimelineView", "timeline_traces", "ALL_STEPS"]

from .timeline_traces import (  # noqa: F401  (moved; importable from here as before)
    ALL_STEPS, _ALT_OPACITY, COMM_OFFSET, P2P_OFFSET, P2P_PITCH, _COMPUTE_WIDTH, _COMM_WIDTH,
    _BLOCKED_WIDTH, _P2P_WIDTH, _MARGINS, BLOCKED_CATS, _COMPUTE_HOVER, _COMM_HOVER,
    _BLOCKED_HOVER, _INFLIGHT_WIDTH, _INFLIGHT_OPACITY, _INFLIGHT_HOVER, _FAMILIES,
    _empty_traces, _where, _group, _ms, _drawn_spans, _inflight_text, _family, _legend_height,
    timeline_traces, _alternating, _title, _ranks, _base_layout)


class TimelineView(StaticFigure, W.VBox):
    """A per-rank timeline of one run's recorded events, with a step selector.

    Args:
        result: a :class:`labkit.RunResult` (or a bare :class:`labkit.trace.Trace`);
            ``None`` starts empty.

    Attributes:
        fig: the ``LiveFigure`` (updated in place, inside ``batch_update()``).
        step_selector: ``ipywidgets.Dropdown`` — :data:`ALL_STEPS` (``"all"``) for all
            steps, else a step index; :attr:`step` gives ``None`` for all steps.
        result: the run on display.

    The view is itself an ``ipywidgets.VBox`` (selector above figure): display it.
    """

    def __init__(self, result=None, **kwargs):
        super().__init__(**kwargs)
        self.result = None
        self._trace = Trace()
        self._quiet = False
        self.step_selector = W.Dropdown(options=[("all steps", ALL_STEPS)], value=ALL_STEPS,
                                        description="step", tooltip="show one training step",
                                        style={"description_width": "40px"},
                                        layout=W.Layout(width="280px"))
        self.fig = go.Figure(data=_empty_traces(), layout=_base_layout())
        self.step_selector.observe(self._on_step, names="value")
        if result is not None:
            self.update(result)
        self.fig = live(self.fig)  # the widget starts from the drawn figure
        self.children = [self.step_selector, self.fig]

    # -- data in -------------------------------------------------------------------
    def update(self, result: Union["object", Trace]) -> "TimelineView":
        """Show another run (``RunResult`` or ``Trace``); keeps the selected step if present."""
        self.result = result
        self._trace = result if isinstance(result, Trace) else getattr(result, "trace", Trace())
        steps = sorted({e.step for e in self._trace.events if e.step >= 0})
        flagged = self._trace.instrumented_steps()
        keep = self.step_selector.value if self.step_selector.value in steps else ALL_STEPS
        self._quiet = True
        try:
            self.step_selector.options = [("all steps", ALL_STEPS)] + [
                (f"step {s}" + (f" ({flagged[s]}-tracked)" if s in flagged else ""), s)
                for s in steps]
            self.step_selector.value = keep
        finally:
            self._quiet = False
        self._redraw()
        return self

    @property
    def step(self) -> Optional[int]:
        """The selected step (``None`` = all)."""
        v = self.step_selector.value
        return None if v == ALL_STEPS else v

    @step.setter
    def step(self, value: Optional[int]) -> None:
        self.step_selector.value = ALL_STEPS if value is None else value

    def _on_step(self, _change) -> None:
        if not self._quiet:
            self._redraw()

    def _redraw(self) -> None:
        cols, layout = timeline_traces(self._trace, self.step)
        shapes, notes = layout.pop("shapes"), layout.pop("annotations")
        with self.fig.batch_update():
            for tr, col in zip(self.fig.data, cols):
                tr.update(col)
            self.fig.update_layout(layout)
            self.fig.layout.shapes, self.fig.layout.annotations = shapes, notes  # replace all

    def __repr__(self) -> str:
        return f"TimelineView({self._trace!r}, step={self.step})"
