"""The :class:`~labkit_widgets.explorer.Explorer`'s knobs: one per degree and knob of a
:class:`~labkit.config.RunConfig`, the configuration they describe, and which values
``RunConfig.validate`` accepts from where the controls stand now. Pure Python, no widget
(the widgets and the notes under them are :mod:`labkit_widgets.explorer_controls`', which
re-exports every name here).

* :data:`KNOBS` — every control: its ``RunConfig`` field (``dp``/``tp``/``pp``/``cp``/``ep``
  go to ``parallel``), its widget kind, label and candidate values. The ``model`` control
  offers the presets the job trains at interactive speed (:data:`RUN_MODELS`); ``ep`` is
  offered only on a mixture-of-experts model (validate's reason is listed otherwise), and
  the dataset follows the model's kind (digits for the ViT, text for the GPTs).
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
  checks are pure Python and cached per config.

A control's value ``"auto"`` is the field's ``None`` (the job picks: the whole local batch,
one flush, the schedule's own stages per rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from labkit.config import RunConfig

from . import _style as S

__all__ = ["DEFAULTS", "Knob", "KNOBS", "NAMES", "BY_NAME", "AUTO", "BUCKETS_MB", "RUN_MODELS",
           "applies", "to_field", "to_control", "initial_values", "compose", "check",
           "no_effect_reason", "availability", "candidates"]

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
