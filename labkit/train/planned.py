"""What :mod:`labkit.plan` plans for this rank's model state, beside what the job holds.

The planner (:func:`labkit.plan.estimate`) sees a layout, not a run: it divides the
parameters by the degrees and multiplies by bytes per parameter. For the same layout its
per-rank parameters and model state equal what the training job holds, except where the job
does something the planner does not model; :func:`planned_state` says which, in words
(``"note"``), so a view can show the planned figure beside the measured one with its reason.
AdamW's step counters (one 4-byte scalar tensor per parameter tensor it steps) are never in
the plan; they are listed on their own (``"step_counters"``).
"""
from __future__ import annotations

from dataclasses import replace

__all__ = ["plan_layout", "planned_state"]


def plan_layout(cfg):
    """The :class:`labkit.plan.Layout` of ``cfg`` as far as model state goes (the schedule
    and checkpointing change activations only, so they keep the planner's defaults)."""
    from ..plan.layout import MESH_ORDER, Layout

    p, hs = cfg.parallel, cfg.hsdp_replicas
    return Layout(tp=p.tp, cp=p.cp, pp=p.pp, dp=p.dp, ep=p.ep, zero=cfg.zero_stage,
                  dp_shard=(p.dp // hs) * p.cp if cfg.zero_stage == 3 and hs > 1 else None,
                  microbatch=cfg.micro, global_batch=cfg.global_batch,
                  seq_len=cfg.model_config.seq_len, sequence_parallel=cfg.sequence_parallel,
                  order=MESH_ORDER, schedule="1f1b", virtual_stages=1, checkpoint="none")


def planned_state(setup) -> dict:
    """The planner's parameters and model state for this rank (bytes), and why they differ
    from the job's, if they do.

    Returns ``{"rank_params", "parameters", "gradients", "optimizer", "step_counters",
    "note"}``: the first four from :func:`labkit.plan.estimate` (runtime ``labkit-fp32``,
    or its 2/2/12 bytes per parameter where ZeRO keeps bf16 flat units); ``step_counters``
    AdamW's ``4·tensors`` bytes the plan leaves out; ``note`` ``None`` when plan plus step
    counters is what the job holds, else one sentence per reason. A layout the planner
    refuses gives ``None`` figures and the planner's words as the note."""
    from ..plan import estimate
    from ..plan.runtime import runtime_preset

    cfg, mg = setup.cfg, setup.mg
    counters = 4 * sum(len(g["params"]) for g in setup.opt.param_groups)
    out = {"rank_params": None, "parameters": None, "gradients": None, "optimizer": None,
           "step_counters": counters, "note": None}
    bf16_units = cfg.precision == "bf16" and bool(setup.sharded)
    rt = runtime_preset("labkit-fp32")
    if bf16_units:
        rt = replace(rt, name="labkit-bf16-zero", param_bytes=2, grad_bytes=2,
                     optimizer_bytes=12)
    try:
        plan = estimate(cfg.model_config, "h100-server", plan_layout(cfg), runtime=rt,
                        timing=False, detail=False)
    except ValueError as e:  # a model kind or layout the planner refuses, in its words
        out["note"] = f"the planner does not model this layout: {e}"
        return out
    pp = mg.index("pp")
    mem = plan.stage_memory[pp]
    out.update(rank_params=int(round(plan.rank_params[pp])),
               **{c: int(round(mem[c])) for c in ("parameters", "gradients", "optimizer")})
    out["note"] = " ".join(_reasons(setup, bf16_units)) or None
    return out


def _reasons(setup, bf16_units: bool) -> list:
    """What the job holds that the plan does not model, each in a sentence with numbers."""
    cfg, mg = setup.cfg, setup.mg
    out = []
    if setup.sharded:
        units = [u for w in setup.sharded for u in w.units]
        pad = sum(u.padded for u in units) - sum(u.numel for u in units)
        if pad:
            out.append(f"ZeRO's flat units are padded to a multiple of K={mg.size('fsdp')} "
                       f"elements ({pad} padding elements on this rank's units), which the "
                       f"planner's Ψ/K leaves out.")
    if setup.sharded and cfg.zero_stage in (1, 2) and cfg.hsdp_replicas > 1:
        out.append(f"ZeRO-{cfg.zero_stage} shards over the {mg.size('fsdp')} ranks of one "
                   f"replica (hsdp_replicas={cfg.hsdp_replicas}); the planner shards "
                   f"ZeRO-1/2 over all dp·cp = {cfg.parallel.dp * cfg.parallel.cp} data ranks.")
    tied = setup.tied.param if setup.tied is not None else None
    if setup.sharded and tied is not None and any(p is tied for p in setup.plain_params):
        out.append(f"The tied embedding's copy ({tied.numel()} parameters) stays outside "
                   f"ZeRO's flat units (its two copies, on the first and last stage, are "
                   f"summed first), whole on each of the {mg.size('fsdp')} shard ranks; the "
                   f"planner shards it with the rest.")
    if bf16_units and setup.expert_params:
        n = sum(p.numel() for p in setup.expert_params)
        out.append(f"The experts' {n} parameters stay fp32 outside the bf16 flat units (4/4/8 "
                   f"bytes each); the planner counts every parameter at 2/2/12.")
    if cfg.impl == "torch" and cfg.zero_stage == 3 and mg.size("fsdp") > 1:
        root = sum(p.numel() for m in setup.stages.values() for n, p in m.named_parameters()
                   if not n.startswith("layers."))
        out.append(f"PyTorch's FSDP2 keeps the root module's {root} parameters (embedding, "
                   f"final norm, head) unsharded from forward to backward; the planner counts "
                   f"every parameter sharded.")
    if cfg.parallel.pp > 1 and cfg.schedule in ("zb-v", "dualpipe-v"):
        name = {"zb-v": "ZB-V", "dualpipe-v": "DualPipeV"}[cfg.schedule]
        out.append(f"{name}'s V places the last stage (with the head) on pipeline rank 0; the "
                   "planner puts the head on the last pipeline rank.")
    return out
