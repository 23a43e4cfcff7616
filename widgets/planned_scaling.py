"""The planned panel's scaling rule: a lab ``RunConfig`` as a cluster-scale
:class:`labkit.plan.Layout` (:func:`scale`), said in words under the panel (:func:`rule_text`).

* **TP, CP and PP keep the lab's degrees; DP fills the GPUs**: ``dp = GPUs / (tp·cp·pp)``
  (refused when that is not whole);
* each data-parallel rank runs the lab's pipeline flush of ``m`` microbatches
  (``RunConfig.flush_microbatches``), each one sequence of the model's length, so the
  global batch is ``dp · m`` sequences (the batch is shared by DP and microbatches, C38);
* the ZeRO stage, HSDP replica groups (ZeRO-3), schedule and its virtual stages,
  recomputation and sequence parallelism are the lab's; ranks are numbered as the lab's
  mesh numbers them (TP innermost, PP outermost: :func:`labkit.plan.layout_from_mesh`);
* the planner plans bf16 mixed precision with fp32 gradients (runtime ``llama3-2024``)
  whatever the lab's precision, and context parallelism as Llama 3's all-gather of K and V.

What the planner does not model is refused, naming it: the zero-bubble schedules, HSDP
under ZeRO-1/2, segments of more than one block for ``checkpoint="every"``;
:func:`labkit.plan.estimate` refuses the rest (e.g. ``tp`` not dividing the heads, or the
lab's ``ep`` on a dense model). The panel offers dense presets (:data:`MODELS`) for a dense
lab model and mixture-of-experts presets (:data:`MOE_MODELS`) for ``tiny-moe``, so the lab's
``ep`` is planned.
"""
from __future__ import annotations

from typing import Optional

from labkit.mesh import Mesh
from labkit.plan import cluster_preset, plan_model
from labkit.plan.layout import SCHEDULES, Layout, layout_from_mesh

__all__ = ["MODELS", "MOE_MODELS", "RUNTIME", "scale", "gpu_counts", "rule_text"]

#: models offered for a dense lab model (labkit.plan presets)
MODELS = ("llama3.2-1b", "llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b")
#: models offered for a mixture-of-experts lab model (tiny-moe): the lab's ep is planned
MOE_MODELS = ("qwen1.5-moe-a2.7b", "deepseek-v3")
#: what the implementation overlaps (labkit.plan.runtime): Llama 3's
RUNTIME = "llama3-2024"


def gpu_counts(cluster) -> list:
    """GPU counts offered on ``cluster``: powers of two from one server up, and all of it."""
    c = cluster_preset(cluster)
    n, out = c.gpus_per_node, []
    while n < c.n_gpus:
        out.append(n)
        n *= 2
    return out + [c.n_gpus]


def scale(cfg, n_gpus: int) -> tuple:
    """``(Layout, notes)``: the lab configuration ``cfg`` (a ``RunConfig``) scaled to
    ``n_gpus`` GPUs by the module's rule; ``notes`` say where the plan differs from the lab.

    Raises:
        ValueError: what the rule or the planner cannot express (naming the field and the
            numbers).
    """
    p = cfg.parallel
    inner = p.tp * p.cp * p.pp
    if n_gpus % inner:
        raise ValueError(f"dp fills the GPUs: {n_gpus:,} GPUs / (tp x cp x pp = {p.tp} x "
                         f"{p.cp} x {p.pp} = {inner}) is not whole")
    dp, zero = n_gpus // inner, cfg.zero_stage
    sched = cfg.schedule if p.pp > 1 else "1f1b"
    if sched not in SCHEDULES:
        raise ValueError(f"schedule={sched!r}: the planner models {', '.join(SCHEDULES)}")
    replicas = cfg.hsdp_replicas if zero >= 1 else 1
    if replicas > 1 and zero < 3:
        raise ValueError(f"hsdp_replicas={replicas} with zero_stage={zero}: the planner "
                         "models HSDP under ZeRO-3 only")
    if replicas > 1 and dp % replicas:
        raise ValueError(f"hsdp_replicas={replicas} does not divide the planned dp={dp}")
    ckpt = cfg.checkpoint
    if ckpt == "every":
        if cfg.checkpoint_every != 1:
            raise ValueError(f"checkpoint='every' with checkpoint_every="
                             f"{cfg.checkpoint_every}: the planner models recomputation of "
                             "every block or none")
        ckpt = "full"
    m = cfg.flush_microbatches
    # ep as in the lab: the planner refuses it for a dense model, naming the model
    mesh = Mesh(pp=p.pp, dp_replicate=replicas, dp_shard=dp // replicas, cp=p.cp, tp=p.tp,
                ep=p.ep)
    lay = layout_from_mesh(mesh, zero=zero, microbatch=1, global_batch=dp * m,
                           schedule=sched, checkpoint=ckpt,
                           virtual_stages=cfg.stages_per_rank if sched == "interleaved" else 1,
                           sequence_parallel=bool(cfg.sequence_parallel))
    notes = []
    if cfg.precision != "bf16":
        notes.append(f"the lab runs {cfg.precision}; the plan is bf16 mixed precision")
    if p.cp > 1 and cfg.cp_method != "allgather":
        notes.append(f"the lab's cp runs {cfg.cp_method}; the plan all-gathers K and V "
                     "(Llama 3)")
    if p.pp > 1 and cfg.flushes > 1:
        notes.append(f"the lab runs {cfg.flushes} flushes of {m} microbatches a step; "
                     "the plan one")
    return lay, notes


def rule_text(cfg, lay: Optional[Layout], n_gpus: int, model) -> str:
    """The scaling rule with this configuration's numbers (plain text)."""
    p = cfg.parallel
    head = (f"TP {p.tp}, CP {p.cp}, PP {p.pp} as in the lab; DP fills the GPUs: "
            f"{n_gpus:,} / ({p.tp}·{p.cp}·{p.pp})")
    if lay is None:
        return head + "."
    m = plan_model(model)
    hs = f" in {lay.dp * lay.cp // lay.dp_shard} HSDP replica groups" if lay.dp_shard else ""
    sched = "" if lay.pp == 1 else (f"; {lay.schedule}" + (f" V={lay.virtual_stages}"
                                                          if lay.virtual_stages > 1 else ""))
    return (f"{head} = {lay.dp:,}. Each data-parallel rank runs the lab's "
            f"{lay.microbatches} microbatch{'es' * (lay.microbatches > 1)} of one "
            f"{m.seq_len:,}-token sequence: global batch {lay.dp:,} × {lay.microbatches} = "
            f"{lay.global_batch:,} sequences. ZeRO-{lay.zero}{hs}{sched}; recompute "
            f"{lay.checkpoint}; sequence parallel {'on' if lay.sp else 'off'}; ranks "
            f"numbered as the lab's mesh (TP innermost, PP outermost); runtime {RUNTIME}.")
