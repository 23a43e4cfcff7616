"""One rank's part of the training job, composed in the order DESIGN.md §9 fixes:

    full model from the seed → pipeline split → (tensor → context → expert) →
    zero-bubble backward split → activation checkpointing → precision, compile →
    data parallelism / ZeRO / FSDP / HSDP over the data ranks → AdamW

Every rank builds the *whole* model from the seed first, so each piece it keeps is
bit-identical to the single-process reference's, with no broadcast. (A rank measured under
fake tensors, :mod:`labkit.measure.fake_rank`, builds only the layers its stages keep: its
weights hold no values, and the rest of a 126-layer model would cost time only.) Then:

* **Pipeline.** With ``pp > 1`` the rank keeps its stages (:class:`StageModule`, stage
  ids from the schedule); without, one stage holds the whole GPT (the ViT is its own stage).
* **Data parallelism** wraps *each stage* over the data ranks (``dp_cp`` group): plain DDP
  buckets at ZeRO 0; flat units sharded over ``dp_shard × cp`` at ZeRO 1–3, replicated
  over ``dp_replicate`` (HSDP). With one data rank nothing is wrapped: there is nothing to
  reduce. A tied embedding whose two copies live on different pipeline ranks is summed
  between them (:class:`TiedEmbedding`) before any data-parallel reduction; under ZeRO it
  is kept out of the flat units and reduced by a small DDP wrapper, because the sharded
  units reduce-scatter their gradients during backward, before the two copies could meet.
* **Warm re-runs.** A rank that ran the same config before reuses the stages it composed,
  restored to their values as composed (:mod:`labkit.train.cache`); wrappers and optimizer
  are always new.
* **Loss rule.** Every rank's loss is the sum of its token losses over the *global*
  token count, and every gradient reduction is a plain sum, so no divisor depends on a
  group's size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..mesh import MeshGroups
from ..models import build_model
from ..parallel.dp import DataParallel, torch_ddp, unique_parameters
from .cache import fresh_model, keep_stages, reuse_stages

__all__ = ["RankSetup", "build_rank"]


@dataclass
class RankSetup:
    """What one rank trains with.

    Attributes:
        stages: ``{stage id: module}`` this rank holds (``{0: model}`` without a pipeline).
        forward: ``{stage id: callable}`` that runs each stage (its data-parallel wrapper).
        wrappers: data-parallel wrappers, in the order their gradients are synchronised.
        sharded: wrappers with flat units (ZeRO 1–3): they own ``after_step``/``zero_grad``.
        schedule, store, tied: the pipeline schedule, zero-bubble weight-gradient store and
            tied-embedding exchange (``None`` without a pipeline).
        opt: AdamW over what this rank updates.
        n_params: the whole model's parameters; rank_params: this rank's stages' (unsharded).
        autocast: the context forward passes run in (bf16 autocast or nothing).
        track: tensors the memory tracker should count as this rank's working set.
        plain_params: the optimizer's parameters outside flat units (their ``.grad`` is
            cleared after each step; the units clear their own).
        reused: what a warm rank took from its cache instead of building
            (:mod:`labkit.train.cache`).
    """

    cfg: Any
    mg: MeshGroups
    device: Any
    stages: dict
    forward: dict
    wrappers: list = field(default_factory=list)
    sharded: list = field(default_factory=list)
    schedule: Any = None
    store: Any = None
    tied: Any = None
    opt: Any = None
    n_params: int = 0
    rank_params: int = 0
    autocast: Callable = None
    track: list = field(default_factory=list)
    plain_params: list = field(default_factory=list)
    cp_core: Any = None
    tp_info: Any = None
    expert_params: list = field(default_factory=list)
    reused: list = field(default_factory=list)

    @property
    def memory_module(self) -> nn.Module:
        """What the memory tracker walks: the wrappers that own flat units, else the stages."""
        if self.sharded:
            return nn.ModuleList(self.sharded + [m for m in self.stages.values()
                                                 if not any(w.module is m for w in self.sharded)])
        return nn.ModuleList(self.stages.values())

    def require_sync(self, on: bool) -> None:
        """Let the wrappers' backward hooks reduce (``True``) or only accumulate."""
        for w in self.wrappers:
            if hasattr(w, "require_backward_grad_sync"):  # PyTorch DDP's no_sync flag
                w.require_backward_grad_sync = on
            else:
                w.require_sync = on


