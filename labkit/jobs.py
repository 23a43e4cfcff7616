"""Jobs: module-level functions ``job(ctx, config) -> plain data`` that ranks import.

The training job lives in :mod:`labkit.train`; this module gathers what a notebook or the
CLI hands to :meth:`labkit.Cluster.run`, plus small jobs that show how the cluster behaves
(who is where, what a failing or hanging rank looks like).
"""
from __future__ import annotations

import os
import time

import torch

from . import comm
from .config import RunConfig

__all__ = ["hello", "fail", "sleep", "all_reduce_demo", "train"]


def hello(ctx, config=None) -> dict:
    """Each rank reports who and where it is, and all-reduces its rank id.

    Returns ``{"rank", "world_size", "pid", "device", "backend", "threads", "rank_sum"}``;
    ``rank_sum`` equals ``world_size·(world_size−1)/2`` on every rank.
    """
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    comm.all_reduce(t, group=ctx.group)
    return {"rank": ctx.rank, "world_size": ctx.world_size, "pid": os.getpid(),
            "device": str(ctx.device), "backend": ctx.backend,
            "threads": torch.get_num_threads(), "rank_sum": t.item()}


def fail(ctx, config=None) -> None:
    """Raise on rank ``config`` (default 1) after the others entered a collective.

    Without care the healthy ranks would wait in the all-reduce forever; the cluster
    surfaces the failure as ``RankError`` and restarts instead.
    """
    bad = 1 if config is None else int(config)
    if ctx.rank == bad:
        raise RuntimeError(f"deliberate failure on rank {ctx.rank}")
    comm.all_reduce(torch.ones(1, device=ctx.device), group=ctx.group)


def sleep(ctx, config=None) -> float:
    """Sleep ``config`` seconds (default 3600): a stand-in for a hung job."""
    seconds = 3600.0 if config is None else float(config)
    time.sleep(seconds)
    return seconds


def all_reduce_demo(ctx, config=None) -> dict:
    """All-reduce a small vector ``rank+1``; returns the input and the result."""
    n = 4 if config is None else int(config)
    x = torch.full((n,), float(ctx.rank + 1), device=ctx.device)
    before = x.tolist()
    comm.all_reduce(x, group=ctx.group)
    return {"before": before, "after": x.tolist()}


def train(ctx, config: RunConfig) -> dict:
    """Train ``config`` (a :class:`labkit.config.RunConfig`): every parallelism its degrees
    name, composed on one mesh; see :func:`labkit.train.run`."""
    from .train import run

    return run(ctx, config)
