"""Measured memory of ONE rank of a cluster-scale layout, on one CPU, with no real memory.

:func:`fake_rank_memory` runs labkit's own training job (:func:`labkit.train.run`: pipeline
split, tensor/sequence parallelism, checkpointing, ZeRO flat units, AdamW) for one rank of a
``RunConfig`` whose world may be thousands of ranks, under two stand-ins from torch:

* **fake tensors** (``torch._subclasses.fake_tensor.FakeTensorMode``): every tensor has its
  real shape, dtype and lifetime but no storage, so building a rank's stages of Llama 3 405B
  and running a step costs metadata only. With a pipeline the rank builds only the blocks
  its stages keep (and the embedding, final norm and head), where a real rank builds the
  whole model from the seed: no weight has a value here, and the bytes are the same;
* **a fake process group** (torch's ``"fake"`` backend with ``FakeStore``, from
  ``torch.testing._internal.distributed.fake_pg``): ``init_process_group`` with this rank's
  number and the layout's world size, groups created on demand for this rank's axes only.
  Every collective and send/recv labkit issues (through :mod:`labkit.comm`, traced as usual)
  returns at once and moves nothing: outputs keep the shape the real call would give, so
  buffers are allocated and freed where the real code allocates and frees them, but values
  are meaningless. A non-blocking send keeps its tensor alive until it is waited for, as
  gloo and NCCL do. Collectives between thousands of processes cannot run in one process;
  this is the local, shape-correct stand-in.

Data-dependent reads (``tensor.item()``, ``bool(tensor)``) have no value under fake tensors;
the fake-tensor mode answers each with ``1`` (``False`` for a bool), which keeps Adam's bias
correction finite and labkit's input checks quiet. Losses are therefore not computed.

The bytes are counted by the job's own tracker (:func:`labkit.measure.measure_memory`, torch's
``MemTracker``), exactly as in a real run, so the report has the same categories and, for a
shard small enough to run for real, the same numbers (``tests/test_fake_rank.py``). The
activations are also itemised by role (:mod:`labkit.measure.activation_roles`) at their own
peak, the figure a planner's per-rank activation memory describes.
:func:`planned_rank_memory` gives :mod:`labkit.plan`'s prediction for the same rank, both as
Megatron-LM keeps activations and with what labkit's job keeps beyond that
(:mod:`labkit.plan.implementation`).

Measured (``benchmarks/fake_rank_405b.py``; machine shared, CPU seconds of this process):
Llama 3 405B at TP 8 × PP 16 × DP 128 = 16,384 ranks (126 layers as 7, 8, …, 8, 7 — one
fewer on the first and last stage, as Llama 3 did), sequence 8,192, 16 microbatches, 1F1B,
ZeRO-1, bf16, sequence parallelism, full recomputation. Parameters and gradients equal the
planner's to the byte, the optimizer state differs only by Adam's 4-byte step counters. At
its activation peak pipeline rank 1 (rank 1024: 8 layers, 15 microbatches in flight, the
rank the planner finds fullest) holds 5.021 GiB: the layer inputs the planner counts (3.750
GiB, to the byte), 15 stage outputs (0.469 GiB: kept until the flush ends; Megatron-LM
frees them once sent), 15 microbatches' rotary tables (0.059 GiB, to the byte), the
temporaries of the layer whose forward is running (0.648 GiB: the peak falls in the last
microbatch's forward, since a rebuilt layer keeps only C18's count plus the norms' 1/rms,
0.536 GiB) and, not modelled, 2 receive buffers (0.062 GiB) and the first microbatch's
received input, which torch's tracker keeps after its backward (0.031 GiB). Planned with
labkit's terms 4.844 GiB (-3.5 %); Megatron-LM's accounting 4.348 GiB (-13 %). Without
recomputation the rank holds 72.68 GiB, planned 72.34 (-0.5 %), Megatron-LM's 71.78
(-1.2 %). (Before labkit's layers kept what C18 counts: 5.717 and 151.53 GiB.)
30-42 s of CPU per rank on the shared 2-core machine (load 1-10), nearly all of it the
tracked step: torch's fake-tensor dispatch (~45 %) under the memory trackers, autograd and
recomputation; building the stage's 8 blocks costs 0.05 s, the whole model's 126 took 0.8.

Only one process group can exist per process: the fake one is created and destroyed here,
and :func:`fake_rank_memory` refuses to run where ``torch.distributed`` is already
initialised (a rank of a real job).
"""
from __future__ import annotations

