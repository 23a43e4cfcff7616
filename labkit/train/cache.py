"""What a warm rank keeps between runs of the training job, in ``ctx.cache``, and why it
cannot change a result.

A slider re-run of an unchanged composition repeats work whose outcome the warm rank
already holds. Three things are kept, each under a key holding everything it depends on:

* **The composed stages** (:func:`keep_stages`, :func:`reuse_stages`): this rank's stage
  modules after the pipeline split, tensor parallelism and checkpointing, with a copy of
  every parameter and buffer as composing left it. Key: the whole ``RunConfig``, the job's
  world size, this rank and device. A re-run copies the values back (``copy_``), puts
  torch's generators where composing left them, and builds the data-parallel wrappers, the
  optimizer and the pipeline executor afresh, as a cold run does (their state, DDP's initial
  broadcast included, is never reused). Before reusing, the stages' structure is compared
  with the one recorded when they were composed (every module's attributes, hooks and
  children, every tensor's identity, shape, gradient, hooks and attributes): anything a run
  left behind sends the rank back to composing.
  Only compositions whose wrappers leave the stage modules as they found them qualify
  (:func:`reusable`): labkit's own implementation, plain data parallelism (ZeRO 1–3 flatten
  the parameters into their units), no context or expert parallelism (their attention core
  and routing count what they see), no ``torch.compile``.
* **The model built from the seed** (:func:`fresh_model`): the last ``build_model(model
  config, device, seed)`` of this rank, pristine, with torch's CPU generator state right
  after building. Another composition of the same model deep-copies it instead of
  initialising every weight again: the same tensors bit for bit (a tied head stays tied),
  the same generator state afterwards.
* **Measurements of an unchanged config** (:func:`measured`): the pipeline's one-way
  message latency, taken once per ``RunConfig`` and world size; the job reports that it
  reused it.

Bounded: one model; one composition per world size the pool has run jobs on (each at most
:data:`MODEL_CACHE_MAX_BYTES`, twice: the modules and their pristine values); the
measurements of the last :data:`MEASURED_CONFIGS` configs per world size.

Consistent across ranks without a message: what is kept per world size ``W`` is touched only
by jobs on ``W`` ranks, and every such job runs on ranks ``0 … W−1`` of the pool, so those
ranks see the same configs in the same order and hit or miss alike; a measurement that
runs collectives (the latency's ping-pong) is therefore taken on every rank of the job or on
none. A failed, cancelled or timed-out job restarts the whole pool, clearing every cache.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..models import build_model

__all__ = ["fresh_model", "measured", "reusable", "keep_stages", "reuse_stages",
           "MODEL_CACHE_MAX_BYTES", "MEASURED_CONFIGS"]

#: the largest model or composition (parameter and buffer bytes) a rank keeps a copy of
MODEL_CACHE_MAX_BYTES = 16 * 2**20
#: configs per world size whose measurements are kept
MEASURED_CONFIGS = 4

_MODEL = "train.pristine_model"
_STAGES = "train.stages"
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _tensors(modules) -> list:
    """Every parameter and buffer of ``modules``, each once, in a fixed order."""
    seen, out = set(), []
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _seed_like_build(seed: int, cpu_state: torch.Tensor) -> None:
    """torch's generators as ``build_model(seed=seed)`` and what followed it left them: every
    CUDA generator seeded with ``seed`` (lazily, as ``torch.manual_seed`` does), the CPU one
    at ``cpu_state``."""
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    torch.set_rng_state(cpu_state)


def fresh_model(ctx, cfg) -> tuple:
    """``(model, copied)``: ``build_model(cfg.model_config, ctx.device, cfg.seed)``, from
    this rank's pristine copy (``copied=True``) when its last build had the same three
    arguments. torch's generators end where building leaves them."""
    mc, device = cfg.model_config, ctx.device
    key = (mc, cfg.seed, str(device))
    slot = ctx.cache.get(_MODEL)
    if slot is not None and slot[0] == key:
        _, pristine, cpu_rng = slot
        _seed_like_build(cfg.seed, cpu_rng)
        return copy.deepcopy(pristine), True
    ctx.cache.pop(_MODEL, None)  # one pristine model per rank: drop the last before building
    model = build_model(mc, device=device, seed=cfg.seed)
    if _nbytes(_tensors([model])) <= MODEL_CACHE_MAX_BYTES:
        ctx.cache[_MODEL] = (key, copy.deepcopy(model), torch.get_rng_state())
    return model, False


def measured(ctx, cfg, name: str, measure: Callable[[], Any]) -> tuple:
    """``(value, cached)``: ``measure()`` taken now (``cached=False``) the first time this
    rank runs ``cfg`` on ``ctx.world_size`` ranks, the stored value (``True``) on re-runs
    of that config while it is among the last :data:`MEASURED_CONFIGS` of that world size.
    Every rank of the job gets the same ``cached``, so ``measure`` may run collectives."""
    store = ctx.cache.setdefault(("train.measured", ctx.world_size), OrderedDict())
    entry = store.get(cfg)
    if entry is not None and name in entry:
        store.move_to_end(cfg)
        return entry[name], True
    value = measure()
    store.setdefault(cfg, {})[name] = value
    store.move_to_end(cfg)
    while len(store) > MEASURED_CONFIGS:
        store.popitem(last=False)
    return value, False


