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
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Optional

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


def _int(cfg, name: str, low: int = 1) -> None:
    v = getattr(cfg, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")


def _number(v, name: str, low: float, strict: bool) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or (v <= low if strict else v < low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low}, "
                         f"got {v!r}")


def default(cfg, name: str):
    """The default of field ``name`` of ``cfg``'s dataclass (what "left alone" means)."""
    f = {f.name: f for f in dataclasses.fields(cfg)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _refuse_unless(cfg, cond: bool, names: tuple, why: str) -> None:
    """Refuse a non-default value of any of ``names`` unless ``cond``: a field that would
    be ignored is an error, never a silent no-op."""
    if cond:
        return
    for name in names:
        v = getattr(cfg, name)
        if v != default(cfg, name):
            raise ValueError(f"{name}={v!r} has no effect here: {why}")


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


def _pipeline(cfg, mc) -> None:
    p = cfg.parallel
    if p.pp == 1:
        return
    from .parallel.pipeline.schedules import SCHEDULES, STAGES_PER_RANK

    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; known schedules: "
                         f"{', '.join(SCHEDULES)}")
    if cfg.accum_steps % cfg.flush_microbatches:
        raise ValueError(f"microbatches={cfg.flush_microbatches} per flush does not divide the "
                         f"{cfg.accum_steps} microbatches of a step (local batch "
                         f"{cfg.local_batch} / micro_batch {cfg.micro})")
    v, layers = cfg.stages_per_rank, mc.n_layers
    need = STAGES_PER_RANK.get(cfg.schedule)
    if need is not None and v != need:
        raise ValueError(f"schedule {cfg.schedule!r} runs {need} stage(s) per rank, got "
                         f"virtual_stages={v}")
    if cfg.n_stages > layers:
        raise ValueError(f"pp x virtual_stages = {p.pp} x {v} = {cfg.n_stages} stages but the "
                         f"model has n_layers={layers}: more stages than layers")
    cfg.build_schedule()  # the schedule's own limits (e.g. interleaved M vs P)
    if cfg.impl == "torch":
        _torch_schedule_rules(cfg)


TORCH_SCHEDULE_CLASS = {"zb-v": "ZBVZeroBubble", "dualpipe-v": "ScheduleDualPipeV"}


def _torch_schedule_rules(cfg) -> None:
    """PyTorch's ``torch.distributed.pipelining`` schedules check these on the ranks; labkit
    checks them before launch (torch 2.13, ``schedules.py``)."""
    p, m = cfg.parallel.pp, cfg.flush_microbatches
    if cfg.schedule not in ("gpipe", "1f1b", "interleaved", "zb-v", "dualpipe-v"):
        raise ValueError(f"impl='torch' runs gpipe, 1f1b, interleaved (Interleaved1F1B), "
                         f"zb-v (ZBVZeroBubble) or dualpipe-v (DualPipeV), got "
                         f"schedule={cfg.schedule!r}")
    if cfg.schedule == "1f1b" and m < p:
        raise ValueError(f"PyTorch's Schedule1F1B needs microbatches >= pp: microbatches={m} "
                         f"< pp={p}")
    if cfg.schedule in ("interleaved", "zb-v"):
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"PyTorch's {cfg.schedule} schedule needs microbatches={m} to be "
                             f"a multiple of max(1, microbatches // pp) = {rounds} rounds")
    if cfg.schedule == "zb-v" and cfg.model_config.tie_embeddings:
        raise ValueError("impl='torch' with schedule='zb-v' and tie_embeddings=True: the V "
                         "places the embedding and the head on rank 0, and PyTorch's "
                         "ZBVZeroBubble gets that shared weight's gradient wrong; untie the "
                         "model (ModelConfig(tie_embeddings=False)) or use impl='labkit'")
    if cfg.schedule in ("zb-v", "dualpipe-v") and cfg.measure_memory:
        # found by the composition matrix (tests/oracle): every rank raised
        cls = TORCH_SCHEDULE_CLASS[cfg.schedule]
        raise ValueError(f"impl='torch' with schedule={cfg.schedule!r} and measure_memory=True: "
                         f"under torch's MemTracker (the memory-tracked step) {cls}'s "
                         "input-gradient pass (autograd.grad on a stage input) fails on every "
                         "rank; set measure_memory=False or use impl='labkit'")
    if cfg.flushes != 1:
        raise ValueError(f"impl='torch' runs one pipeline flush per step, got "
                         f"{cfg.flushes} flushes ({cfg.accum_steps} microbatches of a step / "
                         f"microbatches={cfg.flush_microbatches})")


