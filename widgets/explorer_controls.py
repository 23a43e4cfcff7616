"""The :class:`~labkit_widgets.explorer.Explorer`'s controls: one per degree and knob of a
:class:`~labkit.config.RunConfig`, the configuration they describe, and which values
``RunConfig.validate`` accepts from where the controls stand now.

* :data:`KNOBS` — every control: its ``RunConfig`` field (``dp``/``tp``/``pp``/``cp``/``ep``
  go to ``parallel``), its widget, label and candidate values. The ``model`` control offers
  the presets the job trains at interactive speed (:data:`RUN_MODELS`); ``ep`` is offered
  only on a mixture-of-experts model (validate's reason is listed otherwise), and the
  dataset follows the model's kind (digits for the ViT, text for the GPTs).
* :func:`applies` — whether a knob takes effect under the other controls (prefetch only at
  ZeRO-3, the schedule only with ``pp > 1`` …). These mirror the composition rules of
  :mod:`labkit.validate`, which refuses a knob that would be ignored; a knob that does not
  apply is greyed and its field left at the default, so its control keeps the user's
  choice for when it applies again (no other control is ever changed behind the user's back).
* :func:`compose` — the ``RunConfig`` of a set of control values: knobs that do not apply at
  their defaults, and a model shallower than ``pp · V`` stages deepened to one layer per
  stage (:func:`~labkit.parallel.pipeline.report.deepen_for_pipeline`), said in a note.
* :func:`availability` — for each control, the candidate values whose configuration
  validates on the cluster (offered) and the rest with ``validate``'s own reason; the
  checks are pure Python and cached per config. :func:`unavailable_html` is the note that
  lists them under the controls.
* :func:`make_widget` — the ipywidget of a knob, labelled so that nothing is cut.

A control's value ``"auto"`` is the field's ``None`` (the job picks: the whole local batch,
one flush, the schedule's own stages per rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from labkit.config import RunConfig

from . import _style as S

__all__ = ["DEFAULTS", "Knob", "KNOBS", "NAMES", "AUTO", "ROWS", "applies", "compose", "check",
           "availability", "candidates", "tooltip_now", "initial_values", "RUN_MODELS", "OPEN_LINES", "to_field", "to_control",
           "no_effect_reason", "label", "pairs", "make_widget", "unavailable_html"]

#: the control value meaning the field's ``None``
AUTO = "auto"
#: DDP bucket sizes offered (MiB): the tiny model's gradients are ~0.5 MB, so buckets
#: below 1 MiB are where the all-reduce count changes
BUCKETS_MB = (0.001, 0.01, 0.1, 1.0, 25.0)
_DEGREES = ("dp", "tp", "pp", "cp", "ep")
#: model presets the explorer offers: the ones a warm CPU pool trains in well under a
#: second a step (gpt2-124m runs too, minutes a step on CPU; the llama3 presets are for
#: planning only, see labkit.config.COUNT_ONLY)
RUN_MODELS = ("tiny", "tiny-moe", "small", "vit-digits")
#: every field at its dataclass default: what labkit.validate calls "left alone" (it
#: refuses a knob that would be ignored unless it is at this value)
DEFAULTS = RunConfig()


@dataclass(frozen=True)
class Knob:
    """One control. ``kind``: ``"slider"`` (SelectionSlider), ``"toggle"``
    (ToggleButtons), ``"dropdown"`` or ``"check"`` (Checkbox). ``values(ws, base)`` lists
    the candidates for a cluster of ``ws`` ranks."""

    name: str
    label: str
    kind: str
    values: Callable[[int, RunConfig], list]
    tooltip: str = ""
    width: str = "250px"


def _upto(ws: int, _base) -> list:
    return list(range(1, ws + 1))


def _batch_divisors(_ws: int, base) -> list:
    return [AUTO] + S.divisors(base.global_batch)


def _fixed(*values) -> Callable:
    return lambda _ws, _base: list(values)


def _buckets(_ws: int, base) -> list:
    return sorted(set(BUCKETS_MB) | {float(base.bucket_mb)})


def _schedules(_ws: int, _base) -> list:
    from labkit.parallel.pipeline.schedules import SCHEDULES

    return list(SCHEDULES)


def _models(_ws: int, _base) -> list:
    return list(RUN_MODELS)


def _policies(_ws: int, base) -> list:
    return ["none", "full", "selective"] + (["every"] if base.checkpoint == "every" else [])


KNOBS: tuple = (
    Knob("model", "lab model", "dropdown", _models,
         "the model the ranks train: tiny (dense GPT), tiny-moe (4 experts a layer, the one "
         "ep splits), small (a deeper GPT), vit-digits (a ViT on 8x8 digits, data "
         "parallelism only)", "190px"),
    Knob("dp", "dp", "slider", _upto, "data-parallel degree: ranks that each hold a replica "
         "(or a shard, with ZeRO) and take 1/dp of the batch"),
    Knob("micro_batch", "micro-batch", "slider", _batch_divisors,
         "samples per forward/backward on one data rank; 'auto' = the whole local batch "
         "(with pp: local batch / microbatches)"),
    Knob("zero_stage", "ZeRO", "toggle", _fixed(0, 1, 2, 3),
         "0 replicate all; 1 shard optimizer state; 2 + gradients; 3 + parameters (FSDP)"),
    Knob("hsdp_replicas", "HSDP M", "slider", _upto,
         "HSDP: M replica groups of dp/M shards each (ZeRO 1-3); 1 = shard over all dp",
         "280px"),
    Knob("prefetch", "prefetch", "check", _fixed(True, False),
         "ZeRO-3: issue the next unit's all-gather before computing this one", "110px"),
    Knob("dp_mode", "sync", "toggle", _fixed("ddp", "naive"),
         "ddp: bucketed all-reduce overlapped with backward; naive: one all-reduce per "
         "parameter after backward"),
    Knob("bucket_mb", "bucket MiB", "slider", _buckets, "DDP bucket capacity in MiB"),
    Knob("pp", "pp", "slider", _upto, "pipeline-parallel degree: ranks that each hold a "
         "slice of the layers"),
    Knob("schedule", "schedule", "dropdown", _schedules, "pipeline schedule", "190px"),
    Knob("microbatches", "microbatches M", "slider", _batch_divisors,
         "microbatches per pipeline flush; 'auto' = all of a step's in one flush", "300px"),
    Knob("virtual_stages", "virtual stages V", "slider",
         _fixed(AUTO, 1, 2, 3, 4), "stages per pipeline rank; 'auto' = what the schedule "
         "needs (interleaved 2, ZB-V 2, the others 1)", "300px"),
    Knob("checkpoint", "recompute", "toggle", _policies,
         "activation checkpointing: none; full = recompute each block; selective = "
         "recompute attention and element-wise ops"),
    Knob("precision", "precision", "toggle", _fixed("fp32", "bf16"),
         "bf16 compute with fp32 master weights and Adam state"),
    Knob("tp", "tp", "slider", _upto, "tensor-parallel degree"),
    Knob("sequence_parallel", "sequence parallel", "check", _fixed(False, True),
         "with tp > 1: norms on S/tp tokens, all-gather/reduce-scatter", "160px"),
    Knob("cp", "cp", "slider", _upto, "context-parallel degree"),
    Knob("cp_method", "cp method", "dropdown", _fixed("ring", "ulysses", "allgather"),
         "how context parallelism shares keys and values", "190px"),
    Knob("cp_zigzag", "zigzag", "check", _fixed(True, False),
         "balance causal attention work with the zigzag split", "100px"),
    Knob("ep", "ep", "slider", _upto, "expert-parallel degree (a view over the data ranks)"),
)
NAMES: tuple = tuple(k.name for k in KNOBS)
BY_NAME = {k.name: k for k in KNOBS}

#: when each knob takes effect, from the other controls' values — labkit.validate's
#: composition rules (it refuses a knob that would be ignored); knobs not listed always do
_APPLIES: dict = {
    "schedule": lambda v: v["pp"] > 1,
    "microbatches": lambda v: v["pp"] > 1,
    "virtual_stages": lambda v: v["pp"] > 1,
    "sequence_parallel": lambda v: v["tp"] > 1,
    "cp_method": lambda v: v["cp"] > 1,
    "cp_zigzag": lambda v: v["cp"] > 1,
    "hsdp_replicas": lambda v: v["zero_stage"] >= 1,
    "prefetch": lambda v: v["zero_stage"] == 3,
    "dp_mode": lambda v: v["zero_stage"] == 0,
    "bucket_mb": lambda v: v["zero_stage"] == 0 and v["dp_mode"] == "ddp",
}


def applies(name: str, values: dict) -> bool:
    """True when control ``name`` takes effect given every control's ``values``."""
    rule = _APPLIES.get(name)
    return rule is None or bool(rule(values))


