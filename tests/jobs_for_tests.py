"""Jobs used only by the tests. Importable by the ranks because pytest puts tests/ on
sys.path and the cluster hands its sys.path to the ranks."""
from __future__ import annotations

import importlib

import torch
from torch import nn

from labkit.parallel.dp import DataParallel


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head_a = nn.Linear(4, 1)
        self.head_b = nn.Linear(4, 1)  # never used in forward

    def forward(self, x):
        return self.head_a(torch.relu(self.body(x))).mean()


def two_heads(ctx, cfg) -> dict:
    """One DP step of a model whose ``head_b`` gets no gradient. ``cfg`` is
    ``(mode, find_unused)``; returns the synced gradients (``None``: none)."""
    mode, find_unused = cfg
    torch.manual_seed(0)
    model = DataParallel(TwoHeads(), ctx.group, mode=mode, bucket_mb=1.0,
                         find_unused=find_unused)
    x = torch.full((2, 4), float(ctx.rank + 1))
    model(x).backward()
    model.finish_gradient_sync()
    return {n: None if p.grad is None else p.grad.clone()
            for n, p in model.module.named_parameters()}


def error_of(ctx, cfg):
    """Run the job ``cfg = ("module:function", its config)`` on this rank and return what it
    raised, ``{"type": class name, "message": str}``, or ``None`` if it returned.

    For errors a job raises on every rank alike before any mismatched collective (so the
    group stays consistent, e.g. DataParallel's unused-parameter error): a test reads every
    rank's message without the pool restart a ``RankError`` costs. A rank that did not raise
    while another did would wait in a collective: the run's timeout then fails the test."""
    name, job_cfg = cfg
    module, fn = name.split(":")
    job = getattr(importlib.import_module(module), fn)
    try:
        job(ctx, job_cfg)
    except Exception as exc:  # noqa: BLE001 - handed back to the test as data
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


def gradients(ctx, cfg) -> dict:
    """The synced gradient of a one-row-per-rank mean loss (the world-size-factor check)."""
    mode = cfg
    torch.manual_seed(0)
    model = DataParallel(nn.Linear(3, 1), ctx.group, mode=mode)
    rows = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 5.0, 0.5]])
    model(rows[ctx.rank:ctx.rank + 1]).pow(2).mean().backward()
    model.finish_gradient_sync()
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


def mean_of_two_rows_gradient() -> dict:
    """Single-process reference for the mean-not-sum checks: the gradient of the mean loss
    over both rows that ``gradients`` (and ZeRO's ``zero_gradients``) split one per rank."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    rows = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 5.0, 0.5]])
    lin(rows).pow(2).mean().backward()
    return {"weight": lin.weight.grad, "bias": lin.bias.grad}


def rank_peak(ctx, cfg=None) -> float:
    """This rank's CPU peak FLOP/s as the training jobs compute it."""
    from labkit.measure.rank_peak import rank_peak_flops

    return rank_peak_flops(ctx)


def group_count(ctx, cfg=None) -> dict:
    """How many process groups this rank has: labkit's cache and torch's own registry."""
    from torch.distributed import distributed_c10d as c10d

    return {"labkit_groups": len(ctx.groups), "torch_groups": len(c10d._world.pg_names)}
