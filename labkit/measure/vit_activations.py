"""What each block of the training job's ViT keeps for backward, measured on its rank
(claim C45's check of :func:`labkit.plan.video.vit_activation_bytes`).

:func:`job_vit_layer_activations` builds this rank's ViT exactly as :func:`labkit.train.run`
does (:func:`labkit.train.build.build_rank`: tensor/sequence and context parallelism, the
job's precision), runs one microbatch of the job's own images forward under the job's
autocast, and counts the tensors each block saves for backward, by part
(:func:`labkit.parallel.tensor.activations.measure_block_activations`: saved-tensor hooks,
each storage once, parameters excluded).
"""
from __future__ import annotations

__all__ = ["job_vit_layer_activations"]


def job_vit_layer_activations(ctx, cfg) -> dict:
    """On this rank of ``cfg`` (a ViT run, validated, ``checkpoint="none"``): ``{"layers":
    {layer: {part: bytes}}, "outside": {part: bytes}, "tokens_per_rank", "rank"}``.

    Raises:
        ValueError: not a ViT, or a checkpoint policy (recomputation keeps other tensors).
    """
    from labkit.parallel.tensor.activations import measure_block_activations
    from labkit.train.build import build_rank
    from labkit.train.data import rank_batch

    if cfg.model_config.kind != "vit":
        raise ValueError(f"job_vit_layer_activations measures a ViT, got kind="
                         f"{cfg.model_config.kind!r}")
    if cfg.checkpoint != "none":
        raise ValueError(f"per-layer activations are counted without recomputation, got "
                         f"checkpoint={cfg.checkpoint!r}")
    cfg.validate(ctx.world_size)
    mg = ctx.mesh_groups(cfg.mesh)
    setup = build_rank(ctx, cfg, mg)
    model = setup.stages[0]
    x, _ = rank_batch(cfg, 0, mg.index("dp"), setup.device, mg.index("cp"))
    with setup.autocast():
        got = measure_block_activations(model, x[:cfg.micro], by_part=True,
                                        exclude=setup.memory_module)
    return {"layers": {i: v for i, v in got.items() if i is not None},
            "outside": got.get(None, {}), "rank": ctx.rank,
            "tokens_per_rank": model.n_tokens // cfg.parallel.cp}
