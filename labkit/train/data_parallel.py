"""The data-parallel wrappers of a rank's stages (DESIGN.md §9, last before the optimizer):
plain DDP buckets at ZeRO 0, flat units sharded over ``dp_shard × cp`` at ZeRO 1–3 and
replicated over ``dp_replicate`` (HSDP), PyTorch's DDP or FSDP2 for ``impl="torch"``, the
tied-embedding copy kept out of the flat units, and expert parameters summed over their own
expert-data group. Every reduction is a plain sum (the one loss rule of
:mod:`labkit.train.build`).
"""
from __future__ import annotations

from torch import nn

from ..parallel.dp import DataParallel, torch_ddp
from .rank_setup import RankSetup


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