def build_rank(ctx, cfg, mg: MeshGroups) -> RankSetup:
    """Compose this rank's stages, wrappers and optimizer for ``cfg`` (validated).

    A warm rank re-running ``cfg`` takes the stages it composed for it before, restored to
    their values as composed (:mod:`labkit.train.cache`); the tied-embedding exchange, the
    data-parallel wrappers and the optimizer are built afresh either way.
    ``setup.reused`` names what came from the rank's cache (``"stages"``, ``"model"``)."""
    setup = reuse_stages(ctx, cfg, mg, RankSetup)
    if setup is not None:
        setup.reused.append("stages")
    else:
        setup = _compose_stages(ctx, cfg, mg)
        keep_stages(ctx, setup)
    _tie_across_stages(setup)
    setup.autocast = _precision(cfg, ctx.device)
    _data_parallel(setup)
    setup.opt = _optimizer(setup)
    return setup


def _compose_stages(ctx, cfg, mg: MeshGroups) -> RankSetup:
    """The full model from the seed (under fake tensors, only this rank's layers) → this
    rank's pipeline stages → tensor, context and expert parallelism → activation
    checkpointing → compiled blocks."""
    mc, device = cfg.model_config, ctx.device
    keep = _stage_layers_only(ctx, cfg, mg)
    if keep is None:
        model, copied = fresh_model(ctx, cfg)  # build_model(mc, device, cfg.seed), or its copy
        n_params = sum(p.numel() for _, p in unique_parameters(model))
    else:
        model, copied = build_model(mc, device, cfg.seed, layers=keep), False
        n_params = _whole_model_params(model, keep)
    setup = RankSetup(cfg, mg, device, {}, {}, n_params=n_params)
    if copied:
        setup.reused.append("model")
    if mc.kind == "vit":
        setup.stages = {0: model}
        if cfg.parallel.tp > 1 or cfg.parallel.cp > 1:  # labkit.parallel.vision
            from ..parallel.vision import apply_vit_parallel

            setup.tp_info, setup.cp_core = apply_vit_parallel(
                model, tp_group=mg.group("tp") if cfg.parallel.tp > 1 else None,
                cp_group=mg.group("cp") if cfg.parallel.cp > 1 else None,
                sequence_parallel=cfg.sequence_parallel, cp_method=cfg.cp_method,
                zigzag=cfg.cp_zigzag)
    else:
        _split_pipeline(setup, model)
        _tensor_parallel(setup)
        _context_parallel(setup)
        _expert_parallel(setup)
    del model  # the stages keep their own pieces; the rest of the full model is freed
    setup.rank_params = sum(p.numel() for _, p in unique_parameters(
        nn.ModuleList(setup.stages.values())))
    _checkpoint(setup)
    if cfg.compile:
        for m in setup.stages.values():
            for block in m.layers:
                block.compile()
    return setup


def _stage_layers_only(ctx, cfg, mg: MeshGroups) -> Optional[list]:
    """The layers this rank's pipeline stages keep, when it may build only those: a rank
    measured under fake tensors (``ctx.stage_layers_only``, set by
    :mod:`labkit.measure.fake_rank`), a GPT, ``pp > 1``. ``None``: build the whole model
    from the seed, as every real rank does (:class:`~labkit.models.gpt.GPT` refuses a
    partial build of real tensors)."""
    mc = cfg.model_config
    if not getattr(ctx, "stage_layers_only", False) or mc.kind != "gpt" or cfg.parallel.pp == 1:
        return None
    from ..parallel.pipeline.split import layer_ranges

    sched = cfg.build_schedule()
    ranges = layer_ranges(mc.n_layers, sched.n_stages)  # as StageModule splits them
    return sorted({i for s in sched.stages_of(mg.index("pp")) for i in ranges[s]})