def reusable(cfg, mg) -> bool:
    """Whether a run of ``cfg`` leaves its composed stages as it found them, up to the
    values of their tensors (see the module docstring)."""
    mc = cfg.model_config
    return (cfg.impl == "labkit" and not cfg.compile and mc.kind == "gpt"
            and not mc.n_experts and cfg.parallel.cp == 1
            and (cfg.zero_stage == 0 or mg.size("dp_cp") == 1))


@dataclass
class _Kept:
    key: tuple
    stages: dict
    fields: dict  # the RankSetup fields composing set: schedule, store, tp_info, counts
    tensors: list  # (tensor, its value as composed)
    structure: tuple
    pinned: list  # every object whose id the structure records, kept alive
    cpu_rng: torch.Tensor


def _key(ctx, cfg) -> tuple:
    return (cfg, ctx.world_size, ctx.rank, str(ctx.device))


def keep_stages(ctx, setup) -> None:
    """Keep ``setup``'s freshly composed stages (no step has run) for a re-run of its config
    on this rank, when :func:`reusable` and small enough; replaces what was kept for this
    world size."""
    slot = (_STAGES, ctx.world_size)
    ctx.cache.pop(slot, None)
    if not reusable(setup.cfg, setup.mg):
        return
    modules = [setup.stages[s] for s in sorted(setup.stages)]
    tensors = _tensors(modules)
    if _nbytes(tensors) > MODEL_CACHE_MAX_BYTES or any(t.grad is not None for t in tensors):
        return
    pinned: list = []
    fields = {k: getattr(setup, k) for k in ("schedule", "store", "tp_info", "n_params",
                                             "rank_params")}
    ctx.cache[slot] = _Kept(_key(ctx, setup.cfg), dict(setup.stages), fields,
                            [(t, t.detach().clone()) for t in tensors],
                            _structure(setup.stages, pinned), pinned, torch.get_rng_state())


def reuse_stages(ctx, cfg, mg, make_setup: Callable[..., Any]):
    """The kept stages of ``cfg`` as composing left them, in ``make_setup(cfg, mg, device,
    stages, {}, **fields)``; ``None`` (and the kept stages dropped) when nothing is kept for
    this config or a run changed their structure."""
    slot = (_STAGES, ctx.world_size)
    kept = ctx.cache.get(slot)
    if kept is None or kept.key != _key(ctx, cfg):
        return None
    if _structure(kept.stages, []) != kept.structure:  # a gradient left over, a hook, ...
        ctx.cache.pop(slot)
        return None
    _restore_values(kept)
    _seed_like_build(cfg.seed, kept.cpu_rng)
    return make_setup(cfg, mg, ctx.device, dict(kept.stages), {}, **kept.fields)


@torch.no_grad()
def _restore_values(kept: _Kept) -> None:
    for t, value in kept.tensors:
        t.copy_(value)


def _structure(stages: dict, pinned: list) -> tuple:
    """What a run must leave unchanged for the stages to be reused: per module (by name,
    every alias) its type and attributes — children, parameters and buffers by identity,
    hooks, flags, and labkit objects it holds (the zero-bubble weight-gradient store) by
    their attributes; per tensor its identity, shape, dtype, device, ``requires_grad``,
    gradient, tensor hooks and attributes. Objects and types appear by ``id``, so the
    nested tuples hold only atoms and the garbage collector stops walking them; ``pinned``
    collects those objects, so no new object can take one of their ids while they are
    kept."""
    out = []
    for s in sorted(stages):
        for name, m in stages[s].named_modules(remove_duplicate=False):
            out.append((s, name, _kind(m, pinned), _value(vars(m), pinned, 0)))
        for name, t in list(stages[s].named_parameters(remove_duplicate=False)) + \
                list(stages[s].named_buffers(remove_duplicate=False)):
            pinned.append(t)
            out.append((s, name, id(t), tuple(t.shape), t.dtype, t.device, t.requires_grad,
                        t.grad is None, len(t._backward_hooks or ()),
                        len(getattr(t, "_post_accumulate_grad_hooks", None) or ()),
                        _value(vars(t), pinned, 0)))
    return tuple(out)


def _kind(v, pinned: list) -> int:
    pinned.append(type(v))
    return id(type(v))


def _value(v, pinned: list, depth: int):
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (torch.Tensor, nn.Module)) or depth > 6:
        pinned.append(v)
        return (_kind(v, pinned), id(v))
    if isinstance(v, dict):
        return (_kind(v, pinned), tuple((_value(k, pinned, depth + 1), _value(x, pinned, depth + 1))
                                        for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return (_kind(v, pinned), tuple(_value(x, pinned, depth + 1) for x in v))
    if isinstance(v, (set, frozenset)):
        return (_kind(v, pinned),
                tuple(sorted((_value(x, pinned, depth + 1) for x in v), key=repr)))
    pinned.append(v)
    if type(v).__module__.startswith("labkit") and hasattr(v, "__dict__"):
        return (_kind(v, pinned), id(v), _value(vars(v), pinned, depth + 1))
    return (_kind(v, pinned), id(v))
