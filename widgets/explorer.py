"""``Explorer``: turn the data-parallel, ZeRO and pipeline knobs, watch a real re-run answer.

Sliders and toggles pick dp, the micro-batch, the DDP bucket, the gradient-sync mode, the
recompute policy, the ZeRO stage (0–3), FSDP prefetch (stage 3 only), the HSDP replica
groups ``M`` (a divisor of dp; 1 = off), the pipeline degree ``pp`` (1 = off), microbatches
and schedule. Every change runs on the warm cluster — a real run, never a formula dressed
as a measurement: stage 0 without HSDP runs ``labkit.jobs.train`` (a ``RunConfig``), other
ZeRO settings ``zero_train`` (a ``ZeroConfig``), ``pp > 1`` the pipeline executor (a
``PipelineConfig``; dp and ZeRO off: :mod:`labkit_widgets.explorer_pipeline`) — and redraws
in one ``batch_update()`` (figures: :mod:`labkit_widgets.explorer_figures`):

* peak memory per rank by category, measured beside the predicted model state,
* MFU on a gauge with the lecture's bars (30 % good, 40 % excellent) and the step time,
* bytes per collective per rank per step, measured beside the formula (2Ψ / 3Ψ …),
* the per-rank timeline of the run (:class:`~labkit_widgets.timeline.TimelineView`),
* the pipeline bubble, measured beside simulated (empty while ``pp = 1``),
* a history table of every configuration tried (with stage, prefetch, replicas, the
  fraction of all-gather time hidden under compute, pp, schedule and bubble).

A status line says how long the re-run took; an invalid configuration shows its
``ValueError`` there in red instead of raising.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import ipywidgets as W
import plotly.graph_objects as go

from labkit.config import RunConfig

from . import _style as S
from . import explorer_figures as F
from . import explorer_pipeline as P
from .explorer_figures import BUCKET_OPTIONS_MB, CHECKPOINT_OPTIONS, DP_MODES  # noqa: F401
from .timeline import TimelineView

__all__ = ["Explorer", "BUCKET_OPTIONS_MB", "DP_MODES", "ZERO_CONTROLS"]

#: controls that are RunConfig fields, and the ZeRO knobs (ZeroConfig fields)
RUN_CONTROLS = ("dp", "micro_batch", "bucket_mb", "dp_mode", "checkpoint")
ZERO_CONTROLS = ("zero_stage", "prefetch", "hsdp_replicas")
CONTROLS = RUN_CONTROLS + ZERO_CONTROLS + P.PP_CONTROLS
#: knobs the ZeRO job does not use (greyed out while it runs)
_DP_ONLY = ("bucket_mb", "dp_mode", "checkpoint")


class Explorer(W.VBox):
    """Data-parallel / ZeRO training, re-run on the warm cluster at every control change.

    Args:
        cluster: a warm :class:`labkit.Cluster` (anything with ``world_size`` and
            ``run(job, config)``).
        base_config: the run everything else comes from (default ``RunConfig()``: the tiny
            GPT, global batch 8, 3 steps, with dp = the cluster's world size when the batch
            splits over it, else its largest divisor that does).
        job: what runs at ZeRO stage 0 without HSDP; default ``labkit.jobs.train``.
        run_now: run the starting configuration at construction.
        timeline: also show the run's per-rank timeline.

    Attributes:
        controls: dict name → widget: ``dp``, ``micro_batch``, ``bucket_mb``, ``dp_mode``,
            ``checkpoint``, ``zero_stage`` (0–3), ``prefetch`` (bool; enabled at stage 3
            only), ``hsdp_replicas`` (``M``, a divisor of dp; 1 = off), ``pp`` (1 = off),
            ``microbatches``, ``schedule`` (the last two enabled while ``pp > 1``).
        figures: dict name → ``go.FigureWidget`` (``memory``, ``mfu``, ``comm``,
            ``bubble``, and ``timeline`` when shown).
        status: ``ipywidgets.HTML`` status line (errors in red).
        history: one dict per successful run, oldest first
            (:func:`labkit_widgets.explorer_figures.summarize`).
        last_result: the latest ``RunResult``; ``last_error`` the latest exception or None.
        last_latency_s: seconds from the change to the figures being updated.
    """

    def __init__(self, cluster, base_config: Optional[RunConfig] = None, *, job=None,
                 run_now: bool = True, timeline: bool = True, **kwargs):
        super().__init__(**kwargs)
        if job is None:
            from labkit import jobs

            job = jobs.train
        self.cluster, self.job = cluster, job
        if base_config is None:  # use the whole cluster: the largest dp the batch allows
            base_config = RunConfig()
            dp = max(d for d in range(1, cluster.world_size + 1)
                     if cluster.world_size % d == 0 and base_config.global_batch % d == 0)
            base_config = base_config.replace(dp=dp)
        self.base = base_config
        self.history: list = []
        self.last_result = self.last_error = self.last_latency_s = None
        self._quiet = False
        ws, base = cluster.world_size, self.base
        opts = dict(continuous_update=False, style={"description_width": "70px"})
        self.controls = {**F.dp_controls(ws, base, opts),
                         **P.make_controls(ws, base.global_batch, opts)}
        self._sync_micro(base.micro)
        self._sync_replicas()
        self._refresh_enabled()
        self.status = W.HTML(S.status_html("ready"))
        self.history_html = W.HTML(S.table_html([], F.HISTORY_COLUMNS))
        self.figures = {"memory": go.FigureWidget(F.memory_figure()),
                        "mfu": go.FigureWidget(F.mfu_figure()),
                        "comm": go.FigureWidget(F.comm_figure()),
                        "bubble": go.FigureWidget(P.bubble_figure())}
        self.timeline = TimelineView() if timeline else None
        if self.timeline is not None:
            self.figures["timeline"] = self.timeline.fig
        for c in self.controls.values():
            c.observe(self._on_change, names="value")
        c = self.controls
        self.children = [W.HBox([c["dp"], c["micro_batch"], c["bucket_mb"]]),
                         W.HBox([c["dp_mode"], c["checkpoint"]]),
                         W.HBox([c["zero_stage"], c["prefetch"], c["hsdp_replicas"]]),
                         W.HBox([c["pp"], c["microbatches"], c["schedule"]]), self.status,
                         W.HBox([self.figures["memory"], self.figures["mfu"]]),
                         W.HBox([self.figures["comm"], self.figures["bubble"]]),
                         *([self.timeline] if self.timeline else []),
                         W.HTML("<b>runs tried</b>"), self.history_html]
        if run_now:
            self.rerun()

    # -- configuration -------------------------------------------------------------
    def config(self, **overrides) -> RunConfig:
        """The ``RunConfig`` the controls describe (``overrides`` win); not validated."""
        return self._plan(self.base, overrides)[2]

    def job_config(self, **overrides) -> tuple:
        """``(job, config)`` the controls describe (``overrides`` win), not validated:
        ``(self.job, RunConfig)`` at ZeRO stage 0 without HSDP, ``(pipeline_train_mfu,
        PipelineConfig)`` with ``pp > 1``, else ``(zero_train, ZeroConfig)``."""
        job, cfg, _ = self._plan(self.base, overrides)
        return job, cfg

    def _plan(self, base: RunConfig, overrides: dict) -> tuple:
        vals = {k: c.value for k, c in self.controls.items()}
        vals.update(overrides)
        z = {k: vals.pop(k) for k in ZERO_CONTROLS}
        pp = {k: vals.pop(k) for k in P.PP_CONTROLS}
        run = base.replace(**vals)
        if pp["pp"] > 1:
            return (*P.plan(run, **pp, zero=z), run)
        if z["zero_stage"] == 0 and z["hsdp_replicas"] == 1:
            return self.job, run, run
        from labkit.parallel.zero_config import ZeroConfig
        from labkit.parallel.zero_jobs import zero_train

        # the ZeRO job applies no recompute policy: count FLOPs without one
        return zero_train, ZeroConfig(run=run.replace(checkpoint="none"), **z), run

    def _micro_options(self, dp: int) -> list:
        gb = self.base.global_batch
        return S.divisors(gb // dp) if dp and gb % dp == 0 and gb >= dp else [1]

    def _sync_micro(self, want: Optional[int] = None) -> None:
        """Recompute micro-batch options for the current dp, keeping the value valid."""
        slider = self.controls["micro_batch"]
        want = slider.value if want is None else want
        opts = self._micro_options(self.controls["dp"].value)
        self._quietly(slider, opts, max([o for o in opts if o <= want] or [opts[0]]))

    def _sync_replicas(self, want: Optional[int] = None) -> None:
        """HSDP options for the current dp: ``M`` divides dp, labelled ``M × K`` (replica
        groups × shards); keeps the value if it still divides dp, else 1 (off)."""
        dd, dp = self.controls["hsdp_replicas"], self.controls["dp"].value
        want = dd.value if want is None else want
        opts = [("1 (off)", 1)] + [(f"{m} × {dp // m}", m) for m in S.divisors(dp)[1:]]
        self._quietly(dd, opts, want if dp % want == 0 else 1)

    def _quietly(self, widget, options, value) -> None:
        quiet, self._quiet = self._quiet, True
        try:
            widget.options, widget.value = options, value
        finally:
            self._quiet = quiet

    def _refresh_enabled(self) -> None:
        """Prefetch at stage 3 only; DP-only knobs off under ZeRO; DP/ZeRO off if pp > 1."""
        c = self.controls
        zero = c["zero_stage"].value > 0 or c["hsdp_replicas"].value > 1
        pipe = c["pp"].value > 1
        c["prefetch"].disabled = c["zero_stage"].value != 3 or pipe
        for k in _DP_ONLY + ("dp", "micro_batch", "zero_stage", "hsdp_replicas"):
            c[k].disabled = (zero and k in _DP_ONLY) or pipe
        c["microbatches"].disabled = c["schedule"].disabled = not pipe

    def set(self, **changes) -> Optional[object]:
        """Change controls (see :attr:`controls`) and any other ``RunConfig`` field
        (``global_batch=``, ``steps=`` … go into the base config), then re-run once — the
        path a control change takes. An invalid value or combination (e.g. ``hsdp_replicas``
        not dividing dp; ``pp > 1`` with dp > 1 or ZeRO: no N-D composition yet) is reported
        in the status line (nothing changes, nothing raises). Returns the ``RunResult``."""
        ctrl = {k: changes.pop(k) for k in list(changes) if k in CONTROLS}
        t0 = time.perf_counter()
        try:
            base = self.base.replace(**changes) if changes else self.base
            vals = {**{k: c.value for k, c in self.controls.items()}, **ctrl}
            P.compose(vals, ctrl)  # pp > 1: dp 1, ZeRO off; asking for both is an error
            if "hsdp_replicas" not in ctrl and vals["dp"] % vals["hsdp_replicas"]:
                vals["hsdp_replicas"] = 1  # as the dp slider does
            cand = base.replace(**{k: vals[k] for k in RUN_CONTROLS})
            self._check(ctrl, cand, self._plan(base, vals)[1])
        except ValueError as exc:
            return self._fail(exc, t0)
        self._quiet = True
        try:
            self.base = base
            bucket = self.controls["bucket_mb"]
            if "bucket_mb" in ctrl and float(ctrl["bucket_mb"]) not in bucket.options:
                bucket.options = sorted(set(bucket.options) | {float(ctrl["bucket_mb"])})
            for k in ("dp", "bucket_mb", "dp_mode", "checkpoint", "zero_stage", "prefetch",
                      "pp", "schedule"):
                self.controls[k].value = float(vals[k]) if k == "bucket_mb" else vals[k]
            self._sync_micro(ctrl.get("micro_batch"))
            self._sync_replicas(vals["hsdp_replicas"])
            ms = P.microbatch_options(base.global_batch)
            self._quietly(self.controls["microbatches"], ms,
                          max([m for m in ms if m <= vals["microbatches"]] or [1]))
        finally:
            self._quiet = False
        return self.rerun(_t0=t0)

    def _check(self, ctrl: dict, cand: RunConfig, job_cfg) -> None:
        """Raise ValueError for a control value the widgets cannot take; labkit's own
        message (``RunConfig`` / ``ZeroConfig.validate``, with the numbers) first."""
        ws = self.cluster.world_size
        if hasattr(job_cfg, "schedule"):
            job_cfg.validate(ws)  # the pipeline's own message, with the numbers
        for k, v in ctrl.items():
            if k == "microbatches":
                ok = v in P.microbatch_options(cand.global_batch)
            elif k in ZERO_CONTROLS:
                job_cfg.validate(ws)  # stage 0-3, M divides dp, stage 0 without HSDP
                ok = isinstance(v, bool) if k == "prefetch" else True
            elif k == "micro_batch":
                ok = v in self._micro_options(cand.parallel.dp)
            elif k == "bucket_mb":
                ok = isinstance(v, (int, float)) and v > 0
            else:
                ok = v in self.controls[k].options
            if not ok:
                cand.validate(ws)
                raise ValueError(f"{k}={v!r} is not one of {list(self.controls[k].options)}")

    def _on_change(self, change) -> None:
        if self._quiet:
            return
        t0 = time.perf_counter()
        owner = change["owner"]
        c = self.controls
        if owner is c["pp"] and owner.value > 1:  # no N-D composition yet: dp and ZeRO off
            for k, off in P.OFF.items():
                self._quietly(c[k], c[k].options, off)
        if owner in (c["dp"], c["pp"]):
            self._sync_micro()
            self._sync_replicas()
        if owner is c["prefetch"] and c["zero_stage"].value != 3:
            return  # only stage 3 prefetches: nothing to re-run
        if owner in (c["microbatches"], c["schedule"]) and c["pp"].value == 1:
            return  # the pipeline knobs wait for pp > 1
        self.rerun(_t0=t0)

    # -- running -------------------------------------------------------------------
    def rerun(self, _t0: Optional[float] = None):
        """Run the current configuration on the cluster and redraw; returns the
        ``RunResult``, or None when it failed (the error is in the status line)."""
        t0 = time.perf_counter() if _t0 is None else _t0
        self._set_busy(True)
        try:
            job, cfg = self.job_config()
            self.status.value = S.status_html(f"running {F.describe(cfg)} …", "busy")
            cfg.validate(self.cluster.world_size)
            result = self.cluster.run(job, cfg)
            row = self._show(result)
        except KeyboardInterrupt:
            self.status.value = S.status_html("interrupted", "error")
            raise
        except Exception as exc:  # noqa: BLE001 - a UI shows every failure, never crashes
            return self._fail(exc, t0)
        finally:
            self._set_busy(False)
        self.last_latency_s = row["latency_s"] = time.perf_counter() - t0
        self.history_html.value = S.table_html(self.history, F.HISTORY_COLUMNS)
        self.status.value = S.status_html(
            f"{F.describe(cfg)}: re-run took {result.wall_s:.2f} s on the cluster, figures "
            f"updated {self.last_latency_s:.2f} s after the change", "ok")
        return result

    def _fail(self, exc: BaseException, t0: float) -> None:
        self.last_error = exc
        self.last_latency_s = time.perf_counter() - t0
        label = "invalid configuration" if isinstance(exc, ValueError) else type(exc).__name__
        self.status.value = S.status_html(f"{label}: {exc}", "error")
        return None

    def _set_busy(self, busy: bool) -> None:
        for c in self.controls.values():
            c.disabled = busy
        if not busy:
            self._refresh_enabled()

    def _show(self, result) -> dict:
        """Redraw every figure from ``result`` in one batch; append the history row."""
        ms, pipe = result.metrics, P.report(result)  # pipe: None unless a pipeline run
        row = {"run": len(self.history) + 1,
               **(F.summarize(result) if pipe is None else P.summarize(result, pipe))}
        prev = self.history[-1]["mfu_pct"] if self.history else None
        with contextlib.ExitStack() as stack:
            for fig in self.figures.values():
                stack.enter_context(fig.batch_update())
            F.draw_mfu(self.figures["mfu"], row, prev, P.mfu_note(pipe))
            if pipe is None:
                F.draw_memory(self.figures["memory"], ms)
                F.draw_comm(self.figures["comm"], ms, result.config)
                P.draw_bubble(self.figures["bubble"], None)
            else:
                P.draw(self.figures, result, pipe)
            if self.timeline is not None:
                self.timeline.update(result)
        self.last_result, self.last_error = result, None
        self.history.append(row)
        return row

    # -- static rendering ----------------------------------------------------------
    def figure(self, name: str = "memory") -> go.Figure:
        """A plain ``go.Figure`` snapshot of ``figures[name]``."""
        return go.Figure(self.figures[name])

    def static(self) -> None:
        """Display every figure and the history as static output (nbval, saved notebooks)."""
        from IPython.display import HTML, display

        for name in self.figures:
            display(self.figure(name))
        display(HTML(self.history_html.value))
