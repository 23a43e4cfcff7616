"""The batch-size regimes of one model on one cluster (claim C42).

CS336 Lecture 7 (from Google's TPU parallelism guide; Austin et al. 2025, "How to Scale
Your Model", Part 5): with the model and the cluster fixed, the global batch decides the
layout —

* **small** batch: communication-bound whatever the layout — too few tokens per chip to
  hide any sharding's traffic, and too few sequences for data parallelism to reach every
  chip, so tensor parallelism must take the rest;
* **medium**: FSDP alone leaves its weight gathers exposed; FSDP combined with tensor
  parallelism (fewer, larger data shards) is needed to be compute-bound;
* **large**: pure FSDP (every chip a data shard) is as fast as anything.

:func:`batch_regimes` runs :func:`labkit.plan.search` (``labkit plan search``) at each
global batch three times — every layout, pure FSDP (``tp = cp = pp = 1``, ZeRO-3), FSDP with
tensor parallelism (``tp > 1``, ZeRO-3, no pipeline) — and names the regime by two rules:
small when the best layout reaches less than :data:`SMALL` of the best MFU over all the
batches (the compute-bound ceiling); large when pure FSDP is within :data:`LARGE` of the
best layout; medium between.
"""
from __future__ import annotations

from typing import Iterable, Optional, Union

from labkit.plan.hardware import ClusterSpec
from labkit.plan.models import PlanModel
from labkit.plan.search import search

__all__ = ["SMALL", "LARGE", "batch_regimes"]

#: below this fraction of the ceiling the best layout is communication-bound
SMALL = 0.5
#: pure FSDP within this relative MFU of the best layout: it suffices
LARGE = 0.03


def _best(res) -> Optional[object]:
    return res.best


def batch_regimes(model: Union[str, PlanModel], cluster: Union[str, ClusterSpec],
                  n_gpus: int, seq_len: int, batches: Iterable[int],
                  runtime: str = "llama3-2024", **search_kw) -> list[dict]:
    """One row per global batch (sequences): ``{"global_batch", "tokens_per_gpu",
    "best", "fsdp", "fsdp_tp"}`` (each a :class:`~labkit.plan.estimate.Plan` or
    ``None`` when no such layout fits or divides the batch), ``"exposed"`` (the best
    layout's exposed communication as a share of its step) and ``"regime"``
    (``"small"``, ``"medium"``, ``"large"``, or ``None`` when nothing fits).

    Raises:
        ValueError: as :func:`labkit.plan.search`.
    """
    rows = []
    for B in batches:
        kw = dict(global_batch=B, seq_len=seq_len, runtime=runtime, top=1, **search_kw)
        best = _best(search(model, cluster, n_gpus, **kw))
        fsdp = _best(search(model, cluster, n_gpus, tp=(1,), cp=(1,), pp=(1,), zero=(3,),
                            **kw))
        tps = [t for t in (2, 4, 8, 16, 32) if t <= n_gpus]
        fsdp_tp = _best(search(model, cluster, n_gpus, tp=tps, cp=(1,), pp=(1,), zero=(3,),
                               **kw))
        exposed = None
        if best is not None:
            exposed = sum(a.exposed for a in best.comm.values()) / best.step_time
        rows.append({"global_batch": B, "tokens_per_gpu": B * seq_len / n_gpus, "best": best,
                     "fsdp": fsdp, "fsdp_tp": fsdp_tp, "exposed": exposed})
    ceiling = max((r["best"].mfu for r in rows if r["best"] is not None), default=0.0)
    for r in rows:
        b, f = r["best"], r["fsdp"]
        if b is None:
            r["regime"] = None
        elif b.mfu < SMALL * ceiling:
            r["regime"] = "small"
        elif f is not None and f.mfu >= (1 - LARGE) * b.mfu:
            r["regime"] = "large"
        else:
            r["regime"] = "medium"
    return rows
