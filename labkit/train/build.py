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

This module composes the steps; :class:`RankSetup` (:mod:`labkit.train.rank_setup`), the
model-parallel steps (:mod:`labkit.train.model_parallel`) and the data-parallel wrappers
(:mod:`labkit.train.data_parallel`) live in their own modules.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..mesh import MeshGroups
from ..models import build_model
from ..parallel.dp import unique_parameters
from .cache import fresh_model, keep_stages, reuse_stages
# the steps live in their own modules; every name stays importable from here, and
# build_rank calls them through this module's names (benchmarks/warm_rerun.py times them)
from .data_parallel import (_data_parallel, _expert_data_parallel, _Holder,  # noqa: F401
                            _torch_fsdp)
from .model_parallel import (_checkpoint, _context_parallel, _expert_parallel,
                             _split_pipeline, _tensor_parallel, _tie_across_stages)
from .rank_setup import RankSetup

__all__ = ["RankSetup", "build_rank"]


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


def _precision(cfg, device) -> Callable:
    """bf16 compute: ZeRO 1–3 keep bf16 parameters in their flat units (fp32 masters in
    the optimizer); everything else autocasts the forward to bf16 over fp32 weights."""
    import contextlib

    from .data import bf16_parameters

    if cfg.precision == "fp32" or bf16_parameters(cfg):
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


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
