"""Static rendering shared by the views: a plotly snapshot for nbval and saved notebooks."""
from __future__ import annotations

import contextlib

import plotly.graph_objects as go

from . import _style as S


class LiveFigure(go.FigureWidget):
    """A ``go.FigureWidget`` whose widget opens with its figure in the opening state.

    plotly's ``BaseFigureWidget.__init__`` opens the widget (the comm to the browser) before
    it sets ``_widget_data`` and ``_widget_layout``, so the figure reaches the browser as an
    update after an empty opening state. plotly's front end applies updates in listeners it
    registers once its module has loaded, so an update that arrives before is dropped and
    the browser draws empty axes (seen in JupyterLab for about half the figures of a cell
    showing several). Here the widget opens only after ``__init__``: the opening state
    holds the figure.
    """

    def __init__(self, *args, **kwargs):
        self._defer_open = True
        super().__init__(*args, **kwargs)
        self._defer_open = False
        self.open()

    def open(self) -> None:  # ipywidgets' Widget.open, once the figure is in the state
        if not getattr(self, "_defer_open", False):
            super().open()

    @contextlib.contextmanager
    def batch_update(self):
        """Edits go out one by one, as restyle and relayout messages, never batched.

        plotly's ``batch_update`` sends one ``Plotly.update`` message; plotly 7's front end
        (JupyterLab 4, anywidget) does not apply it, while it applies restyle and relayout:
        a batched redraw left the browser's figure unchanged. Callers keep their ``with
        fig.batch_update():`` blocks, so batching returns when the front end applies it.
        """
        yield self


def live(fig: go.Figure) -> go.FigureWidget:
    """A widget (:class:`LiveFigure`) whose first state is ``fig`` as drawn now.

    Views draw their first run into a plain ``go.Figure`` and wrap it only then, so the data
    travels in the state the widget is created with; later edits go to a browser that has
    drawn the figure.
    """
    return LiveFigure(fig)


class StaticFigure:
    """Mixin for an ipywidgets container that owns one ``go.FigureWidget`` as ``self.fig``.

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
