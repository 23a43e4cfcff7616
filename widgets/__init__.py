"""labkit_widgets: ipywidgets + plotly views of labkit runs.

* :class:`PipelineView` — a pipeline run's per-rank Gantt chart and bubbles, beside the
  simulated schedule.
* :class:`TimelineView` — per-rank compute/communication timeline of a ``RunResult``.
* :class:`CheckpointView` — an activation-checkpointing schedule, step by step, with its
  memory curve.
* :class:`CollectiveView` — a collective's recorded chunk movements, step by step.
* :class:`ContextParallelView` — context-parallel attention (all-gather, Ulysses, ring)
  replayed from the trace: the chunks each rank holds, the K/V blocks, the mask blocks, the
  work per rank.
* :class:`ExpertView` — tokens per expert per rank of an expert-parallel run, and its
  dispatch/combine all-to-alls replayed from the trace.
* :mod:`.snapshot_view` — a resumed run's resharding (which saved rank's file feeds which
  new rank, by bytes), its losses over the uninterrupted run's, bytes and seconds per rank.
* :class:`Explorer` — data-parallel, ZeRO and pipeline knobs that re-run training on a
  warm ``Cluster`` and show measured memory, MFU, communication and the pipeline bubble
  beside the formulas and the simulator.

Each view is an ``ipywidgets.VBox`` around plotly figures that are widgets
(:class:`~labkit_widgets._static.LiveFigure`), updated in one ``batch_update()`` per
change; ``.figure()`` returns a static ``go.Figure`` snapshot and ``.static()`` displays it
(for nbval and saved notebooks). Dependencies point one way: these widgets import labkit,
labkit never imports them.
"""
from .checkpoint_view import CheckpointView
from .collective_view import CollectiveView
from .context_view import ContextParallelView
from .expert_view import ExpertView
from .explorer import Explorer
from .pipeline_view import PipelineView
from .timeline import TimelineView

__all__ = ["CheckpointView", "CollectiveView", "ContextParallelView", "ExpertView", "Explorer",
           "PipelineView", "TimelineView"]
