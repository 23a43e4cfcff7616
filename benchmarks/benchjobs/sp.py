"""The training job's own step, timed and profiled, for ``benchmarks/sp_step_time.py``.

Only labkit APIs that exist before and after the layer-memory change are used
(``build_rank``, ``make_step``), so the same job runs against either checkout.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def _step(ctx, cfg):
    from labkit.train.build import build_rank
    from labkit.train.step import make_step

    torch.set_num_threads(1)  # one intra-op thread per rank, in both arms
    cfg.validate(ctx.world_size)
    setup = build_rank(ctx, cfg, ctx.mesh_groups(cfg.mesh))
    return make_step(setup)


def sp_step_times(ctx, cfg) -> dict:
    """``{"wall": [s], "cpu": [s]}`` per step of ``cfg.steps`` (forward, backward, gradient
    sync, AdamW: the job's ``make_step``) on this rank. Each step starts at a barrier, so
    the slowest rank's wall time is the step's. ``cpu``: this process's CPU seconds in the
    step, all its threads (gloo's included) — the work, not the wait for a core."""
    step = _step(ctx, cfg)
    wall, cpu = [], []
    for s in range(cfg.steps):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        step(s, lambda label: None)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"wall": wall, "cpu": cpu}


def sp_profile(ctx, cfg) -> str:
    """torch.profiler's operator table (self CPU time) over ``cfg.steps`` steps after two
    warm-up steps, on this rank."""
    from torch.profiler import ProfilerActivity, profile

    step = _step(ctx, cfg)
    for s in range(2):
        step(s, lambda label: None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(2, 2 + cfg.steps):
            step(s, lambda label: None)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                     max_name_column_width=50)
