"""The peak FLOP/s MFU divides by on one rank of a running job.

CUDA: the datasheet peak of the GPU for the dtype that ran (:mod:`labkit.measure.peak`).
CPU: the calibrated matmul rate of :func:`labkit.measure.cpu_peak.calibrate_cpu_peak`, run
on all ranks at once, split evenly: one rank's reading scatters when ranks share cores,
their mean does not.
"""
from __future__ import annotations

from typing import Optional

import torch

from .cpu_peak import calibrate_cpu_peak
from .peak import device_peak_flops

__all__ = ["rank_peak_flops"]


def rank_peak_flops(ctx, dtype: torch.dtype = torch.float32) -> Optional[float]:
    """Peak FLOP/s of one rank of a running job, cached in ``ctx.cache`` for the process.

    CUDA: the datasheet peak for ``dtype`` (``None`` for a GPU not in the table). CPU: a
    ``dtype`` matmul loop run on all ``ctx.world_size`` ranks at once after a barrier, and
    the mean of their rates (an all-reduce with tracing off, so the job's trace holds only its
    own traffic). Every rank of ``ctx.group`` must call it.
    """
    from .. import comm

    key = ("peak", str(ctx.device), ctx.world_size, dtype)
    if key in ctx.cache:
        return ctx.cache[key]
    if ctx.is_cuda:
        ctx.cache[key] = device_peak_flops(ctx.device, dtype)
        return ctx.cache[key]

    def mean_over_ranks(flops: float) -> float:
        t = torch.tensor([flops], dtype=torch.float64)
        enabled, ctx.tracer.enabled = ctx.tracer.enabled, False
        try:
            comm.all_reduce(t, "sum", ctx.group)
        finally:
            ctx.tracer.enabled = enabled
        return float(t.item()) / ctx.world_size

    multi = ctx.world_size > 1
    ctx.cache[key] = calibrate_cpu_peak(
        dtype=dtype, ranks=ctx.world_size,
        barrier=(lambda: comm.barrier(ctx.group)) if multi else None,
        combine=mean_over_ranks if multi else None)
    return ctx.cache[key]