def to_field(name: str, value):
    """Control value → ``RunConfig`` field value (``"auto"`` → ``None``)."""
    return None if value == AUTO else value


def to_control(name: str, value):
    """``RunConfig`` field value → control value (``None`` → ``"auto"``; bucket as float)."""
    if value is None:
        return AUTO
    return float(value) if name == "bucket_mb" and not isinstance(value, bool) else value


def initial_values(base: RunConfig) -> dict:
    """Every control's value for the configuration ``base``."""
    return {k: to_control(k, getattr(base.parallel if k in _DEGREES else base, k))
            for k in NAMES}


def compose(base: RunConfig, values: dict) -> tuple:
    """``(RunConfig, notes)`` for the control ``values`` on top of ``base``: knobs that do
    not apply at their defaults; a model with fewer layers than ``pp · V`` stages deepened
    to one layer per stage (the note says so). Not validated."""
    from labkit.parallel.pipeline.report import deepen_for_pipeline

    fields = {k: to_field(k, v) if applies(k, values) else getattr(DEFAULTS, k)
              for k, v in values.items() if k not in _DEGREES}
    cfg = base.replace(**fields, **{k: values[k] for k in _DEGREES})
    if cfg.dataset in ("text", "digits"):  # the data the model's kind reads
        cfg = cfg.replace(dataset="digits" if cfg.model_config.kind == "vit" else "text")
    deep = deepen_for_pipeline(cfg)
    notes = []
    if deep is not cfg:
        notes.append(f"model deepened from {cfg.model_config.n_layers} to "
                     f"{deep.model_config.n_layers} layers: one per pipeline stage")
    return deep, notes


