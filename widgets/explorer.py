"""``Explorer``: every degree and knob of one ``RunConfig``; a release re-runs the training job.

One control per field (:mod:`labkit_widgets.explorer_controls`; a change's path to a run
is :mod:`labkit_widgets.explorer_changes`'): dp, micro-batch, ZeRO stage, HSDP replicas,
prefetch, gradient sync, DDP bucket, pp, schedule, microbatches, virtual stages, recompute,
precision, tp, sequence parallel, cp, cp method, zigzag, ep.
Each control offers only the values ``RunConfig.validate`` accepts from where the others
stand; the rest are listed under the controls with validate's reason, and a knob that has
no effect now (prefetch below ZeRO-3, the schedule at pp = 1 …) is greyed, keeping its
value for when it applies again. No control is moved behind the user's back; the one
adjustment the explorer makes, deepening a model shallower than its pipeline stages, is
said in the status line.

Every change re-runs :func:`labkit.jobs.train` on the warm cluster — a real run — and
redraws every figure in one ``batch_update()`` (:mod:`~labkit_widgets.explorer_figures`,
:mod:`~labkit_widgets.explorer_pipeline`): memory per rank by category (at the peak,
model state measured and predicted), the MFU gauge with HFU and step time, bytes per rank
by axis and collective beside the formula, the pipeline bubble measured beside simulated,
the per-rank timeline, and a history row. Beside them, the **planned** panel
(:mod:`~labkit_widgets.explorer_planned`) scales the same layout to a real model and cluster
and shows :mod:`labkit.plan`'s memory, step time, bubble and MFU: a formula, redrawn at each
accepted change before the ranks run.

The interactive re-run is lean: at most ``max_steps`` steps (a warm-up step, a timed one,
the memory-tracked one), and a configuration already measured runs only the warm-up and the
timed step and shows the memory it measured then (memory by category is exact bytes, the
same every run; the figure names the run it came from). FLOP counts and the CPU peak are
cached by the job itself. The timeline shows the timed step(s): the warm-up step pays
one-off allocation and the memory-tracked step runs several times slower.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go

from labkit.config import RunConfig

from . import _style as S
from . import explorer_controls as C
from . import explorer_figures as F
from . import explorer_pipeline as P
from .explorer_changes import ExplorerChanges
from .explorer_planned import PlannedPanel
from ._static import live
from .timeline import TimelineView

__all__ = ["Explorer", "STARTING"]

#: the status while a run waits for rank processes to start
STARTING = "starting ranks… (a fresh pool imports torch on every rank: a few seconds, once)"


class Explorer(ExplorerChanges, W.VBox):
    """Training with every degree and knob of a ``RunConfig``, re-run at each change.

    Args:
        cluster: a warm :class:`labkit.Cluster` (anything with ``world_size`` and
            ``run(job, config)``). A cluster replaced by a newer one of the same kind is
            followed (see :meth:`_live_cluster`).
        base_config: where every field starts (default ``RunConfig()``: the tiny GPT,
            global batch 8, 3 steps, dp = the largest divisor of the batch that fits the
            cluster).
        job: what runs; default :func:`labkit.jobs.train`.
        run_now: run the starting configuration at construction.
        timeline: show the run's per-rank timeline.
        max_steps: the most steps a re-run trains (``None``: the base config's).

    Attributes:
        controls: dict name → widget, one per name in
            :data:`labkit_widgets.explorer_controls.NAMES`.
        values: the controls' values (``"auto"`` = the field's ``None``).
        figures: dict name → ``LiveFigure`` (a ``go.Figure`` that is a widget): ``memory``,
            ``mfu``, ``comm``, ``bubble`` and (with ``timeline``) ``timeline``.
        status: the status line (``ipywidgets.HTML``; errors in red).
        planned: the :class:`~labkit_widgets.explorer_planned.PlannedPanel` (the layout on
            a real model and cluster, by the planner).
        unavailable: the note listing values validate refuses now, with its reasons.
        history: one dict per successful run, oldest first
            (:func:`~labkit_widgets.explorer_figures.summarize` plus ``run``,
            ``latency_s``, ``config``).
        last_result: the latest ``RunResult``; ``last_metrics`` the per-rank metrics the
            figures show (memory possibly from an earlier run of the same configuration);
            ``last_error`` the latest exception or ``None``; ``last_latency_s`` seconds
            from the kernel receiving the change to the figures' new values sent to the
            page (the browser's drawing comes after: benchmarks/browser_slider_latency.py).
    """

    def __init__(self, cluster, base_config: Optional[RunConfig] = None, *, job=None,
                 run_now: bool = True, timeline: bool = True, max_steps: Optional[int] = 3,
                 **kwargs):
        super().__init__(**kwargs)
        if job is None:
            from labkit import jobs

            job = jobs.train
        self.cluster, self.job, self.max_steps = cluster, job, max_steps
        ws = cluster.world_size
        if base_config is None:  # the whole cluster: the largest dp the batch allows
            base_config = RunConfig()
            base_config = base_config.replace(dp=max(
                d for d in range(1, ws + 1)
                if ws % d == 0 and base_config.global_batch % d == 0))
        self.base = base_config
        self.values = C.initial_values(base_config)
        self.history: list = []
        self.last_result = self.last_metrics = self.last_error = self.last_latency_s = None
        self._quiet, self._checks, self._memory, self._notes = False, {}, {}, []
        self.controls = {k.name: C.make_widget(k, self.values[k.name]) for k in C.KNOBS}
        self._names = {id(w): name for name, w in self.controls.items()}
        for w in self.controls.values():
            w.observe(self._on_change, names="value")
        self.status = W.HTML(S.status_html("ready"))
        self.unavailable = W.HTML()
        self.history_html = W.HTML(F.history_html([]))
        # plain figures until the first run is drawn: the widgets are created from them
        # (labkit_widgets._static.live), since plotly's front end drops edits that reach
        # it before its module has loaded, and a figure widget created empty and filled
        # at once shows empty axes
        self.figures = {"memory": F.memory_figure(), "mfu": F.mfu_figure(),
                        "comm": F.comm_figure(), "bubble": P.bubble_figure()}
        P.draw_bubble(self.figures["bubble"], None)
        self.timeline, self._first_trace = None, None
        self._refresh_controls()
        self.planned = PlannedPanel(self._compose(self.base, self.values)[0])
        if run_now:
            self.rerun()
        self.figures = {name: live(fig) for name, fig in self.figures.items()}
        if timeline:
            self.timeline = TimelineView(self._first_trace)
            self.figures["timeline"] = self.timeline.fig
        wrap = W.Layout(flex_flow="row wrap", align_items="center", width="100%")
        rows = [W.HBox([W.HTML(f"<b style='font-size:12px'>{label}</b>",
                               layout=W.Layout(width="84px"))]
                       + [self.controls[n] for n in names], layout=wrap)
                for label, names in C.ROWS]
        f = self.figures
        self.children = [*rows, self.unavailable, self.status,
                         W.HTML("<b>measured</b>: this run, on the cluster's ranks"),
                         W.HBox([f["memory"], f["mfu"]], layout=wrap),
                         W.HBox([f["comm"], f["bubble"]], layout=wrap), self.planned,
                         *([self.timeline] if self.timeline else []),
                         W.HTML("<b>runs tried</b> (newest first; hover a row for its "
                                "configuration)"), self.history_html]

    # -- the cluster ----------------------------------------------------------------
    def _live_cluster(self):
        """The cluster a run goes to. A ``Cluster`` that a re-run notebook cell replaced
        names its successor as ``cluster.current``; the explorer follows it (and says so)."""
        cur = getattr(self.cluster, "current", None)
        if cur is not None and cur is not self.cluster:
            self.cluster = cur
            self._notes.append("following the newer cluster (the one given was replaced)")
        return self.cluster

    @staticmethod
    def _is_warm(cluster) -> bool:
        """Whether a run starts at once: ``cluster.ready()`` when it offers it, else its
        ``state`` / ``repr`` ("starting", "closed" or "broken" mean ranks must start)."""
        ready = getattr(cluster, "ready", None)
        if callable(ready):
            try:
                return bool(ready())
            except Exception:  # noqa: BLE001 - a failed start: run() raises it, in words
                return False
        state = getattr(cluster, "state", None)
        text = state if isinstance(state, str) else repr(cluster)
        return not any(w in text for w in ("starting", "closed", "broken"))

    # -- running ---------------------------------------------------------------------
    def rerun(self, _t0: Optional[float] = None):
        """Run the current configuration on the cluster and redraw every figure; returns
        the ``RunResult``, or ``None`` when it failed (the error is in the status line)."""
        t0 = time.perf_counter() if _t0 is None else _t0
        cluster = self._live_cluster()
        self._set_busy(True)
        try:
            cfg, notes = self._compose(self.base, self.values)
            why = C.check(cfg, cluster.world_size, self._checks)
            if why is not None:
                raise ValueError(why)
            key = cfg.replace(measure_memory=True)
            known = self._memory.get(key) if cfg.measure_memory else None
            warm = self._is_warm(cluster)
            self.status.value = S.status_html(
                STARTING if not warm else f"running {F.layout_string(cfg)} …", "busy")
            # a configuration measured before: no memory-tracked step, so a warm-up and a
            # timed step suffice
            lean = cfg.replace(measure_memory=False, steps=min(cfg.steps, 2)) if known else cfg
            result = cluster.run(self.job, lean)
            self._show(result, key, known)
            self.last_latency_s = self.history[-1]["latency_s"] = time.perf_counter() - t0
        except KeyboardInterrupt:
            self.status.value = S.status_html("interrupted", "error")
            raise
        except Exception as exc:  # noqa: BLE001 - a UI shows every failure, never crashes
            return self._fail(exc, t0)
        finally:
            self._set_busy(False)
        self.history_html.value = F.history_html(self.history)
        notes += ([] if warm else ["the ranks were started first"]) + self._notes
        if known:
            notes.append(f"memory from run #{known[0]} (same configuration)")
        used, cores = cfg.parallel.world_size, os.cpu_count() or 1
        if used > cores:  # a student reads "more data parallelism, slower steps" otherwise
            plural = "s" * (cores > 1)
            notes.append(f"its {used} ranks share {cores} CPU core{plural}: its step time "
                         "and MFU are not comparable with a run on fewer ranks")
        self._notes = []
        self.status.value = S.status_html(
            f"{F.layout_string(cfg)}: ran {result.wall_s:.2f} s; figures sent "
            f"{self.last_latency_s:.2f} s after the change"
            + "".join(f"; {n}" for n in notes), "ok")
        return result

    def _fail(self, exc: BaseException, t0: float) -> None:
        self.last_error = exc
        self.last_latency_s = time.perf_counter() - t0
        label = "invalid configuration" if isinstance(exc, ValueError) else type(exc).__name__
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        shown = f" (the figures show run #{len(self.history)})" if self.history else ""
        self.status.value = S.status_html(f"{label}: {text}{shown}", "error")
        return None

    def _show(self, result, key, known) -> None:
        """Redraw every figure from ``result`` in one batch; append the history row."""
        metrics = list(result.metrics)
        run = len(self.history) + 1
        if known:
            metrics = [{**m, "memory": mem} for m, mem in zip(metrics, known[1])]
        elif result.config.measure_memory and all(m.get("memory") for m in metrics):
            self._memory[key] = (run, [m["memory"] for m in metrics])
        try:
            pipe = P.report(result)
        except ValueError as exc:  # a trace the report cannot read: say so, draw the rest
            pipe = None
            self._notes.append(f"bubble not read: {exc}")
        row = {"run": run, **F.summarize(result, metrics, pipe),
               "config": F.describe(result.config)}
        prev = self.history[-1]["mfu_pct"] if self.history else None
        with contextlib.ExitStack() as stack:
            for fig in self.figures.values():
                stack.enter_context(fig.batch_update())
            F.draw_memory(self.figures["memory"], metrics, known[0] if known else None)
            F.draw_mfu(self.figures["mfu"], row, prev, P.mfu_note(pipe))
            F.draw_comm(self.figures["comm"], metrics, result.config)
            P.draw_bubble(self.figures["bubble"], pipe)
            steady = F.steady_trace(result.trace, skip_first=True)  # the timed steps
            if self.timeline is not None:
                self.timeline.update(steady)
            else:  # the first run, drawn before the widgets exist
                self._first_trace = steady
        self.last_result, self.last_metrics, self.last_error = result, metrics, None
        self.history.append(row)

    # -- static rendering ------------------------------------------------------------
    def figure(self, name: str = "memory") -> go.Figure:
        """A plain ``go.Figure`` snapshot of ``figures[name]``."""
        return go.Figure(self.figures[name])

    def static(self) -> None:
        """Display the status, every figure, the planned panel's and the history as static
        output (nbval, saved notebooks)."""
        from IPython.display import HTML, display

        display(HTML(self.status.value))
        for name in self.figures:
            display(self.figure(name))
        self.planned.static()
        display(HTML(self.history_html.value))
