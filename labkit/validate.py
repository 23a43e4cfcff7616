"""Every rule a :class:`~labkit.config.RunConfig` must satisfy, checked before launch.

:func:`validate_run` raises :class:`ConfigError` (a ``ValueError``) naming the field and the
numbers, in the caller, before any rank process is touched (DESIGN.md §3). In a notebook the
error shows as its sentence alone (see :class:`ConfigError`). The rules, in the order they are checked:

1. **Fields**: types and ranges (positive degrees and batch sizes, ``lr > 0``, known
   names for modes, schedules, policies, precisions).
2. **Mesh**: ``dp·tp·pp·cp`` ranks fit the cluster; ``ep`` divides ``dp·cp`` (it is a view
   over those ranks); HSDP replicas divide ``dp``.
3. **Batch**: ``global_batch`` divides by ``dp``, the local batch by ``micro_batch``, the
   step's microbatches by the pipeline flush's ``microbatches``.
4. **Shapes**: at least one layer per stage (``pp·V`` stages; uneven stages follow
   :mod:`labkit.parallel.pipeline.split`), and what tensor, context and expert parallelism
   need of heads, widths, sequence and experts.
5. **Schedules**: each schedule's own limits (interleaved's ``M`` vs ``P``), and PyTorch's
   schedules' rules for ``impl="torch"`` (1F1B needs ``M >= P``; interleaved and ZB-V need
   ``M`` a multiple of ``max(1, M // P)`` rounds; ZB-V exactly 2 stages per rank).
6. **Composition**: a field the composition cannot honour is refused, never ignored —
   ZeRO knobs without ZeRO, pipeline knobs without a pipeline, DDP knobs with ZeRO, the
   zero-bubble ``W`` pass with ZeRO's flat units, PyTorch references for more than one
   parallelism at a time or with ``ep > 1`` (their wrappers take every parameter as
   replicated).

Rules 1–4 and the snapshot and fault fields are checked here; the pipeline rules (5) live
in :mod:`labkit.validate_pipeline`, the composition rules (6) in
:mod:`labkit.validate_composition`, and the helpers they share in :mod:`labkit.validate_common`
(all re-exported here).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

# every rule is still importable from here (notebooks, tests and tools name labkit.validate)
from .validate_common import _int, _number, _refuse_unless, default  # noqa: F401
from .validate_composition import _composition, _noise_scale, _rank_limits  # noqa: F401
from .validate_pipeline import (TORCH_SCHEDULE_CLASS, _pipeline,  # noqa: F401
                                _torch_schedule_rules)

__all__ = ["ConfigError", "validate_run", "default", "CHECKPOINT_POLICIES", "PRECISIONS", "CP_METHODS"]

#: mirrors labkit.parallel.checkpoint.policy.POLICIES (kept here so validation needs no torch)
CHECKPOINT_POLICIES = ("none", "full", "every", "selective")
PRECISIONS = ("fp32", "bf16")
CP_METHODS = ("ring", "ulysses", "allgather")


class ConfigError(ValueError):
    """A configuration labkit refuses before launch; the message names the field(s) and
    the numbers. A ``ValueError``, so ``except ValueError`` catches it.

    In IPython (a notebook cell, the ``ipython`` shell) it is shown as
    ``ConfigError: <the sentence>`` with no traceback: the frames would be labkit's
    validation code, which says nothing the sentence does not, and the learner's own line
    is the one that holds the configuration. It is still an exception: the cell fails and
    a run-all (or nbval) stops there. IPython asks an exception for ``_render_traceback_``
    before formatting frames (``InteractiveShell.showtraceback``); a plain ``python``
    interpreter ignores it and prints the usual traceback.
    """

    def _render_traceback_(self) -> list:
        """The lines IPython shows instead of the traceback: the class name and message."""
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


def validate_run(cfg, world_size: Optional[int] = None) -> None:
    """Check ``cfg`` for a cluster of ``world_size`` ranks (``None``: any size).

    Raises:
        ConfigError: the first rule broken, naming the field(s) and the numbers (every
            rule's ``ValueError``, here or in the configs' own ``validate``, becomes one;
            the original stays as ``__context__``).
    """
    try:
        _check_run(cfg, world_size)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_run(cfg, world_size: Optional[int]) -> None:
    _fields(cfg)
    mc = cfg.model_config
    p = cfg.parallel
    # -- mesh ---------------------------------------------------------------------------
    if world_size is not None and p.world_size > world_size:
        raise ValueError(f"parallel degrees need dp x tp x pp x cp = {p.dp} x {p.tp} x {p.pp} "
                         f"x {p.cp} = {p.world_size} ranks but the cluster has "
                         f"world_size={world_size}")
    if (p.dp * p.cp) % p.ep:
        raise ValueError(f"ep={p.ep} must divide the data ranks dp x cp = {p.dp} x {p.cp} = "
                         f"{p.dp * p.cp}: expert parallelism is a view over them")
    if p.dp % cfg.hsdp_replicas:
        raise ValueError(f"hsdp_replicas={cfg.hsdp_replicas} does not divide dp={p.dp} "
                         f"(HSDP needs M replica groups of dp/M shards)")
    # -- batch --------------------------------------------------------------------------
    if cfg.global_batch % p.dp:
        raise ValueError(f"global_batch={cfg.global_batch} is not divisible by dp={p.dp}: "
                         "every data-parallel rank needs the same number of samples")
    if cfg.local_batch % cfg.micro:
        raise ValueError(f"global_batch={cfg.global_batch} is not divisible by dp x "
                         f"micro_batch = {p.dp} x {cfg.micro} = {p.dp * cfg.micro}")
    _model(cfg, mc)
    _pipeline(cfg, mc)
    _composition(cfg, mc)
    _rank_limits(cfg)
    _faults(cfg)
    _snapshot(cfg)


def _fields(cfg) -> None:
    cfg.model_config.validate()
    if cfg.planning_only:
        raise ValueError(f"model preset {cfg.model!r} is for planning and counting only "
                         "(labkit.plan); train 'tiny', 'small' or 'gpt2-124m'")
    cfg.parallel.validate()
    for name in ("steps", "global_batch", "checkpoint_every"):
        _int(cfg, name)
    for name in ("micro_batch", "microbatches", "virtual_stages"):
        if getattr(cfg, name) is not None:
            _int(cfg, name)
    _int(cfg, "hsdp_replicas")
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or cfg.seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {cfg.seed!r}")
    _number(cfg.lr, "lr", 0, strict=True)
    _number(cfg.weight_decay, "weight_decay", 0, strict=False)
    _number(cfg.adam_eps, "adam_eps", 0, strict=True)
    _number(cfg.timeout_s, "timeout_s", 0, strict=True)
    _number(cfg.bucket_mb, "bucket_mb", 0, strict=True)
    if isinstance(cfg.zero_stage, bool) or cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {cfg.zero_stage!r}")
    choices = {"dataset": ("text", "digits"), "dp_mode": ("ddp", "naive"),
               "checkpoint": CHECKPOINT_POLICIES, "precision": PRECISIONS,
               "cp_method": CP_METHODS, "impl": ("labkit", "torch")}
    for name, known in choices.items():
        if getattr(cfg, name) not in known:
            hint = (" (PyTorch DDP is impl='torch')" if name == "dp_mode"
                    and cfg.dp_mode == "torch" else "")
            raise ValueError(f"{name} must be one of {', '.join(map(repr, known))}, got "
                             f"{getattr(cfg, name)!r}{hint}")
    for name in ("prefetch", "keep_last", "find_unused", "sequence_parallel", "cp_zigzag",
                 "compile", "measure_memory", "count_flops", "return_state", "return_grads",
                 "noise_scale"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(cfg, name)!r}")


def _snapshot(cfg) -> None:
    """Snapshot fields (:mod:`labkit.snapshot`): their types, and what the files say — a
    resume target that is complete, of this model, with every shard at full length; a save
    folder no other live run is writing."""
    if cfg.save_dir is not None and (not isinstance(cfg.save_dir, (str, os.PathLike))
                                     or not str(cfg.save_dir)):
        raise ValueError(f"save_dir must be a folder path or None, got {cfg.save_dir!r}")
    if cfg.save_dir is not None:
        # like an output file (--trace): the run creates the last folder of the path only,
        # so a mistyped parent is refused here, not turned into a tree of new folders
        d = os.path.abspath(cfg.save_dir)
        if os.path.exists(d) and not os.path.isdir(d):
            raise ValueError(f"save_dir={cfg.save_dir}: that is a file, not a folder")
        if not os.path.isdir(os.path.dirname(d)):
            raise ValueError(f"save_dir={cfg.save_dir}: the folder {os.path.dirname(d)} does "
                             "not exist (the run creates only the last folder of save_dir)")
    _int(cfg, "save_every", 0)
    if cfg.save_every and cfg.save_dir is None:
        raise ValueError(f"save_every={cfg.save_every} has no effect here: set save_dir too")
    r = cfg.resume
    if not (isinstance(r, bool) or (isinstance(r, (str, os.PathLike)) and str(r))):
        raise ValueError(f"resume must be True, False or a snapshot path, got {r!r}")
    if r is True and cfg.save_dir is None:
        raise ValueError("resume=True needs save_dir (the folder to resume from)")
    if cfg.save_dir is not None or r:
        from .snapshot import folder  # reads files only: no torch

        if cfg.save_dir is not None:
            folder.check_lock(cfg.save_dir)
        if r:
            snap = folder.check_resume(cfg)
            note = folder.objective_change(cfg, folder.read_info(snap), snap)
            if note:  # allowed, but never silently: the losses will not match
                warnings.warn(note, folder.ObjectiveChangeWarning, stacklevel=3)


def _model(cfg, mc) -> None:
    p = cfg.parallel
    if (cfg.dataset == "digits") != (mc.kind == "vit"):
        raise ValueError(f"dataset={cfg.dataset!r} does not fit model kind {mc.kind!r} "
                         "(text goes with gpt, digits with vit)")
    if cfg.dataset == "text" and mc.vocab_size < 256:
        raise ValueError(f"dataset='text' is byte-level (token ids 0-255) but vocab_size="
                         f"{mc.vocab_size}: the embedding would be indexed past its end; use "
                         "vocab_size >= 256")
    if mc.kind == "vit":
        from .parallel.vision import check_vit_parallel

        check_vit_parallel(mc, p.tp, p.cp, cfg.sequence_parallel, cfg.cp_zigzag, p.pp, p.ep,
                           cfg.cp_method)
    if cfg.checkpoint == "every":
        from .parallel.pipeline.split import stage_layer_counts

        # every stage checkpoints its own blocks: the smallest stage bounds C
        counts = stage_layer_counts(mc.n_layers, min(cfg.n_stages, mc.n_layers))
        if not 1 <= cfg.checkpoint_every <= min(counts):
            raise ValueError(f"checkpoint_every={cfg.checkpoint_every} must satisfy 1 <= C <= "
                             f"the {min(counts)} blocks of a stage (the smallest of {counts}; "
                             f"n_layers={mc.n_layers}, {cfg.n_stages} stage(s))")
    if p.tp > 1 and mc.kind == "gpt":
        from .parallel.tensor.check import check_tensor_parallel

        # with context parallelism the residual stream holds S/cp tokens of each sequence
        check_tensor_parallel(mc, p.tp, cfg.sequence_parallel, seq_len=mc.seq_len // p.cp)
    if p.cp > 1 and mc.kind == "gpt":
        from .parallel.context.core import check_context_parallel

        check_context_parallel(mc, p.cp, cfg.cp_method, cfg.cp_zigzag, mc.seq_len, tp=p.tp)
    if p.ep > 1 or mc.n_experts:
        from .parallel.expert import check_expert_parallel

        check_expert_parallel(mc, p.ep, p.dp * p.cp)


def _faults(cfg) -> None:
    """Injected faults, the watchdog and the replica fingerprint (labkit.faults)."""
    from .faults.spec import check_faults

    p = cfg.parallel
    check_faults(cfg.faults, p.world_size, cfg.steps, dp=p.dp, zero_stage=cfg.zero_stage,
                 pp=p.pp, impl=cfg.impl)
    if cfg.watchdog_s is not None:
        _number(cfg.watchdog_s, "watchdog_s", 0, strict=True)
        if cfg.watchdog_s >= cfg.timeout_s:
            raise ValueError(f"watchdog_s={cfg.watchdog_s:g} must be below timeout_s="
                             f"{cfg.timeout_s:g}, or the job's timeout fires first")
    if cfg.straggler_s is not None:
        _number(cfg.straggler_s, "straggler_s", 0, strict=True)
    f = cfg.fingerprint_every
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(f"fingerprint_every must be an int >= 0 (0: off), got {f!r}")
    if f and (p.dp < 2 or cfg.zero_stage != 0 or p.pp != 1 or cfg.impl != "labkit"):
        raise ValueError(
            f"fingerprint_every={f} compares full data-parallel replicas: it needs dp >= 2 "
            f"with zero_stage=0, pp=1 and impl='labkit' (got dp={p.dp}, zero_stage="
            f"{cfg.zero_stage}, pp={p.pp}, impl={cfg.impl!r}); ZeRO and pipeline shards "
            "differ by design")