def check(cfg: RunConfig, world_size: int, cache: Optional[dict] = None) -> Optional[str]:
    """``None`` when ``cfg`` validates on ``world_size`` ranks, else validate's message."""
    key = (cfg, world_size)
    if cache is not None and key in cache:
        return cache[key]
    try:
        cfg.validate(world_size)
        why = None
    except ValueError as exc:
        why = str(exc)
    if cache is not None:
        cache[key] = why
    return why


def no_effect_reason(cfg: RunConfig, name: str, world_size: int) -> str:
    """Why knob ``name`` has no effect in ``cfg``, in validate's words (it refuses a
    non-default value there: "…has no effect here: <why>")."""
    default = getattr(DEFAULTS, name)
    alt = next((to_field(name, v) for v in BY_NAME[name].values(world_size, cfg)
                if to_field(name, v) != default), None)
    why = check(cfg.replace(**{name: alt}), world_size) if alt is not None else None
    marker = "has no effect here: "
    return why.split(marker, 1)[1] if why and marker in why else "it does not apply here"


def availability(base: RunConfig, values: dict, world_size: int,
                 cache: Optional[dict] = None) -> dict:
    """For each control: ``{"offer": [values validate accepts, changing only this control],
    "refused": {value: validate's message}, "applies": bool}``. The current value is always
    offered (an invalid starting configuration is reported by the status line)."""
    out = {}
    for knob in KNOBS:
        offer, refused, now = [], {}, values[knob.name]
        for v in candidates(knob, world_size, base, now):
            why = None if v == now else check(compose(base, {**values, knob.name: v})[0],
                                              world_size, cache)
            if why is None:
                offer.append(v)
            else:
                refused[v] = why
        out[knob.name] = {"offer": offer, "refused": refused,
                          "applies": applies(knob.name, values)}
    return out


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


def candidates(knob: Knob, world_size: int, base: RunConfig, now) -> list:
    """The knob's candidate values, with the current value ``now`` in its place when it is
    not one of them (``set(bucket_mb=0.05)``): "auto" first, then increasing."""
    vals = knob.values(world_size, base)
    if now in vals:
        return vals
    if isinstance(now, bool) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                        for v in vals + [now] if v != AUTO):
        return vals + [now]
    nums = sorted([v for v in vals if v != AUTO] + [now])
    return ([AUTO] if AUTO in vals else []) + nums


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
