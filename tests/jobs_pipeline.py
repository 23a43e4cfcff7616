"""Test-only pipeline jobs: several pipelines at once on one pool, peers by global rank.

:func:`concurrent_pipelines` lays a ``Mesh(pp=P, dp_replicate=D)`` over the job's ranks, so
pipeline ``d`` runs on the global ranks ``mesh.group(rank, "pp")`` (``(0, 2)`` and
``(1, 3)`` for ``P = D = 2``), and runs all of them at the same time, each with its own
seed (``cfg.seed + d``: its own weights and data), so a message delivered to the wrong
pipeline changes the numbers. Each rank returns what :func:`labkit.parallel.pipeline.jobs.
pipeline_train` returns (losses on the pipeline's stage-rank 0, first-step grads and final
state by full-model name) plus ``pp_ranks`` and ``dp``.
"""
from __future__ import annotations

import torch

from labkit import comm
from labkit.mesh import Mesh
from labkit.parallel.pipeline.config import PipelineConfig
from labkit.parallel.pipeline.executor import PipelineExecutor
from labkit.parallel.pipeline.jobs import _batch, _named_params
from labkit.parallel.pipeline.stage import (ActivationMeter, TiedEmbedding, WeightGradStore,
                                            build_stages)


def concurrent_pipelines(ctx, cfg: PipelineConfig) -> dict:
    dp = ctx.world_size // cfg.pp
    mesh = Mesh(pp=cfg.pp, dp_replicate=dp)
    groups = ctx.mesh_groups(mesh)
    pp_ranks, me, d = groups.ranks("pp"), groups.index("pp"), groups.index("dp_replicate")
    group = groups.group("pp")
    cfg = cfg.replace(seed=cfg.seed + d)
    sched, mc = cfg.build_schedule(), cfg.model_config
    store = WeightGradStore() if sched.split_backward else None
    stages = build_stages(mc, sched.stages_of(me), sched.n_stages, cfg.seed, ctx.device,
                          split_backward=sched.split_backward, store=store)
    meter = ActivationMeter(list(stages.values()), enabled=cfg.measure_memory)
    dtype = next(iter(stages.values())).rope_cos.dtype
    ex = PipelineExecutor(sched, stages, me, group, (cfg.micro, mc.seq_len, mc.d_model), dtype,
                          ctx.device, store, meter, pp_ranks=pp_ranks)
    tie = TiedEmbedding(mc, sched, me, stages, group, pp_ranks=pp_ranks)
    params = _named_params(stages)
    opt = torch.optim.AdamW(params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses, out = [], {}
    for step in range(cfg.steps):
        x, y = _batch(cfg, step)
        losses.append(ex.run(x, y, 1.0 / cfg.microbatches))
        tie.sync()
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in params.items()
                            if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    last = sched.stage_rank(sched.n_stages - 1)
    buf = torch.tensor(losses, dtype=torch.float64)
    if last != 0 and me == last:
        comm.send(buf, pp_ranks[0], group, axis="pp")
    elif last != 0 and me == 0:
        comm.recv(buf, pp_ranks[last], group, axis="pp")
    out.update(losses=buf.tolist() if me in (0, last) else [], pp_ranks=pp_ranks, dp=d,
               state={n: p.detach().clone() for n, p in params.items()},
               metrics={"rank": ctx.rank, "peak_inflight": meter.peak_count})
    return out