def _noise_scale(cfg, mc) -> None:
    """``noise_scale=True`` reads the local gradient before the reduction and the reduced
    one after it (:mod:`labkit.train.noise_scale`): where a rank's gradient is not one
    data replica's whole-model gradient, or no rank holds it, the two norms would be of
    something else, so the compositions not yet measured are refused."""
    if not cfg.noise_scale:
        return
    p = cfg.parallel
    why = None
    if p.dp < 2:
        why = (f"it compares each data rank's local gradient with the all-reduced one, and "
               f"dp={p.dp} gives one batch size only")
    elif cfg.zero_stage >= 2:
        why = (f"zero_stage={cfg.zero_stage} drops each unit's full local gradient once its "
               "reduce-scatter completes inside backward; measured at zero_stage 0 and 1")
    elif cfg.hsdp_replicas > 1:
        why = (f"hsdp_replicas={cfg.hsdp_replicas} reduces over two groups; measured with one "
               "shard group over all data ranks")
    elif cfg.impl != "labkit":
        why = "PyTorch's DDP reduces inside backward, so no local gradient is left to read"
    elif p.tp > 1 or p.pp > 1 or p.cp > 1:
        why = (f"a rank holds part of the model or of the sequence (tp={p.tp}, pp={p.pp}, "
               f"cp={p.cp}); measured with pure data parallelism only")
    elif mc.n_experts:
        why = (f"a mixture of experts (n_experts={mc.n_experts}) reduces its experts over "
               "another group; measured for dense models only")
    if why:
        raise ValueError(f"noise_scale=True cannot be honoured: {why}")