import time
from dataclasses import replace

from .fake_world import (_context, _fake_mode, _p2p_holds_tensors,  # noqa: F401
                         check_fake_rank, fake_process_group)

__all__ = ["fake_rank_memory", "planned_rank_memory", "compare", "CATEGORIES_COMPARED",
           "fake_process_group", "check_fake_rank"]

#: the categories measured and planned alike (bytes)
CATEGORIES_COMPARED = ("parameters", "gradients", "optimizer", "activations")

def fake_rank_memory(cfg, rank: int = 0, steps: int = 1, *,
                     stage_layers_only: bool = True) -> dict:
    """Memory of rank ``rank`` of ``cfg`` (a :class:`labkit.config.RunConfig`) for one
    training step, measured under fake tensors and a fake process group.

    ``cfg.model`` may be a ``ModelConfig`` of any size (pass the ``ModelConfig`` of a
    planning-only preset such as ``llama3-405b`` rather than its name). ``steps`` steps are
    run and the last one is tracked, as the real job does (FLOPs are not counted).
    ``stage_layers_only`` (default): with a pipeline, build only the blocks this rank's
    stages keep, plus the embedding, final norm and head (:class:`labkit.models.gpt.GPT`'s
    ``layers``); ``False`` builds the whole model first, as a real rank does. The bytes are
    the same (``tests/test_fake_rank.py``); the whole 405B costs ~0.8 s more per rank.

    Returns:
        ``{"memory": <the job's metrics["memory"]: peak bytes by category, model_state,
        timeline>, "activations": {"peak": the activations' own peak in the tracked step,
        "by_role": bytes by role at that peak, "at_total_peak": bytes by role when the
        tracked total peaked} (roles: :data:`labkit.measure.activation_roles.ROLES`),
        "rank": rank, "coords": {axis: index}, "stages": [...], "rank_params": parameters of
        this rank's stages (one tp shard, unsharded by ZeRO), "n_params", "world_size",
        "wall_s": seconds}``.

    Raises:
        ValueError: ``rank`` outside the world, or an invalid ``cfg`` (from validation).
        RuntimeError: ``torch.distributed`` is already initialised in this process.
    """
    from labkit import train
    from labkit.train.pipeline import boundary_shape

    from .activation_roles import RoleLedger, itemised_tracker, stage_output_blocks

    world = check_fake_rank(cfg, rank)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    cfg = replace(cfg, steps=steps, measure_memory=True, count_flops=False)
    cfg.validate(world)
    mc = cfg.model_config
    ledger = RoleLedger(boundary_shape(cfg), mc.head_dim // 2)
    t0 = time.perf_counter()
    with fake_process_group(cfg, rank, stage_layers_only) as ctx, \
            _p2p_holds_tensors(ledger), itemised_tracker(ledger), _fake_mode():
        out = train.run(ctx, cfg)
    m = out["metrics"]
    last = stage_output_blocks(mc.n_layers, cfg.n_stages, m["stages"]) \
        if mc.kind == "gpt" else set()
    acts = {"peak": ledger.peak, "by_role": ledger.resolve(ledger.at_peak, last),
            "at_total_peak": ledger.resolve(ledger.at_total_peak, last)}
    return {"memory": m["memory"], "activations": acts, "rank": rank, "coords": m["coords"],
            "stages": m["stages"], "rank_params": m["rank_params"], "n_params": m["n_params"],
            "world_size": world, "wall_s": time.perf_counter() - t0}


def _layout(cfg):
    from labkit.plan.layout import MESH_ORDER, Layout

    ckpt = {"none": "none", "selective": "selective", "full": "full", "every": "full"}
    if cfg.checkpoint not in ckpt or (cfg.checkpoint == "every" and cfg.checkpoint_every != 1):
        raise ValueError(f"the planner models checkpoint 'none', 'selective' or 'full', got "
                         f"checkpoint={cfg.checkpoint!r} (every {cfg.checkpoint_every})")
    p = cfg.parallel
    sched = cfg.schedule if cfg.schedule in ("gpipe", "1f1b", "interleaved") else None
    if p.pp > 1 and sched is None:
        raise ValueError(f"the planner models gpipe, 1f1b and interleaved, got "
                         f"schedule={cfg.schedule!r}")
    # one pipeline flush is what the planner's schedule keeps in flight
    m = cfg.flush_microbatches if p.pp > 1 else cfg.accum_steps
    return Layout(tp=p.tp, cp=p.cp, pp=p.pp, dp=p.dp, zero=cfg.zero_stage, microbatch=cfg.micro,
                  global_batch=p.dp * cfg.micro * m,
                  seq_len=cfg.model_config.seq_len, schedule=sched or "1f1b",
                  virtual_stages=cfg.stages_per_rank if p.pp > 1 and sched == "interleaved"
                  else 1, checkpoint=ckpt[cfg.checkpoint],
                  sequence_parallel=cfg.sequence_parallel, order=MESH_ORDER, ep=p.ep)


def planned_rank_memory(cfg, rank: int = 0) -> dict:
    """:mod:`labkit.plan`'s bytes by category for the pipeline rank of ``rank`` under
    ``cfg``: the same layout (mesh order, ZeRO stage, microbatch, schedule, checkpointing,
    sequence parallelism), gradients at the job's width (2 bytes with bf16 ZeRO units,
    else 4), the pipeline split labkit runs (:mod:`labkit.parallel.pipeline.split`).

    Activations are predicted twice: ``"activations_megatron"`` as Megatron-LM keeps them
    (:func:`labkit.plan.activations.activation_bytes_per_rank`), and ``"activations"`` with
    what labkit's job keeps beyond that (:func:`labkit.plan.implementation.
    labkit_activation_terms`, itemised in ``"activation_terms"``; for the selective policy,
    which that does not model, the two are equal and the terms empty).

    Returns:
        ``{"parameters", "gradients", "optimizer", "activations", "activations_megatron",
        "activation_terms", "comm_buffers", "total", "pp_rank", "layers"}`` (bytes;
        ``layers`` of that pipeline rank; ``total`` with ``"activations"``).
    """
    from labkit.plan.estimate import _buffers, _local_params
    from labkit.plan.implementation import labkit_activation_terms
    from labkit.plan.layout import stage_layers
    from labkit.plan.memory import rank_memory
    from labkit.plan.models import plan_model
    from labkit.plan.runtime import runtime_preset

    lay = _layout(cfg)
    m = plan_model(cfg.model_config)
    lay.check(m)
    pp_rank = cfg.mesh.coords(rank)["pp"]
    layers = stage_layers(m.n_layers, lay.pp)
    params, per_layer = _local_params(m, lay, layers)
    if lay.checkpoint == "selective":
        from labkit.plan.activations import activation_bytes_per_rank

        mega, terms = activation_bytes_per_rank(m, lay, layers)["per_rank"][pp_rank], {}
        act = mega
    else:
        kept = labkit_activation_terms(m, lay, layers, 2 if cfg.precision == "bf16" else 4)
        mega = kept["megatron"]["per_rank"][pp_rank]
        terms = dict(kept["per_rank"][pp_rank])
        act = terms.pop("total")
    mixed = cfg.precision == "bf16" and cfg.zero_stage > 0
    r = replace(runtime_preset("megatron-2021"), grad_bytes=2 if mixed else 4)
    shard = cfg.mesh.dp_shard * cfg.mesh.cp  # labkit's ZeRO units shard over the fsdp view
    out = rank_memory(params[pp_rank], lay.zero, shard, r.grad_bytes, act,
                      _buffers(m, lay, r, per_layer))
    out.update(activations_megatron=mega, activation_terms=terms, pp_rank=pp_rank,
               layers=layers[pp_rank])
    return out


def compare(measured: dict, planned: dict) -> dict:
    """``{category: {"measured", "planned", "error"}}`` for :data:`CATEGORIES_COMPARED`,
    plus ``"activations (Megatron)"`` when ``planned`` has that prediction: model state at
    its largest over the step; activations at their own peak when ``measured`` comes from
    :func:`fake_rank_memory` (else the tracked peak's, or a mark's if larger); ``error`` is
    ``planned / measured − 1`` (``nan`` when nothing was measured)."""
    mem = measured["memory"]
    if "activations" in measured:
        act = measured["activations"]["peak"]
    else:
        act = max([mem["peak"]["activations"]] + [v["activations"] for _, v in mem["timeline"]])
    got = dict(mem["model_state"], activations=act)
    rows = [(c, c) for c in CATEGORIES_COMPARED]
    if "activations_megatron" in planned:
        rows.append(("activations (Megatron)", "activations_megatron"))
    out = {}
    for name, key in rows:
        meas, plan = float(got[name.split(" ")[0]]), float(planned[key])
        out[name] = {"measured": meas, "planned": plan,
                     "error": plan / meas - 1 if meas else float("nan")}
    return out
