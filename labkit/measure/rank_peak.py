"""The peak FLOP/s MFU divides by on one rank of a running job, with its provenance.

CUDA: the datasheet peak of the GPU for the dtype that ran (:mod:`labkit.measure.peak`).
CPU: the calibrated matmul rate of :func:`labkit.measure.cpu_peak.cpu_peak_reading`, run
on all ranks at once, split evenly: one rank's reading scatters when ranks share cores,
their mean does not. The CPU value is checked on every call (its age, the machine's load)
and measured again, by all ranks together, when it may no longer be a ceiling.
"""
from __future__ import annotations

from typing import Optional

import torch

from .cpu_peak import PeakReading, cpu_peak_reading
from .peak import device_peak_flops

__all__ = ["rank_peak_flops", "rank_peak", "any_rank", "peak_metrics"]


def _all_reduce(ctx, values: list, op: str) -> list:
    """``values`` reduced over ``ctx.group`` with tracing off (the job's trace holds only its
    own traffic)."""
    from .. import comm

    t = torch.tensor(values, dtype=torch.float64)
    enabled, ctx.tracer.enabled = ctx.tracer.enabled, False
    try:
        comm.all_reduce(t, op, ctx.group)
    finally:
        ctx.tracer.enabled = enabled
    return [float(v) for v in t.tolist()]


def any_rank(ctx, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank of ``ctx.group`` (collective when
    ``ctx.world_size > 1``)."""
    if ctx.world_size == 1:
        return bool(flag)
    return _all_reduce(ctx, [1.0 if flag else 0.0], "max")[0] > 0


def rank_peak(ctx, dtype: torch.dtype = torch.float32,
              refresh: bool = False) -> Optional[PeakReading]:
    """Peak FLOP/s of one rank of a running job, with when and how it was measured.

    CUDA: the datasheet peak for ``dtype`` as a reading with ``source="datasheet"`` (``None``
    for a GPU not in the table). CPU: a ``dtype`` matmul loop run on all ``ctx.world_size``
    ranks at once after a barrier, the mean of their rates — cached on disk, measured again
    when old, when the machine is quieter than when it was measured, or with ``refresh``.
    Every rank of ``ctx.group`` must call it (the decision to measure is the group's).
    """
    from .. import comm

    if ctx.is_cuda:
        key = ("peak", str(ctx.device), dtype)
        if key not in ctx.cache:
            flops = device_peak_flops(ctx.device, dtype)
            ctx.cache[key] = None if flops is None else PeakReading(
                flops, float("nan"), {"source": "datasheet"}, source="datasheet")
        return ctx.cache[key]
    multi = ctx.world_size > 1
    return cpu_peak_reading(
        dtype=dtype, ranks=ctx.world_size, refresh=refresh,
        barrier=(lambda: comm.barrier(ctx.group)) if multi else None,
        combine=(lambda v: _all_reduce(ctx, [v], "sum")[0] / ctx.world_size) if multi else None,
        decide=(lambda wish: any_rank(ctx, wish)) if multi else None)


def rank_peak_flops(ctx, dtype: torch.dtype = torch.float32) -> Optional[float]:
    """:func:`rank_peak`'s FLOP/s (``None`` for an unknown GPU)."""
    r = rank_peak(ctx, dtype)
    return None if r is None else r.flops


def peak_metrics(reading: Optional[PeakReading], now: Optional[float] = None) -> dict:
    """``{"peak_measured_at"`` (s since the epoch, ``None`` for a datasheet),
    ``"peak_age_s"``, ``"peak_conditions"``, ``"peak_source"}`` of a reading, plain data."""
    if reading is None:
        return {"peak_measured_at": None, "peak_age_s": None, "peak_conditions": None,
                "peak_source": None}
    measured = reading.measured_at == reading.measured_at  # NaN for a datasheet
    return {"peak_measured_at": reading.measured_at if measured else None,
            "peak_age_s": reading.age_s(now) if measured else None,
            "peak_conditions": dict(reading.conditions,
                                    **({"confirmed_load": reading.confirmed_load}
                                       if reading.confirmed_load is not None else {})),
            "peak_source": reading.source}
