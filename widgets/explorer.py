"""``Explorer``: turn the data-parallel knobs and watch a real re-run answer.

Sliders pick the data-parallel degree, the micro-batch, the DDP bucket size and the
gradient-sync mode. Every change builds a new :class:`labkit.config.RunConfig`, runs
``labkit.jobs.train`` on the warm cluster — a real run, never a formula dressed as a
measurement — and redraws, all in one ``batch_update()``:

* peak memory per rank by category, measured beside the predicted model state,
* MFU on a gauge with the lecture's bars (30 % good, 40 % excellent) and the step time,
* communication bytes per rank per step, measured beside ``2(N−1)/N·|θ|·bytes``,
* the per-rank timeline of the run (:class:`~labkit_widgets.timeline.TimelineView`),
* a history table of every configuration tried.

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
from .timeline import TimelineView

__all__ = ["Explorer", "BUCKET_OPTIONS_MB", "DP_MODES"]

#: the tiny model's parameters are ~0.4 MB, so buckets below 1 MiB are where things happen
BUCKET_OPTIONS_MB = (0.001, 0.01, 0.1, 1.0, 25.0)
DP_MODES = ("ddp", "naive", "torch")
CONTROLS = ("dp", "micro_batch", "bucket_mb", "dp_mode", "checkpoint")
#: activation-checkpointing policies offered (``every`` needs a segment size: use ``set``)
CHECKPOINT_OPTIONS = ("none", "full", "selective")

_HISTORY_COLUMNS = [
    ("#", "run", str), ("dp", "dp", str), ("micro", "micro_batch", str),
    ("bucket MiB", "bucket_mb", lambda v: S.fmt(v, "g")), ("mode", "dp_mode", str), ("recompute", "checkpoint", str),
    ("step ms", "step_ms", lambda v: S.fmt(v, ".1f")), ("MFU %", "mfu_pct", lambda v: S.fmt(v, ".1f")),
    ("HFU %", "hfu_pct", lambda v: S.fmt(v, ".1f")),
    ("peak MiB", "peak_mib", lambda v: S.fmt(v, ".2f")), ("bytes/step", "comm_bytes", S.fmt_bytes),
    ("loss", "loss", lambda v: S.fmt(v, ".4f")), ("run s", "wall_s", lambda v: S.fmt(v, ".2f")),
    ("latency s", "latency_s", lambda v: S.fmt(v, ".2f"))]


def summarize(result) -> dict:
    """One history row from a train ``RunResult`` (missing metrics read as ``None``)."""
    ms = result.metrics
    cfg = result.config
    last = [o["losses"][-1] for o in result.outputs if isinstance(o, dict) and o.get("losses")]
    mfus = [m.get("mfu") for m in ms]
    hfus = [m.get("hfu") for m in ms]
    return {"dp": cfg.parallel.dp, "micro_batch": cfg.micro, "bucket_mb": cfg.bucket_mb,
            "dp_mode": cfg.dp_mode, "checkpoint": getattr(cfg, "checkpoint", "none"),
            "hfu_pct": None if S.mean(hfus) is None else 100 * S.mean(hfus),
            "step_ms": max((m.get("step_time_s") or 0.0 for m in ms), default=0.0) * 1e3,
            "mfu_pct": None if S.mean(mfus) is None else 100 * S.mean(mfus),
            "peak_mib": S.mib(max((m.get("memory", {}).get("peak_total") or 0 for m in ms),
                                  default=0)),
            "comm_bytes": max((m.get("comm_bytes_per_step") or 0.0 for m in ms), default=0.0),
            "loss": S.mean(last), "wall_s": result.wall_s}


class Explorer(W.VBox):
    """Data-parallel training, re-run on the warm cluster at every slider change.

    Args:
        cluster: a warm :class:`labkit.Cluster` (anything with ``world_size`` and
            ``run(job, config)``).
        base_config: the run everything else comes from (default ``RunConfig()``: the tiny
            GPT, global batch 8, 3 steps).
        job: what to run; default ``labkit.jobs.train``.
        run_now: run the starting configuration at construction.
        timeline: also show the run's per-rank timeline.

    Attributes:
        controls: dict ``dp``/``micro_batch``/``bucket_mb``/``dp_mode`` → the widget.
        figures: dict name → ``go.FigureWidget`` (``memory``, ``mfu``, ``comm``, and
            ``timeline`` when shown).
        status: ``ipywidgets.HTML`` status line (errors in red).
        history: one dict per successful run (see :func:`summarize`), oldest first.
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
        self.base = base_config if base_config is not None else RunConfig()
        self.history: list = []
        self.last_result = self.last_error = self.last_latency_s = None
        self._quiet = False
        ws, base = cluster.world_size, self.base
        dps = S.divisors(ws)
        buckets = sorted(set(BUCKET_OPTIONS_MB) | {float(base.bucket_mb)})
        opts = dict(continuous_update=False, style={"description_width": "70px"})
        self.controls = {
            "dp": W.SelectionSlider(options=dps, value=base.parallel.dp if base.parallel.dp
                                    in dps else ws, description="dp", **opts),
            "micro_batch": W.SelectionSlider(options=[1], value=1, description="micro-batch",
                                             **opts),
            "bucket_mb": W.SelectionSlider(options=buckets, value=float(base.bucket_mb),
                                           description="bucket MiB", **opts),
            "dp_mode": W.ToggleButtons(options=list(DP_MODES), value=base.dp_mode
                                       if base.dp_mode in DP_MODES else "ddp",
                                       description="sync", style={"button_width": "60px"}),
            "checkpoint": W.ToggleButtons(
                options=sorted(set(CHECKPOINT_OPTIONS) | {base.checkpoint},
                               key=("none", "full", "every", "selective").index),
                value=base.checkpoint, description="recompute",
                tooltips=["store every activation", "recompute each block in backward",
                          "recompute attention and element-wise ops, keep matmul outputs"],
                style={"button_width": "72px"})}
        self._sync_micro(base.micro)
        self.status = W.HTML(S.status_html("ready"))
        self.history_html = W.HTML(S.table_html([], _HISTORY_COLUMNS))
        self.figures = {"memory": go.FigureWidget(_memory_figure()),
                        "mfu": go.FigureWidget(_mfu_figure()),
                        "comm": go.FigureWidget(_comm_figure())}
        self.timeline = TimelineView() if timeline else None
        if self.timeline is not None:
            self.figures["timeline"] = self.timeline.fig
        for c in self.controls.values():
            c.observe(self._on_change, names="value")
        self.children = [W.HBox(list(self.controls.values())[:3]),
                         W.HBox([self.controls["dp_mode"], self.controls["checkpoint"]]),
                         self.status,
                         W.HBox([self.figures["memory"], self.figures["mfu"]]),
                         self.figures["comm"], *([self.timeline] if self.timeline else []),
                         W.HTML("<b>runs tried</b>"), self.history_html]
        if run_now:
            self.rerun()

    # -- configuration -------------------------------------------------------------
    def config(self, **overrides) -> RunConfig:
        """The config the controls describe (``overrides`` win); not validated."""
        vals = {k: c.value for k, c in self.controls.items()}
        vals.update(overrides)
        return self.base.replace(**vals)

    def _micro_options(self, dp: int) -> list:
        gb = self.base.global_batch
        return S.divisors(gb // dp) if dp and gb % dp == 0 and gb >= dp else [1]

    def _sync_micro(self, want: Optional[int] = None) -> None:
        """Recompute micro-batch options for the current dp, keeping the value valid."""
        slider = self.controls["micro_batch"]
        want = slider.value if want is None else want
        opts = self._micro_options(self.controls["dp"].value)
        keep = max([o for o in opts if o <= want] or [opts[0]])
        quiet, self._quiet = self._quiet, True
        try:
            slider.options, slider.value = opts, keep
        finally:
            self._quiet = quiet

    def set(self, **changes) -> Optional[object]:
        """Change controls (``dp``, ``micro_batch``, ``bucket_mb``, ``dp_mode``, ``checkpoint``)
        and any other
        ``RunConfig`` field (``global_batch=``, ``steps=`` … go into the base config), then
        re-run once — the path a slider change takes. An invalid value is reported in the
        status line (nothing changes, nothing raises). Returns the ``RunResult`` or None."""
        ctrl = {k: changes.pop(k) for k in list(changes) if k in CONTROLS}
        t0 = time.perf_counter()
        try:
            base = self.base.replace(**changes) if changes else self.base
            cand = base.replace(**{**{k: c.value for k, c in self.controls.items()}, **ctrl})
            for k, v in ctrl.items():
                ok = (v in self._micro_options(cand.parallel.dp) if k == "micro_batch" else
                      (isinstance(v, (int, float)) and v > 0) if k == "bucket_mb" else
                      v in self.controls[k].options)
                if not ok:
                    cand.validate(self.cluster.world_size)  # labkit's own message first
                    raise ValueError(f"{k}={v!r} is not one of {list(self.controls[k].options)}")
        except ValueError as exc:
            return self._fail(exc, t0)
        self._quiet = True
        try:
            self.base = base
            if "bucket_mb" in ctrl and float(ctrl["bucket_mb"]) not in self.controls["bucket_mb"].options:
                bucket = self.controls["bucket_mb"]
                bucket.options = sorted(set(bucket.options) | {float(ctrl["bucket_mb"])})
            for k in ("dp", "bucket_mb", "dp_mode", "checkpoint"):
                if k in ctrl:
                    self.controls[k].value = float(ctrl[k]) if k == "bucket_mb" else ctrl[k]
            self._sync_micro(ctrl.get("micro_batch"))
        finally:
            self._quiet = False
        return self.rerun(_t0=t0)

    def _on_change(self, change) -> None:
        if self._quiet:
            return
        t0 = time.perf_counter()
        if change["owner"] is self.controls["dp"]:
            self._sync_micro()
        self.rerun(_t0=t0)

    # -- running -------------------------------------------------------------------
    def rerun(self, _t0: Optional[float] = None):
        """Run the current configuration on the cluster and redraw; returns the
        ``RunResult``, or None when it failed (the error is in the status line)."""
        t0 = time.perf_counter() if _t0 is None else _t0
        self._set_busy(True)
        try:
            cfg = self.config()
            self.status.value = S.status_html(f"running {_describe(cfg)} …", "busy")
            cfg.validate(self.cluster.world_size)
            result = self.cluster.run(self.job, cfg)
            row = self._show(result)
        except KeyboardInterrupt:
            self.status.value = S.status_html("interrupted", "error")
            raise
        except Exception as exc:  # noqa: BLE001 - a UI shows every failure, never crashes
            return self._fail(exc, t0)
        finally:
            self._set_busy(False)
        self.last_latency_s = row["latency_s"] = time.perf_counter() - t0
        self.history_html.value = S.table_html(self.history, _HISTORY_COLUMNS)
        self.status.value = S.status_html(
            f"{_describe(cfg)}: re-run took {result.wall_s:.2f} s on the cluster, figures "
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

    def _show(self, result) -> dict:
        """Redraw every figure from ``result`` in one batch; append the history row."""
        ms, n = result.metrics, len(result.metrics)
        row = {"run": len(self.history) + 1, **summarize(result)}
        prev = self.history[-1]["mfu_pct"] if self.history else None
        with contextlib.ExitStack() as stack:
            for fig in self.figures.values():
                stack.enter_context(fig.batch_update())
            _draw_memory(self.figures["memory"], ms)
            _draw_mfu(self.figures["mfu"], row, prev)
            _draw_comm(self.figures["comm"], ms, result.config)
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


def _describe(cfg: RunConfig) -> str:
    ckpt = "" if cfg.checkpoint == "none" else f" recompute={cfg.checkpoint}"
    return (f"dp={cfg.parallel.dp} micro={cfg.micro} bucket={cfg.bucket_mb:g} MiB "
            f"mode={cfg.dp_mode}{ckpt}")


def _memory_figure() -> go.Figure:
    bars = [go.Bar(name=c, x=[[], []], y=[], marker_color=S.MEMORY_COLORS[c],
                   hovertemplate=f"{c}: %{{y:.3f}} MiB<br>%{{x}}<extra></extra>")
            for c in S.MEMORY_CATEGORIES]
    return go.Figure(bars, dict(
        barmode="stack", template="plotly_white", height=340, width=620,
        title=dict(text="peak memory per rank — measured vs predicted (hatched)", font_size=14),
        yaxis_title="MiB", margin=dict(l=60, r=10, t=50, b=60)))


def _draw_memory(fig, metrics: list) -> None:
    x0 = [f"rank {m.get('rank', r)}" for r, m in enumerate(metrics) for _ in (0, 1)]
    x1 = ["measured", "predicted"] * len(metrics)
    for tr, cat in zip(fig.data, S.MEMORY_CATEGORIES):
        ys = []
        for m in metrics:
            pred = m.get("memory_predicted", {})
            ys += [S.mib(m.get("memory", {}).get("peak", {}).get(cat)),
                   S.mib(pred[cat]) if cat in pred else None]
        tr.update(x=[x0, x1], y=ys, marker_pattern_shape=["", "/"] * len(metrics))


def _mfu_figure() -> go.Figure:
    g, e = 100 * S.MFU_GOOD, 100 * S.MFU_EXCELLENT
    return go.Figure(go.Indicator(
        mode="gauge+number+delta", value=None, number=dict(suffix=" %", valueformat=".1f"),
        delta=dict(valueformat=".1f", suffix=" pts"),
        gauge=dict(axis=dict(range=[0, 100]), bar=dict(color="#333"),
                   steps=[dict(range=[0, g], color="#F6D5D1"),
                          dict(range=[g, e], color="#FCEFC7"),
                          dict(range=[e, 100], color="#D5EFD8")],
                   threshold=dict(line=dict(color=S.OK_GREEN, width=3), value=e))),
        dict(height=340, width=330, margin=dict(l=30, r=30, t=80, b=20),
             title=dict(text="MFU", font_size=14)))


def _draw_mfu(fig, row: dict, prev_pct: Optional[float]) -> None:
    v = row["mfu_pct"]
    rating = "n/a" if v is None else ("excellent" if v > 100 * S.MFU_EXCELLENT else
                                      "good" if v > 100 * S.MFU_GOOD else "low")
    fig.data[0].update(value=v, delta_reference=prev_pct if prev_pct is not None else v)
    fig.layout.title.text = (f"MFU ({rating}; >30 % good, >40 % excellent)<br>"
                             f"step {row['step_ms']:.1f} ms")


def _comm_figure() -> go.Figure:
    return go.Figure([
        go.Bar(name="measured (labkit.comm)", x=[], y=[], marker_color=S.COMM_COLORS["all_reduce"],
               hovertemplate="%{x}: %{y:.4f} MiB/step measured<extra></extra>"),
        go.Scatter(name="formula 2(N−1)/N·|θ|·bytes", x=[], y=[], mode="markers",
                   marker=dict(symbol="line-ew-open", size=70, color="#222", line_width=3),
                   hovertemplate="%{x}: %{y:.4f} MiB/step predicted<extra></extra>")],
        dict(template="plotly_white", height=300, yaxis_title="MiB per step",
             title=dict(text="communication per rank per step", font_size=14),
             margin=dict(l=60, r=10, t=50, b=40), legend=dict(orientation="h", y=-0.2)))


def _draw_comm(fig, metrics: list, cfg) -> None:
    x = [f"rank {m.get('rank', r)}" for r, m in enumerate(metrics)]
    fig.data[0].update(x=x, y=[S.mib(m.get("comm_bytes_per_step")) for m in metrics])
    fig.data[1].update(x=x, y=[S.mib(m.get("comm_bytes_predicted")) for m in metrics])
    n_params = metrics[0].get("n_params") if metrics else None
    fig.layout.title.text = (f"communication per rank per step — dp={cfg.parallel.dp}, "
                             f"{cfg.dp_mode}, |θ| = {S.fmt(n_params, ',')} params")
