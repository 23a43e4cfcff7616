"""What each transformer layer of the training job keeps for backward, by part, beside C18.

:func:`job_layer_activations` builds this rank's stages exactly as :func:`labkit.train.run`
does (:func:`labkit.train.build.build_rank`: pipeline split, tensor/sequence, context and
expert parallelism, ZeRO, the job's precision), runs one microbatch forward of the job's own
batch under the job's autocast, and counts the tensors each block saves for backward, by part
(:func:`labkit.parallel.tensor.activations.measure_block_activations`). Beside it,
:func:`predicted_layer_activations` gives C18's count for the same layout
(:func:`~labkit.parallel.tensor.activations.megatron_block_terms`) plus each named term labkit
keeps beyond it (:func:`~labkit.parallel.tensor.activations.labkit_adjustments`).

:func:`fake_layer_activations` runs the same measurement for one rank of a cluster-scale
layout under fake tensors and a fake process group (:mod:`labkit.measure.fake_world`), so
Llama 3 405B's layer on its rank is measured on this CPU with no memory.
"""
from __future__ import annotations

import torch

__all__ = ["job_layer_activations", "fake_layer_activations", "predicted_layer_activations"]


def _precision_bytes(cfg) -> tuple:
    """``(e, r)``: bytes of an activation and of the residual stream: bf16 parameters (ZeRO
    over several data ranks) keep both at 2; bf16 autocast over fp32 weights computes in 2
    and keeps the stream in fp32; fp32 keeps 4 and 4."""
    from labkit.train.data import bf16_parameters

    if cfg.precision != "bf16":
        return 4, 4
    return (2, 2) if bf16_parameters(cfg) else (2, 4)


def predicted_layer_activations(cfg) -> dict:
    """C18 for one layer of ``cfg`` (a :class:`labkit.config.RunConfig` of a dense GPT) on one
    rank: ``{"megatron": {part: bytes}, "adjustments": {term: {part: bytes}}, "total":
    {part: bytes}, "per_forward": {"rotary tables": bytes}}`` for one microbatch
    (``cfg.micro`` sequences of ``S/cp`` tokens), SP with re-gathered inputs as the job runs
    it, SDPA or its blockwise context-parallel core. The rotary rows a stage indexes per
    forward (with SP or CP) are kept once for all its layers, charged to the first block.

    Raises:
        ValueError: a layout this count does not describe (mixture-of-experts, or a
            context-parallel method other than ``"ring"``, whose all-gather or all-to-all
            keep other tensors).
    """
    from labkit.parallel.tensor.activations import (block_activation_parts, labkit_adjustments,
                                                    megatron_block_terms)

    mc, p = cfg.model_config, cfg.parallel
    if mc.n_experts or mc.kind != "gpt":
        raise ValueError("the per-layer count describes a dense GPT block")
    if p.cp > 1 and cfg.cp_method != "ring":
        raise ValueError(f"the per-layer count describes ring context parallelism, got "
                         f"cp_method={cfg.cp_method!r}")
    e, r = _precision_bytes(cfg)
    kw = dict(sequence_parallel=cfg.sequence_parallel, bytes_per_elem=e)
    s = mc.seq_len // p.cp
    # the job runs a GPT as pipeline stages, which with SP or CP index their rotary rows per
    # forward (fp32 cos and sin, (S/cp, D/2) each): kept once for all the layers
    positions = (cfg.sequence_parallel and p.tp > 1) or p.cp > 1
    rope = 2 * s * (mc.head_dim // 2) * 4 if positions else 0
    return {"megatron": megatron_block_terms(mc, cfg.micro, s, p.tp, **kw),
            "adjustments": labkit_adjustments(mc, cfg.micro, s, p.tp, resid_bytes=r, **kw),
            "total": block_activation_parts(mc, cfg.micro, s, p.tp, resid_bytes=r, **kw),
            "per_forward": {"rotary tables": rope}}


def job_layer_activations(ctx, cfg) -> dict:
    """On this rank of ``cfg`` (validated; a dense GPT, ``checkpoint="none"``): the bytes
    each block of its first local stage saves for backward during one microbatch's forward,
    ``{"layers": {global layer index: {part: bytes}}, "outside": {...}, "rank", "coords"}``.
    A job (``cluster.run(job_layer_activations, cfg)``) or, under fake tensors,
    :func:`fake_layer_activations`.

    Raises:
        ValueError: ``checkpoint`` other than ``"none"`` (recomputation keeps other tensors),
            or what :func:`predicted_layer_activations` refuses.
    """
    from labkit.parallel.tensor.activations import measure_block_activations
    from labkit.train.build import build_rank
    from labkit.train.data import rank_batch
    from labkit.train.pipeline import boundary_shape

    if cfg.checkpoint != "none":
        raise ValueError(f"per-layer activations are counted without recomputation, got "
                         f"checkpoint={cfg.checkpoint!r}")
    predicted_layer_activations(cfg)  # the same refusals
    cfg.validate(ctx.world_size)
    mg = ctx.mesh_groups(cfg.mesh)
    setup = build_rank(ctx, cfg, mg)
    stage = setup.stages[min(setup.stages)]
    if stage.is_first:
        x, _ = rank_batch(cfg, 0, mg.index("dp"), setup.device, mg.index("cp"))
        x = x[:cfg.micro]
    else:
        e, r = _precision_bytes(cfg)
        x = torch.zeros(boundary_shape(cfg), dtype=torch.float32 if r == 4 else torch.bfloat16,
                        device=setup.device, requires_grad=True)
    with setup.autocast():
        got = measure_block_activations(stage, x, by_part=True, exclude=setup.memory_module)
    ids = getattr(stage, "layer_ids", list(range(len(stage.layers))))
    return {"layers": {ids[i]: v for i, v in got.items() if i is not None},
            "outside": got.get(None, {}), "rank": ctx.rank, "coords": cfg.mesh.coords(ctx.rank)}


def fake_layer_activations(cfg, rank: int = 0) -> dict:
    """:func:`job_layer_activations` for rank ``rank`` of ``cfg`` under fake tensors and a
    fake process group (:func:`labkit.measure.fake_rank.fake_rank_memory`'s stand-ins; any
    world size); with a pipeline only the blocks of the rank's stages are built.

    Raises:
        ValueError: ``rank`` outside the world; what :func:`job_layer_activations` refuses.
        RuntimeError: ``torch.distributed`` is already initialised in this process.
    """
    from .fake_world import _fake_mode, fake_process_group

    with fake_process_group(cfg, rank) as ctx, _fake_mode():
        return job_layer_activations(ctx, cfg)
