"""Jobs for tests/test_faults.py (importable by the ranks: tests/ is on their sys.path)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from labkit import comm
from labkit.faults import inject
from labkit.faults.spec import parse_faults


@dataclass(frozen=True)
class SkipConfig:
    """``steps`` steps of one all-reduce each; ``fault``, ``watchdog_s`` and
    ``straggler_s`` as in RunConfig."""

    steps: int = 4
    fault: Optional[str] = None
    watchdog_s: Optional[float] = 2.0
    straggler_s: Optional[float] = None
    timeout_s: float = 60.0


def all_reduce_steps(ctx, cfg: SkipConfig) -> list:
    """One all-reduce of 8 floats per step on the job's group; returns the sums seen."""
    inject.arm(parse_faults(cfg.fault), ctx.rank)
    out = []
    try:
        for s in range(cfg.steps):
            ctx.tracer.step = s
            inject.on_step(s)
            t = torch.full((8,), float(ctx.rank + 1))
            comm.all_reduce(t, group=ctx.group)
            out.append(t[0].item())
    finally:
        inject.disarm()
    return out
