"""Static rendering shared by the views: a plotly snapshot for nbval and saved notebooks."""
from __future__ import annotations

import plotly.graph_objects as go

from . import _style as S


def live(fig: go.Figure) -> go.FigureWidget:
    """A ``FigureWidget`` whose first state is ``fig`` as drawn now.

    Views draw their first run into a plain ``go.Figure`` and wrap it only then, so the data
    travels in the state the widget is created with. plotly's front end applies later edits
    in listeners it registers when its module has loaded, and edits that reach the browser
    before that are not applied to the figure it first draws.
    """
    return go.FigureWidget(fig)


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