def _whole_model_params(model: nn.Module, keep: list) -> int:
    """The whole model's parameter count from one built with only the blocks ``keep``:
    every block is built from the same config, so each missing one has a built one's."""
    block = sum(p.numel() for _, p in unique_parameters(model.layers[keep[0]]))
    built = sum(p.numel() for _, p in unique_parameters(model))
    return built + (len(model.layers) - len(keep)) * block


def _split_pipeline(setup: RankSetup, model: nn.Module) -> None:
    from ..parallel.pipeline.stage import StageModule, WeightGradStore, _swap_linears

    cfg, mg = setup.cfg, setup.mg
    if cfg.parallel.pp == 1:
        setup.stages = {0: StageModule(model, 0, 1)}
        return
    sched = cfg.build_schedule()
    pp_index = mg.index("pp")
    setup.schedule = sched
    setup.stages = {s: StageModule(model, s, sched.n_stages) for s in sched.stages_of(pp_index)}
    if sched.split_backward and cfg.impl != "torch":  # PyTorch's ZBV splits B/W itself
        setup.store = WeightGradStore()
        for m in setup.stages.values():
            _swap_linears(m, setup.store)


def _tie_across_stages(setup: RankSetup) -> None:
    """The tied embedding's two copies (first and last stage, on different pipeline ranks)
    are summed before any data-parallel reduction — taken after tensor parallelism, whose
    vocabulary shards are the parameters that train."""
    cfg, mg = setup.cfg, setup.mg
    if setup.schedule is None:
        return
    from ..parallel.pipeline.stage import TiedEmbedding

    setup.tied = TiedEmbedding(cfg.model_config, setup.schedule, mg.index("pp"), setup.stages,
                               mg.group("pp"), pp_ranks=mg.ranks("pp"))


def _tensor_parallel(setup: RankSetup) -> None:
    """Each stage sliced to this rank's tensor-parallel shard (Shoeybi et al. 2019 §3;
    Korthikanti et al. 2022 for sequence parallelism): column/row-parallel attention and
    SwiGLU, vocab-parallel embedding, head and cross-entropy. Every tp rank computes the same
    loss and ends backward with complete gradients for its shard. With sequence parallelism
    the column-parallel inputs are re-gathered in backward (``regather``)."""
    cfg, mg = setup.cfg, setup.mg
    if cfg.parallel.tp == 1:
        return
    from ..parallel.tensor import apply_tensor_parallel

    seq = cfg.model_config.seq_len // cfg.parallel.cp  # what attention sees on this rank
    for m in setup.stages.values():
        # with SP, column-parallel matmuls keep the S/T shard and re-gather it in backward,
        # as Megatron-LM does (Korthikanti et al. 2022 §4.2.2; claim C18)
        setup.tp_info = apply_tensor_parallel(m, mg.group("tp"),
                                              sequence_parallel=cfg.sequence_parallel,
                                              regather=cfg.sequence_parallel, seq_len=seq)
    _retie_vocab_shard(setup)


def _retie_vocab_shard(setup: RankSetup) -> None:
    """A V schedule (zb-v, dualpipe-v) puts the first and the last stage on one rank, where
    the tied head *is* the embedding Parameter — but tensor parallelism converts each stage
    on its own, so each would get its own vocabulary shard and the tie would silently break
    (the head's gradient never reaching ``tok_emb.weight``, and no :class:`TiedEmbedding`
    exchange either, as both stages share a rank). Both shards hold the same rows
    ``[rank·V'/T, (rank+1)·V'/T)`` of the same table, so the head takes the embedding's."""
    if not setup.cfg.model_config.tie_embeddings or setup.schedule is None:
        return
    first, last = 0, setup.schedule.n_stages - 1
    if first in setup.stages and last in setup.stages:
        emb, head = setup.stages[first].tok_emb, setup.stages[last].head
        head.weight = emb.weight


