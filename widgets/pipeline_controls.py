"""``PipelineView``'s controls follow the figure: :meth:`PipelineControls.set` from code,
the V slider reading the stages per rank the schedule runs (disabled, on that value, for a
schedule with its own V), and a refused choice putting the controls back on the run shown,
in one status line that names what was refused beside what was kept.

:class:`PipelineControls` is a part of :class:`~labkit_widgets.pipeline_view.PipelineView`,
not a widget of its own: its methods read the view's ``controls``, ``shown``, ``_quiet`` and
``_v_chosen`` and call its ``rerun`` and ``config``.
"""
from __future__ import annotations

from typing import Optional

from labkit.config import RunConfig
from labkit.parallel.pipeline.schedules import STAGES_PER_RANK

__all__ = ["PipelineControls", "LABELS", "V_OPTIONS"]

#: each control's name in the title and in a refusal
LABELS = {"schedule": "schedule", "pp": "P", "microbatches": "M", "virtual_stages": "V"}
#: the V slider's choices for the one schedule that takes a V (``interleaved``)
V_OPTIONS = (2, 4)


class PipelineControls:
    """The controls of a :class:`~labkit_widgets.pipeline_view.PipelineView` (module
    docstring)."""

    def set(self, **values) -> "PipelineView":
        """Set controls at once (``schedule``, ``pp``, ``microbatches``,
        ``virtual_stages``), then re-run once. ``virtual_stages`` beside a schedule with
        its own V is kept for when ``interleaved`` is chosen.

        Raises:
            ValueError: ``virtual_stages`` not one of :data:`V_OPTIONS`.
        """
        v = values.get("virtual_stages")
        if v is not None and v not in V_OPTIONS:
            raise ValueError(f"virtual_stages={v!r}: the V slider offers {V_OPTIONS}")
        self._quiet = True
        try:
            if "schedule" in values:  # first: it decides whether the V slider takes a V
                self.controls["schedule"].value = values["schedule"]
                self._show_v(values["schedule"])
            for k, v in values.items():
                if k == "virtual_stages" and self.controls[k].disabled:
                    self._v_chosen = v
                elif k != "schedule":
                    self.controls[k].value = v
        finally:
            self._quiet = False
        return self.rerun()

    def _show_controls(self, cfg: RunConfig) -> None:
        """Set the controls to ``cfg``'s values without re-running."""
        quiet, self._quiet = self._quiet, True
        try:
            self.controls["schedule"].value = cfg.schedule
            self.controls["pp"].value = cfg.parallel.pp
            self.controls["microbatches"].value = cfg.flush_microbatches
            self._show_v(cfg.schedule, cfg.stages_per_rank)
        finally:
            self._quiet = quiet

    def _show_v(self, schedule: str, v: Optional[int] = None) -> None:
        """The V slider reads the stages per rank ``schedule`` runs (``v``: the one shown,
        for ``interleaved``; default the V last chosen). A schedule with its own V
        (1 for ``1f1b``, 2 for ``zb-v``) disables the slider, on that value alone: a
        disabled slider left on an earlier choice (4 beside a title saying V=2) would claim
        a V nothing ran with. The choice comes back with ``interleaved``."""
        w, need = self.controls["virtual_stages"], STAGES_PER_RANK.get(schedule)
        quiet, self._quiet = self._quiet, True
        try:
            if need is None:
                if w.disabled:  # back to the chooser, on the V last chosen
                    w.options, w.disabled = V_OPTIONS, False
                    w.value = self._v_chosen
                if v in V_OPTIONS:
                    w.value = v
            else:
                if not w.disabled:
                    self._v_chosen = w.value
                w.options, w.disabled = (need,), True
                w.value = need
        finally:
            self._quiet = quiet

    def _values(self) -> dict:
        return {k: w.value for k, w in self.controls.items()}

    def _refusal(self, exc: ValueError) -> str:
        """The refusal's one line, with the controls put back on the shown run.

        The controls snap back to the values the figure shows (a control never reads a
        value nothing was run with), and the line names what was refused beside what was
        kept: ``"M=2 refused: <reason>; the controls are back on the last valid M=4 (the
        figure shows dualpipe-v: P=2, M=4, V=2)"``. With nothing shown yet (the starting
        values refused) the controls keep the values the reason names."""
        reason = str(exc).rstrip(".")
        if self.shown is None:
            return f"{reason}; nothing is drawn yet: choose other values"
        cfg, chosen = self.shown, self._values()
        ran = {"schedule": cfg.schedule, "pp": cfg.parallel.pp,
               "microbatches": cfg.flush_microbatches, "virtual_stages": cfg.stages_per_rank}
        # V counts only for the schedule that takes it (the slider is disabled otherwise)
        refused = [k for k in chosen if chosen[k] != ran[k]
                   and (k != "virtual_stages" or chosen["schedule"] == "interleaved")]
        self._show_controls(cfg)
        if "virtual_stages" in refused and self.controls["virtual_stages"].disabled:
            self._v_chosen = V_OPTIONS[0]  # interleaved chosen again must not bring it back
        kept = self._values()
        back = [k for k in refused if kept[k] == ran[k]]  # the controls that moved back
        if not refused:  # the values shown, refused now (e.g. fewer ranks): nothing to undo
            return f"{reason} (the figure shows {self._name()}, run before)"
        was = ", ".join(f"{LABELS[k]}={chosen[k]}" for k in refused)
        now = ", ".join(f"{LABELS[k]}={kept[k]}" for k in back)
        return (f"{was} refused: {reason}; " + (f"the controls are back on the last valid "
                                                f"{now} " if back else "")
                + f"(the figure shows {self._name()})")

    def _name(self) -> str:
        """The shown configuration as the title names it."""
        cfg = self.shown or self.config()
        v = f", V={cfg.stages_per_rank}" if cfg.stages_per_rank > 1 else ""
        return f"{cfg.schedule}: P={cfg.parallel.pp}, M={cfg.flush_microbatches}{v}"
