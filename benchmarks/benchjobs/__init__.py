"""Jobs used only by the benchmarks (a package, so ``make bench``'s ``benchmarks/*.py`` glob
does not run it). The scripts put ``benchmarks/`` on ``sys.path`` before starting a
``Cluster``; the cluster hands its ``sys.path`` to the ranks, so they import these by name.
"""
from __future__ import annotations

from labkit.train import run

__all__ = ["train_traced", "train_untraced", "timed_train", "matmul_burn"]


def train_traced(ctx, cfg) -> dict:
    """``labkit.train.run`` with the tracer on (the default), through the same call path as
    :func:`train_untraced` so the comparison differs only in tracing."""
    ctx.tracer.enabled = True
    return run(ctx, cfg)


def train_untraced(ctx, cfg) -> dict:
    """``labkit.train.run`` with the tracer off: no compute or comm events are recorded
    (step times are still read from the tracer's clock)."""
    ctx.tracer.enabled = False
    return run(ctx, cfg)


def timed_train(ctx, cfg) -> dict:
    """``labkit.train.run`` inside one traced ``job`` region: the rank's own job time."""
    with ctx.tracer.region("job"):
        return run(ctx, cfg)


def matmul_burn(ctx, n: int) -> tuple:
    """``(wall s, CPU s of this thread)`` for ``n`` 256×256 float32 matmuls on this rank:
    compute only, no communication (benchmarks/multinode.py's cost of emulated nodes). The
    CPU time does not count the time a rank waits for a core on a shared machine."""
    import time

    import torch

    a = torch.randn(256, 256)
    torch.mm(a, a)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        a = torch.mm(a, a).clamp_(-1, 1)
    return time.perf_counter() - t0, time.thread_time() - c0