def _context_parallel(setup: RankSetup) -> None:
    """Every block's attention runs the context-parallel core over the ``cp`` group, and
    rotary positions follow this rank's (zigzag) share of the sequence (Liu et al. 2023;
    Jacobs et al. 2023; Dubey et al. 2024 §3.3.2)."""
    cfg, mg = setup.cfg, setup.mg
    if cfg.parallel.cp == 1:
        return
    from ..parallel.context import make_attention_core, positions

    mc = cfg.model_config
    core = make_attention_core(cfg.cp_method, mg.group("cp"), causal=True,
                               zigzag=cfg.cp_zigzag, seq_len=mc.seq_len)
    pos = positions(mg.index("cp"), cfg.parallel.cp, mc.seq_len, cfg.cp_zigzag,
                    device=setup.device)
    for m in setup.stages.values():
        m.positions = pos
        for block in m.layers:
            block.attn.core = core
    setup.cp_core = core


def _expert_parallel(setup: RankSetup) -> None:
    """Mixture-of-experts layers: each forward's load-balancing loss enters the objective by
    its share of the global batch (the one loss rule), and with ``ep > 1`` each rank keeps
    ``E/ep`` experts of every layer, tokens reaching them by all-to-all (Lepikhin et al.
    2020, GShard §2; Fedus et al. 2021, Switch §2.2)."""
    cfg, mg = setup.cfg, setup.mg
    if not cfg.model_config.n_experts:
        return
    from ..models.moe import set_aux_loss_scale

    p = cfg.parallel
    # PyTorch's DDP and FSDP2 average over the data ranks: like the token loss (step.py's
    # grad_scale), the aux loss is multiplied by their number so the average undoes it
    averaged = mg.size("dp_cp") if cfg.impl == "torch" else 1
    for m in setup.stages.values():  # one forward = one microbatch of S/cp tokens
        set_aux_loss_scale(m, averaged * cfg.micro / (cfg.global_batch * p.cp))
    if p.ep == 1:
        return
    from ..parallel.expert import apply_expert_parallel, expert_parameters

    for m in setup.stages.values():
        apply_expert_parallel(m, mg.group("ep"))
        setup.expert_params += [q for _, q in expert_parameters(m)]


def _checkpoint(setup: RankSetup) -> None:
    cfg = setup.cfg
    if cfg.checkpoint == "none":
        return
    from ..parallel.checkpoint.policy import apply_checkpoint_policy

    for m in setup.stages.values():
        apply_checkpoint_policy(m, cfg.checkpoint, cfg.checkpoint_every)


