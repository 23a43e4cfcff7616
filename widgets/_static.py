"""Figures on display: :class:`LiveFigure` (a plotly figure that is also an ipywidget) and
the static-rendering mixin the views share (a plotly snapshot for nbval and saved notebooks).
"""
from __future__ import annotations

import contextlib
import json

import ipywidgets as W
import plotly.graph_objects as go

from . import _style as S
from ._inplace import InPlace

#: the mimetype plotly's JupyterLab extension renders (the notebook's own renderer)
PLOTLY_MIME = "application/vnd.plotly.v1+json"


class LiveFigure(go.Figure, W.Output):
    """A plotly ``go.Figure`` that is an ipywidget showing itself; every edit redraws it.

    The widget is an ``ipywidgets.Output`` whose one output is the figure as plotly's own
    mimetype (``application/vnd.plotly.v1+json``), drawn by the JupyterLab extension plotly
    ships for static figures. Every edit — ``fig.data[0].update(...)``,
    ``fig.layout.title.text = ...``, ``update_layout`` — sends the whole figure again in
    that one ``outputs`` trait; inside ``with fig.batch_update():`` the edits apply at once
    (in Python) and the figure is sent once, at the end. The opening state holds the figure.

    Why not ``go.FigureWidget``: plotly 7's FigureWidget is an anywidget whose front end
    evaluates plotly's 5 MB widget bundle once per figure, and anywidget gives a model two
    seconds to do that; past them it rejects the model's runtime and drops every later
    update message to it ("[anywidget] Failed to initialize model." in the browser
    console). The opening state still draws, so on a loaded machine a figure showed its
    first data and never changed again (in JupyterLab at a load of 17 on 2 cores, four
    FigureWidgets of six created together ignored every later restyle). ``ipywidgets.Output``
    has no such deadline, and its state is the whole figure, so the last edit always wins.

    Where the page allows it, a later figure is drawn in place instead (``Plotly.react`` on
    the plot already drawn, :mod:`._inplace`): the ``Output``'s second output is the small
    widget that does it; ``outputs`` follows in the kernel without being sent, so a page
    loaded later starts from the latest figure.

    Use it as a ``go.Figure`` (``.data``, ``.layout``, ``update_layout``, ``go.Figure(fig)``
    for a plain copy) and as a widget (a child of a ``VBox``). ``.layout`` is plotly's: like
    plotly's FigureWidget, this widget has no ipywidgets CSS layout.
    """

    def __init__(self, *args, **kwargs):
        self._live_hold, self._live_sent, self._defer_open = 0, None, True
        self._inplace = InPlace()
        super().__init__(*args, **kwargs)  # go.Figure's; it calls Widget.__init__ early
        self._defer_open = False
        self._redraw()
        self.open()

    def open(self) -> None:  # ipywidgets' Widget.open, once the figure is in the state
        if not getattr(self, "_defer_open", False):
            super().open()

    def _redraw(self) -> None:
        """Draw the figure as it stands in place, or put it into ``outputs`` (skipped when
        nothing changed)."""
        bundle = S.static_bundle(self)
        text = json.dumps(bundle, sort_keys=True)
        if text == self._live_sent:
            return
        self._live_sent = text
        title = self.layout.title.text or ""
        if self.inplace.can_draw():
            self.inplace.draw(bundle[PLOTLY_MIME])
            # the kernel's copy of the output follows too, without a message: this page
            # draws in place, and a page loaded later (a reload) starts from the latest
            self._trait_values["outputs"] = self._outputs(bundle, title)
            return
        self.inplace.replaced()  # a new generation: the new value is always sent
        self.outputs = self._outputs(bundle, title)

    def _outputs(self, bundle: dict, title: str) -> tuple:
        bundle = {**bundle, "text/plain": f"<LiveFigure {title.split('<')[0].strip()!r}>"}
        return ({"output_type": "display_data", "data": bundle, "metadata": {}},
                self.inplace.view_output())

    @property
    def inplace(self) -> InPlace:
        """The widget that draws later figures in place (:mod:`._inplace`)."""
        return self._inplace

    def shown(self) -> dict:
        """The plotly JSON on display (the output's, which follows in-place draws)."""
        return self.outputs[0]["data"][PLOTLY_MIME] if self.outputs else {}

    def _edited(self, *_args, **_kwargs) -> None:
        if not self._live_hold:
            self._redraw()

    # every edit of a go.Figure ends in one of these (no-ops in plotly's BaseFigure)
    _send_addTraces_msg = _send_moveTraces_msg = _send_deleteTraces_msg = _edited
    _send_restyle_msg = _send_relayout_msg = _send_update_msg = _send_animate_msg = _edited

    @contextlib.contextmanager
    def batch_update(self):
        """Edits inside apply at once (as outside); the figure is sent once, at the end.

        plotly's own batch mode defers the edits until the block ends, so a painter that
        reads back what it just set would read the old value; here only the redraw waits.
        """
        self._live_hold += 1
        try:
            yield self
        finally:
            self._live_hold -= 1
            if not self._live_hold:
                self._redraw()

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        # the live widget first; the plotly JSON is the fallback a saved notebook renders
        bundle = dict(S.static_bundle(self))
        bundle.update(W.Output._repr_mimebundle_(self, include=include, exclude=exclude,
                                                 **kwargs) or {})
        return bundle

    def _ipython_display_(self):
        from IPython.display import display

        display(self._repr_mimebundle_(), raw=True)


def live(fig: go.Figure) -> LiveFigure:
    """A :class:`LiveFigure` whose first state is ``fig`` as drawn now.

    Views draw their first run into a plain ``go.Figure`` and wrap it only then, so the
    figure travels in the state the widget is created with.
    """
    return LiveFigure(fig)


class StaticFigure:
    """Mixin for an ipywidgets container that owns one :class:`LiveFigure` as ``self.fig``.

    ``figure()`` returns a plain ``go.Figure`` copy (no widget, no kernel needed),
    ``static()`` displays it, and the rich display offers the plotly JSON beside the live
    widget view, so a notebook saved without widget state still shows the figure.
    """

    def figure(self) -> go.Figure:
        """A plain ``go.Figure`` snapshot of what is on display."""
        return go.Figure(self.fig)

    def static(self, *args, **kwargs) -> None:
        """Display :meth:`figure` (arguments pass through to it)."""
        from IPython.display import display

        display(self.figure(*args, **kwargs))

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        # live widget first; the plotly JSON is the fallback a saved notebook can render
        bundle = dict(S.static_bundle(self.fig))
        bundle.update(super()._repr_mimebundle_(include=include, exclude=exclude,
                                                **kwargs) or {})
        bundle.setdefault("text/plain", repr(self))
        return bundle