def _composition(cfg, mc) -> None:
    p, z = cfg.parallel, cfg.zero_stage
    _refuse_unless(cfg, p.pp > 1, ("schedule", "microbatches", "virtual_stages"),
                   "it is a pipeline setting and pp=1")
    _refuse_unless(cfg, p.tp > 1, ("sequence_parallel",), "sequence parallelism needs tp > 1")
    _refuse_unless(cfg, p.cp > 1, ("cp_method", "cp_zigzag"), "context parallelism is off (cp=1)")
    _refuse_unless(cfg, z >= 1, ("hsdp_replicas",), "HSDP needs zero_stage 1-3 (stage 0 is "
                   "plain data parallelism over all data ranks)")
    _refuse_unless(cfg, z == 3, ("prefetch", "keep_last"), "it is a ZeRO-3/FSDP setting and "
                   f"zero_stage={z}")
    _refuse_unless(cfg, z == 0, ("dp_mode", "find_unused"), f"zero_stage={z} shards with "
                   "flat units (they reduce zeros for unused parameters themselves)")
    _refuse_unless(cfg, z == 0 and cfg.dp_mode == "ddp", ("bucket_mb",),
                   "buckets exist only in dp_mode='ddp' at zero_stage=0")
    _refuse_unless(cfg, p.dp * p.cp > 1, ("dp_mode", "bucket_mb"),
                   f"there is one data rank (dp x cp = {p.dp} x {p.cp} = 1): no gradient is "
                   "reduced across ranks")
    _noise_scale(cfg, mc)
    _refuse_unless(cfg, cfg.checkpoint == "every", ("checkpoint_every",),
                   f"it sets the segment length of checkpoint='every' (got {cfg.checkpoint!r})")
    if p.pp > 1 and z >= 1 and cfg.schedule in ("zb-h1", "zb-v", "dualpipe-v"):
        raise ValueError(f"schedule={cfg.schedule!r} with zero_stage={z}: the zero-bubble W "
                         "pass writes weight gradients outside autograd, but ZeRO's flat units "
                         "collect them through autograd; use zero_stage=0 or another schedule")
    if (p.pp > 1 and z >= 1 and cfg.precision == "bf16" and mc.kind == "gpt"
            and mc.tie_embeddings):
        raise ValueError(f"zero_stage={z} with pp={p.pp}, precision='bf16' and a tied "
                         "embedding: the tied copy stays outside the bf16 flat units (its two "
                         "copies are summed across stages first), so the head would mix fp32 "
                         "and bf16; use tie_embeddings=False, precision='fp32' or zero_stage=0")
    if cfg.impl == "torch":
        used = [name for name, on in (("data parallelism", p.dp > 1 or z > 0),
                                      ("pipeline parallelism", p.pp > 1),
                                      ("tensor parallelism", p.tp > 1),
                                      ("context parallelism", p.cp > 1)) if on]
        if len(used) != 1 or p.cp > 1 or p.tp > 1:
            raise ValueError(f"impl='torch' runs PyTorch's own version of ONE parallelism "
                             f"(DDP, FSDP2 or pipelining) as a reference; this run uses "
                             f"{' and '.join(used) or 'none'} (PyTorch's tensor parallelism "
                             "is compared in tests/test_tensor_parallel.py; its context "
                             "parallelism does not run on CPU)")
        if p.ep > 1:
            # DDP would broadcast rank 0's experts over the others' and average different
            # experts; FSDP2 would shard each rank's expert slice as if it were replicated
            raise ValueError(f"impl='torch' with ep={p.ep}: PyTorch's DDP and FSDP2 treat "
                             f"every parameter as replicated over the {p.dp} data ranks, but "
                             f"each rank holds {mc.n_experts // p.ep} of the {mc.n_experts} "
                             "experts of a layer; use ep=1 or impl='labkit'")
        if z in (1, 2):
            raise ValueError(f"impl='torch' has no ZeRO-{z}: PyTorch's references are DDP "
                             "(zero_stage=0) and FSDP2 fully_shard (zero_stage=3)")
        if z == 0 and cfg.dp_mode != "ddp":
            raise ValueError("impl='torch' at zero_stage=0 is PyTorch DDP; dp_mode must be 'ddp'")
        if cfg.compile or cfg.checkpoint != "none" or cfg.precision != "fp32":
            raise ValueError("impl='torch' is a plain fp32 reference: compile, checkpoint and "
                             "precision stay at their defaults")
    if cfg.compile and z == 3:
        raise ValueError("compile=True with zero_stage=3: labkit's FSDP re-installs parameter "
                         "views on every forward, which torch.compile would re-trace; use "
                         "zero_stage 0-2")


def _rank_limits(cfg) -> None:
    """What the ranks themselves would refuse or fail on, refused here first (found by the
    generated configs of tests/test_validate_property.py)."""
    p, z = cfg.parallel, cfg.zero_stage
    data_ranks = p.dp * p.cp
    if z == 3 and cfg.checkpoint == "every" and cfg.checkpoint_every > 1 and data_ranks > 1:
        raise ValueError(f"zero_stage=3 with checkpoint='every' and checkpoint_every="
                         f"{cfg.checkpoint_every}: a segment's first block recomputes all "
                         f"{cfg.checkpoint_every} of its blocks, but each ZeRO-3 unit is one "
                         "block and gathers its parameters only when its own forward runs; "
                         "use checkpoint_every=1, checkpoint='full' or 'selective', or "
                         "zero_stage 0-2")
    if cfg.impl == "torch" and z == 3 and cfg.hsdp_replicas > 1 and cfg.hsdp_replicas == p.dp:
        raise ValueError(f"impl='torch' with hsdp_replicas={cfg.hsdp_replicas} = dp={p.dp}: "
                         "every replica would be one shard, and PyTorch's FSDP2 mesh "
                         "(replicate, shard) is built here with a shard degree > 1; use "
                         "hsdp_replicas < dp or impl='labkit'")


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