def _precision(cfg, device) -> Callable:
    """bf16 compute: ZeRO 1–3 keep bf16 parameters in their flat units (fp32 masters in
    the optimizer); everything else autocasts the forward to bf16 over fp32 weights."""
    import contextlib

    from .data import bf16_parameters

    if cfg.precision == "fp32" or bf16_parameters(cfg):
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _data_parallel(setup: RankSetup) -> None:
    cfg, mg = setup.cfg, setup.mg
    setup.forward = dict(setup.stages)
    if mg.size("dp_cp") == 1:
        return
    group = mg.group("dp_cp")
    experts = {id(p) for p in setup.expert_params}
    if cfg.zero_stage == 0:
        seen: set = set(experts)  # a parameter two local stages share (ZB-V's ends): once
        for s, m in setup.stages.items():
            if cfg.impl == "torch":
                w = torch_ddp(m, group, cfg.bucket_mb, cfg.find_unused)
            else:
                w = DataParallel(m, group, cfg.dp_mode, cfg.bucket_mb, cfg.find_unused,
                                 reduce_op="sum",
                                 ignored_params=[p for p in m.parameters() if id(p) in seen])
            seen |= {id(p) for p in m.parameters()}
            setup.wrappers.append(w)
            setup.forward[s] = w
        _expert_data_parallel(setup)
        return
    if cfg.impl == "torch":
        setup.forward = {s: _torch_fsdp(setup, m) for s, m in setup.stages.items()}
        return
    from ..parallel.zero import FullyShardedDataParallel
    from ..parallel.zero import ZeroDataParallel

    shard = mg.group("fsdp") if mg.size("fsdp") > 1 else mg.cache.get(mg.ranks("fsdp"))
    repl = mg.maybe_group("dp_replicate")
    mixed = cfg.precision == "bf16"
    tied = setup.tied.param if setup.tied is not None else None
    for s, m in setup.stages.items():
        kw = dict(mixed_precision=mixed, reduce_op="sum")
        ignored = [p for p in m.parameters() if p is tied or id(p) in experts]
        if ignored:
            kw["ignored_params"] = ignored
        if cfg.zero_stage == 3:
            w = FullyShardedDataParallel(m, shard, repl, prefetch=cfg.prefetch,
                                         keep_last=cfg.keep_last, **kw)
            setup.track += w.gathered_buffers()
        else:
            w = ZeroDataParallel(m, shard, repl, stage=cfg.zero_stage, **kw)
        if mixed:
            setup.track += [u.master for u in w.units]
        setup.wrappers.append(w)
        setup.sharded.append(w)
        setup.forward[s] = w
        if tied is not None and any(p is tied for p in ignored):
            # the tied copy: replicated, summed by a DDP wrapper
            setup.wrappers.append(DataParallel(_Holder(tied), group, "naive", reduce_op="sum"))
    _expert_data_parallel(setup)


def _expert_data_parallel(setup: RankSetup) -> None:
    """Expert parameters are summed over their expert-data group (the ranks holding the same
    experts), not over all data ranks: each rank's experts saw only the tokens routed to
    them."""
    mg = setup.mg
    if setup.expert_params and mg.size("edp") > 1:
        holder = _Holder(*setup.expert_params)
        setup.wrappers.append(DataParallel(holder, mg.group("edp"), "naive", reduce_op="sum",
                                           axis="edp"))


class _Holder(nn.Module):
    """A module around some parameters, so a DDP wrapper can reduce them alone."""

    def __init__(self, *params: nn.Parameter):
        super().__init__()
        self.params = nn.ParameterList(params)


def _torch_fsdp(setup: RankSetup, model: nn.Module) -> nn.Module:
    """PyTorch FSDP2: ``fully_shard`` every block, then the stage, on a 1-D (shard) or 2-D
    (replicate, shard) ``DeviceMesh`` built from the cached groups."""
    from torch.distributed.fsdp import fully_shard

    mg = setup.mg
    axes = ("dp_replicate", "fsdp") if mg.size("dp_replicate") > 1 else ("fsdp",)
    kw = {"mesh": mg.device_mesh(axes, setup.device.type)}
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _optimizer(setup: RankSetup) -> torch.optim.Optimizer:
    cfg = setup.cfg
    params: list = []
    seen: set = set()
    for w in setup.sharded:
        params += [u.master for u in w.units]
    # what is still an nn.Parameter of a stage: everything without ZeRO; with it, what the
    # flat units left out (a tied copy across stages, expert parameters)
    extra = [p for m in setup.stages.values() for _, p in unique_parameters(m)]
    for p in extra:
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
            setup.plain_params.append(p)
    # on CUDA the fused kernel (one launch for all tensors), as a tuned training loop uses
    fused = setup.device.type == "cuda" and all(p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                             eps=cfg.adam_eps, **({"fused": True} if fused else {}))
