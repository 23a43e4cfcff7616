"""The :class:`~labkit_widgets.explorer.Explorer`'s controls: the ipywidget of each knob, the
rows they sit in, and the notes that say which values ``RunConfig.validate`` holds back and
why. The knobs themselves — the fields, their candidate values, which apply, the
configuration they compose and the values validate accepts — are
:mod:`labkit_widgets.explorer_knobs`' (importable from here as before).

* :func:`make_widget` — the ipywidget of a knob, labelled so that nothing is cut;
  :data:`ROWS` groups them.
* :func:`tooltip_now` — a control's tooltip, with the values it holds back and why.
* :func:`unavailable_html` — the note under the controls: every value not offered, with
  validate's reason, and the knobs greyed because they have no effect.

A control's value ``"auto"`` is the field's ``None`` (the job picks: the whole local batch,
one flush, the schedule's own stages per rank).
"""
from __future__ import annotations

from labkit.config import RunConfig

from .explorer_knobs import (  # noqa: F401  (moved; importable from here as before)
    AUTO, BUCKETS_MB, _DEGREES, RUN_MODELS, DEFAULTS, Knob, _upto, _batch_divisors, _fixed,
    _buckets, _schedules, _models, _policies, KNOBS, NAMES, BY_NAME, _APPLIES, applies,
    to_field, to_control, initial_values, compose, check, no_effect_reason, availability,
    candidates)

__all__ = ["DEFAULTS", "Knob", "KNOBS", "NAMES", "AUTO", "ROWS", "applies", "compose", "check",
           "availability", "candidates", "tooltip_now", "initial_values", "RUN_MODELS", "OPEN_LINES", "to_field", "to_control",
           "no_effect_reason", "label", "pairs", "make_widget", "unavailable_html"]


def tooltip_now(knob: Knob, avail: dict) -> str:
    """The control's tooltip with, when it holds values back, which and validate's reason
    (hovering the model dropdown at ``ep=2`` says why only ``tiny-moe`` is offered)."""
    if not avail["refused"]:
        return knob.tooltip
    groups: dict = {}
    for v, why in avail["refused"].items():
        groups.setdefault(_strip(why, knob.name, v), []).append(label(v))
    return (knob.tooltip + "\nnot offered now: "
            + "; ".join(f"{', '.join(vs)}: {why}" for why, vs in groups.items()))


# --------------------------------------------------------------------------- widgets
#: control rows: (group label, control names)
ROWS = (("model", ("model",)),
        ("data", ("dp", "micro_batch", "zero_stage", "hsdp_replicas", "prefetch")),
        ("DDP", ("dp_mode", "bucket_mb")),
        ("pipeline", ("pp", "schedule", "microbatches", "virtual_stages")),
        ("compute", ("checkpoint", "precision")),
        ("tp, cp, ep", ("tp", "sequence_parallel", "cp", "cp_method", "cp_zigzag", "ep")))
#: toggle buttons wide enough for their longest value ("selective")
_BUTTON_WIDTH = {"zero_stage": "34px", "dp_mode": "60px", "checkpoint": "78px",
                 "precision": "52px"}


def label(v) -> str:
    """How a control shows the value ``v`` (``0.01``, ``1``, ``auto``, ``1f1b``; a model
    given as a ``ModelConfig`` by its name)."""
    if isinstance(v, float):
        return f"{v:g}"
    name = getattr(v, "name", None)  # a ModelConfig passed as base_config.model
    return f"{name} (custom)" if isinstance(name, str) and not isinstance(v, str) else str(v)


def pairs(values: list) -> list:
    """``[(label, value)]`` options of a selection widget."""
    return [(label(v), v) for v in values]


def make_widget(knob: Knob, value):
    """The ipywidget of ``knob`` showing ``value`` (options are filled in later). Labels
    size to their text (``description_width: initial``) so none is cut at any width."""
    import ipywidgets as W

    style = {"description_width": "initial"}
    common = dict(description=knob.label, tooltip=knob.tooltip, style=style)
    if knob.kind == "check":
        return W.Checkbox(value=value, indent=False, layout=W.Layout(width=knob.width),
                          **common)
    if knob.kind == "toggle":  # flex: the label beside the buttons, not above them
        style = {**style, "button_width": _BUTTON_WIDTH.get(knob.name, "60px")}
        return W.ToggleButtons(options=pairs([value]), value=value,
                               layout=W.Layout(display="flex", align_items="center",
                                               width="auto"), **{**common, "style": style})
    if knob.kind == "dropdown":
        return W.Dropdown(options=pairs([value]), value=value,
                          layout=W.Layout(width=knob.width), **common)
    return W.SelectionSlider(options=pairs([value]), value=value, continuous_update=False,
                             layout=W.Layout(width=knob.width), **common)


def _strip(why: str, name: str, v) -> str:
    """validate's message without a leading ``name=value:`` (so equal reasons merge)."""
    for head in (f"{name}={v!r}: ", f"{name}={v}: "):
        if why.startswith(head):
            return why[len(head):]
    return why


#: at most this many reasons are listed open; more fold under a summary that counts them
OPEN_LINES = 6


def unavailable_html(avail: dict, cfg: RunConfig, world_size: int) -> str:
    """The note under the controls: per control, the values not offered with validate's
    reason (values with the same reason on one line), then the knobs greyed because they
    have no effect in ``cfg``, with validate's reason; ``""`` when nothing is held back.

    Every reason is in the page, none behind a scroll area: up to :data:`OPEN_LINES` are
    listed open; a longer list folds under a ``<details>`` summary that counts them and
    names the controls ("unavailable now: 14 values of dp, pp, tp, ep; 6 knobs greyed"),
    one click away."""
    import html

    lines, held = [], []
    for knob in KNOBS:
        a = avail[knob.name]
        if not a["applies"] or not a["refused"]:
            continue
        held.append((knob.name, len(a["refused"])))
        groups: dict = {}
        for v, why in a["refused"].items():
            groups.setdefault(_strip(why, knob.name, v), []).append(label(v))
        lines += [f"<li><b>{knob.name}={', '.join(vs)}</b>: {html.escape(why)}</li>"
                  for why, vs in groups.items()]
    greyed = [f"<li><b>{k.name}</b> greyed: "
              f"{html.escape(no_effect_reason(cfg, k.name, world_size))}</li>"
              for k in KNOBS if not avail[k.name]["applies"]]
    if not lines + greyed:
        return ""
    n_values = sum(n for _name, n in held)
    counts = []
    if held:
        counts.append(f"{n_values} value{'s' * (n_values != 1)} of "
                      + ", ".join(name for name, _n in held))
    if greyed:
        counts.append(f"{len(greyed)} knob{'s' * (len(greyed) != 1)} greyed")
    is_open = " open" if len(lines + greyed) <= OPEN_LINES else ""
    # one reason per line, the refused values first, then the knobs with no effect
    return (f"<details{is_open} class='labkit-unavailable' style='font-size:11px;"
            f"color:#555;line-height:1.35'><summary>unavailable now: {'; '.join(counts)} "
            f"<span style='color:#888'>(validate's reasons{'' if is_open else ': click'})"
            "</span></summary><ul style='margin:2px 0;padding-left:18px'>"
            + "".join(lines + greyed) + "</ul></details>")
