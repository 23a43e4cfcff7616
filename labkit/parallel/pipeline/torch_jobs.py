"""The same pipeline under ``torch.distributed.pipelining``, for every schedule PyTorch also
has: a reference for parity and speed beside labkit's executor.

:func:`torch_schedule_train` runs ``cfg.schedule`` — ``gpipe`` (``ScheduleGPipe``),
``1f1b`` (``Schedule1F1B``), ``interleaved`` (``ScheduleInterleaved1F1B``, stage ``s`` on rank
``s mod P``) or ``zb-v`` (``ScheduleZBVZeroBubble``, the V placement: rank ``r`` holds stages
``r`` and ``2P−1−r``) — on the stages labkit builds for the same schedule (the placements
are the same), with the same data, optimizer and tied-embedding exchange
(:func:`~.jobs._train`). Its point-to-point traffic bypasses labkit.comm: it is a
reference, not part of labkit. The metrics say ``impl: "torch"``.
"""
from __future__ import annotations

from .config import PipelineConfig
from .jobs import _train
from .stage import StageModule, build_stages

__all__ = ["torch_schedule_train", "TORCH_SCHEDULES"]

#: labkit schedule name → torch.distributed.pipelining class name
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B", "zb-v": "ScheduleZBVZeroBubble"}


def torch_schedule_train(ctx, cfg: PipelineConfig) -> dict:
    """Train ``cfg`` with PyTorch's schedule of the same name (see the module docstring).

    Raises:
        ValueError: a schedule PyTorch lacks here (``zb-h1``), ``accum_steps != 1``,
            ``pp < 2``, or what ``cfg.validate`` refuses.
    """
    import torch.distributed.pipelining.schedules as ts
    from torch.distributed.pipelining import PipelineStage

    cfg.validate(ctx.world_size)
    if cfg.schedule not in TORCH_SCHEDULES:
        raise ValueError(f"schedule={cfg.schedule!r} has no torch.distributed.pipelining "
                         f"counterpart here; use one of {', '.join(TORCH_SCHEDULES)}")
    if cfg.accum_steps != 1 or cfg.pp < 2:
        raise ValueError(f"torch_schedule_train needs accum_steps=1 and pp >= 2, got "
                         f"accum_steps={cfg.accum_steps}, pp={cfg.pp}")
    sched, mc = cfg.build_schedule(), cfg.model_config
    local = sched.stages_of(ctx.rank)
    stages = build_stages(mc, local, sched.n_stages, cfg.seed, ctx.device)
    pstages = [PipelineStage(stages[s], s, sched.n_stages, ctx.device, group=ctx.group)
               for s in local]
    cls = getattr(ts, TORCH_SCHEDULES[cfg.schedule])
    # torch divides the summed microbatch gradients by M itself (scale_grads=True)
    schedule = cls(pstages if len(pstages) > 1 else pstages[0],
                   n_microbatches=cfg.microbatches, loss_fn=StageModule.loss, scale_grads=True)
    first, last = 0 in stages, sched.n_stages - 1 in stages

    def flush(x, y, scale, f):
        losses: list = []
        if first and last:
            schedule.step(x, target=y, losses=losses)
        elif first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        return sum(float(t.detach()) for t in losses) / cfg.microbatches if losses else 0.0

    out = _train(ctx, cfg, stages, flush, sched.stage_rank(sched.n_stages - 1))
    out["metrics"]["impl"] = "torch"
    return out
