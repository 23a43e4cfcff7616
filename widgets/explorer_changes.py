"""The :class:`~labkit_widgets.explorer.Explorer`'s changes: the configuration its controls
describe, a change's path (a control released, or :meth:`ExplorerChanges.set` from code) to
a re-run or to a refusal in validate's words, and the widgets following the values — each
control offered the values validate accepts now, greyed when it has no effect, and put back
when a value is refused.

:class:`ExplorerChanges` is a part of :class:`~labkit_widgets.explorer.Explorer`, not a
widget of its own: its methods read the explorer's ``base``, ``values``, ``controls``,
``cluster``, ``max_steps``, ``planned``, ``unavailable``, ``_quiet`` and ``_checks`` and call
its ``rerun`` and ``_fail``.
"""
from __future__ import annotations

import time

import ipywidgets as W

from labkit.config import RunConfig

from . import explorer_controls as C

__all__ = ["ExplorerChanges"]


class ExplorerChanges:
    """The configuration and the controls of an :class:`~labkit_widgets.explorer.Explorer`
    (module docstring)."""

    # -- configuration ---------------------------------------------------------------
    def _compose(self, base: RunConfig, values: dict) -> tuple:
        cfg, notes = C.compose(base, values)
        if self.max_steps is not None and cfg.steps > self.max_steps:
            cfg = cfg.replace(steps=self.max_steps)
        return cfg, notes

    def config(self, **overrides) -> RunConfig:
        """The ``RunConfig`` the controls describe (``overrides``: control names or any
        ``RunConfig`` field, as field values); not validated. A re-run trains it (the
        memory-tracked step skipped when this configuration was measured before)."""
        ctrl = {k: C.to_control(k, overrides.pop(k)) for k in list(overrides) if k in C.NAMES}
        base = self.base.replace(**overrides) if overrides else self.base
        return self._compose(base, {**self.values, **ctrl})[0]

    def set(self, **changes):
        """Change controls (names in :attr:`controls`, as field values: ``micro_batch=None``
        is "auto") and any other ``RunConfig`` field (``global_batch=``, ``steps=`` … go into
        the base config), then re-run once: the path a released control takes. A
        configuration ``validate`` refuses is reported in the status line with its reason;
        nothing changes and nothing raises. Returns the ``RunResult`` or ``None``.

        Raises:
            TypeError: an unknown name (a typo is a programming error, not a configuration).
        """
        t0 = time.perf_counter()
        ctrl = {k: C.to_control(k, changes.pop(k)) for k in list(changes) if k in C.NAMES}
        try:
            base = self.base.replace(**changes) if changes else self.base
        except ValueError as exc:
            return self._fail(exc, t0)
        return self._change(base, {**self.values, **ctrl}, t0)

    def _change(self, base: RunConfig, values: dict, t0: float):
        try:
            why = C.check(self._compose(base, values)[0], self.cluster.world_size, self._checks)
        except (TypeError, ValueError) as exc:  # e.g. dp="2": the field's own message
            why = str(exc)
        if why is not None:
            self._sync_values()  # put a refused widget value back
            return self._fail(ValueError(why), t0)
        self.base, self.values = base, values
        self._sync_values()
        self.planned.update(self._compose(base, values)[0])  # a formula: before the run
        return self.rerun(_t0=t0)

    def _on_change(self, change) -> None:
        if self._quiet:
            return
        t0 = time.perf_counter()
        name = self._names[id(change["owner"])]
        self._change(self.base, {**self.values, name: change["new"]}, t0)

    # -- controls --------------------------------------------------------------------
    def _sync_values(self) -> None:
        """Show :attr:`values` on the widgets (quietly; options follow after the run)."""
        quiet, self._quiet = self._quiet, True
        try:
            for name, w in self.controls.items():
                v = self.values[name]
                if w.value != v:
                    if not isinstance(w, W.Checkbox) and v not in [o[1] for o in w.options]:
                        w.options = list(w.options) + C.pairs([v])
                    w.value = v
        finally:
            self._quiet = quiet

    def _refresh_controls(self, busy: bool = False) -> None:
        """Offer each control the values validate accepts now; grey knobs without effect;
        list the refused values with their reasons (:attr:`unavailable`)."""
        ws = self.cluster.world_size
        avail = C.availability(self.base, self.values, ws, self._checks)
        quiet, self._quiet = self._quiet, True
        try:
            for name, w in self.controls.items():
                a, v = avail[name], self.values[name]
                if not isinstance(w, W.Checkbox):
                    pairs = C.pairs(a["offer"])
                    if tuple(w.options) != tuple(pairs):
                        w.options = pairs
                if w.value != v:
                    w.value = v
                w.disabled = busy or not a["applies"] or len(a["offer"]) < 2
                tip = C.tooltip_now(C.BY_NAME[name], a)
                if w.tooltip != tip:
                    w.tooltip = tip
        finally:
            self._quiet = quiet
        self.unavailable.value = C.unavailable_html(
            avail, self._compose(self.base, self.values)[0], ws)

    def _set_busy(self, busy: bool) -> None:
        if busy:
            for w in self.controls.values():
                w.disabled = True
        else:
            self._refresh_controls()
